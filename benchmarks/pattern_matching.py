#!/usr/bin/env python
"""ignored_layers `re:` patterns: time to match a model's module names, Python's backtracking
re against RE2 (google-re2), which fx_fp8 uses for every `re:` pattern (fx_fp8/config/patterns.py).

Legitimate patterns are matched against the names of a large diffusers-like model (60 double
blocks + 60 single blocks, ~1200 names); catastrophic shapes against names that do not match,
with Python's re only where it finishes in a few seconds (the others are never run).

    OMP_NUM_THREADS=1 python benchmarks/pattern_matching.py
"""

from __future__ import annotations

import re
import time

from fx_fp8.config.patterns import _regex

NAMES = (
    [
        f"transformer_blocks.{i}.{m}"
        for i in range(60)
        for m in (
            "norm1.linear",
            "norm1_context.linear",
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_out.0",
            "attn.to_add_out",
            "ff.net.0.proj",
            "ff.net.2",
            "ff_context.net.0.proj",
            "ff_context.net.2",
        )
    ]
    + [
        f"single_transformer_blocks.{i}.{m}"
        for i in range(60)
        for m in ("norm.linear", "proj_mlp", "proj_out", "attn.to_q", "attn.to_k", "attn.to_v")
    ]
    + ["time_text_embed.timestep_embedder.linear_1", "context_embedder", "x_embedder", "norm_out.linear", "proj_out"]
)

LEGIT = [
    r"transformer_blocks\.\d+\.attn\..*",
    r".*(norm|proj_out).*",
    r"(.*\.)?norm[^.]*\.linear",
    r"proj_out",
    r"(blocks\.\d+\.)*attn",
]
#: shape, name, Python's re run on it? (False: it would take hours or more)
CATASTROPHIC = [
    (r"(a|a)*z", "a" * 22, True),
    (r".*.*.*.*.*.*z", "single_transformer_blocks.37.attn.to_out", True),
    (r"(.*.*)*z", "single_transformer_blocks.37.attn.to_out", False),
    (r"(a+)+b", "a" * 40, False),
    (r"(a+)+b", "a" * 1000, False),
    (r"(a+)+b", "a" * 100_000, False),
]


def best(fn, repeat=3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    print(f"{len(NAMES)} module names")
    print("| pattern | matches | Python re (ms, all names) | RE2 (ms, all names) | RE2 compile (ms) |")
    print("|---|---|---|---|---|")
    for p in LEGIT:
        rx = re.compile(p)
        t0 = time.perf_counter()
        r2 = _regex.__wrapped__("re:" + p)
        build = time.perf_counter() - t0
        hits = sum(r2.fullmatch(n) is not None for n in NAMES)
        assert hits == sum(rx.fullmatch(n) is not None for n in NAMES), p
        t_re = best(lambda: [rx.fullmatch(n) for n in NAMES])
        t_re2 = best(lambda: [r2.fullmatch(n) for n in NAMES])
        print(f"| `{p}` | {hits} | {t_re * 1e3:.2f} | {t_re2 * 1e3:.2f} | {build * 1e3:.2f} |")
    print()
    print("| catastrophic pattern | name length | Python re (s) | RE2 (ms) |")
    print("|---|---|---|---|")
    for p, name, run_re in CATASTROPHIC:
        r2 = _regex.__wrapped__("re:" + p)
        assert r2.fullmatch(name) is None
        t_re2 = best(lambda: r2.fullmatch(name))
        t_re = f"{best(lambda: re.fullmatch(p, name), repeat=1):.2f}" if run_re else "not run (hours or more)"
        print(f"| `{p}` | {len(name)} | {t_re} | {t_re2 * 1e3:.3f} |")


if __name__ == "__main__":
    main()
