#!/usr/bin/env python
"""ignored_layers `re:` patterns: time to match a model's module names, Python's backtracking
re against fx_fp8's linear-time automaton (fx_fp8.patterns._Automaton).

Legitimate patterns are matched against the names of a large diffusers-like model (60 double
blocks + 60 single blocks, ~1000 linears); catastrophic shapes against one 40-character name
that does not match, with Python's re only where it finishes in a few seconds (the others are
given as a step-count estimate, never run).

    OMP_NUM_THREADS=1 python benchmarks/pattern_matching.py
"""
from __future__ import annotations

import re
import re._parser as sre_parse
import time

from fx_fp8.patterns import _Automaton, _backtracking_hazard

NAMES = ([f"transformer_blocks.{i}.{m}" for i in range(60) for m in (
    "norm1.linear", "norm1_context.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
    "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
    "ff_context.net.0.proj", "ff_context.net.2")]
         + [f"single_transformer_blocks.{i}.{m}" for i in range(60) for m in (
             "norm.linear", "proj_mlp", "proj_out", "attn.to_q", "attn.to_k", "attn.to_v")]
         + ["time_text_embed.timestep_embedder.linear_1", "context_embedder", "x_embedder", "norm_out.linear",
            "proj_out"])

LEGIT = [r"transformer_blocks\.\d+\.attn\..*", r".*(norm|proj_out).*", r"(.*\.)?norm[^.]*\.linear", r"proj_out",
         r"(blocks\.\d+\.)*attn"]
#: shape, Python's re run on the 40-character name? (False: it would take hours or more)
CATASTROPHIC = [(r"(a|a)*z", "a" * 22, True), (r".*.*.*.*.*.*z", "single_transformer_blocks.37.attn.to_out", True),
                (r"(.*.*)*z", "single_transformer_blocks.37.attn.to_out", False),
                (r"(a+)+z", "a" * 40, False)]


def best(fn, repeat=3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    print(f"{len(NAMES)} module names")
    print("| pattern | matcher fx_fp8 uses | matches | Python re (ms, all names) | automaton, first pass (ms) "
          "| automaton, cached steps (ms) | automaton build (ms) |")
    print("|---|---|---|---|---|---|---|")
    for p in LEGIT:
        rx = re.compile(p)
        t0 = time.perf_counter()
        auto = _Automaton.build(sre_parse.parse(p))
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        hits = sum(auto.fullmatch(n) for n in NAMES)
        first = time.perf_counter() - t0
        assert hits == sum(rx.fullmatch(n) is not None for n in NAMES), p
        t_re = best(lambda: [rx.fullmatch(n) for n in NAMES])
        t_auto = best(lambda: [auto.fullmatch(n) for n in NAMES])
        used = "automaton" if _backtracking_hazard(list(sre_parse.parse(p))) else "re"
        print(f"| `{p}` | {used} | {hits} | {t_re * 1e3:.2f} | {first * 1e3:.1f} | {t_auto * 1e3:.1f} "
              f"| {build * 1e3:.2f} |")
    print()
    print("| catastrophic pattern | name length | Python re (s) | automaton (ms) |")
    print("|---|---|---|---|")
    for p, name, run_re in CATASTROPHIC:
        auto = _Automaton.build(sre_parse.parse(p))
        t_auto = best(lambda: auto.fullmatch(name))
        t_re = f"{best(lambda: re.fullmatch(p, name), repeat=1):.2f}" if run_re else "not run (hours or more)"
        print(f"| `{p}` | {len(name)} | {t_re} | {t_auto * 1e3:.2f} |")


if __name__ == "__main__":
    main()
