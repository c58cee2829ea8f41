#!/usr/bin/env python
"""FP8 vs native image quality on the shipped tiny model: PSNR and SSIM over prompts x seeds.

    python benchmarks/tiny_quality.py                      # the shipped model's config (its fx_fp8.yaml)
    python benchmarks/tiny_quality.py --library-default    # the library's default config instead
    python benchmarks/tiny_quality.py --ablation           # also attention-only, linears-only, ... rows
    python benchmarks/tiny_quality.py --diffusion-kv-cache-skip-steps 0,1
    python benchmarks/tiny_quality.py --ablation --append   # and append a dated section to RESULTS.md
    python benchmarks/tiny_quality.py --int8                # also INT8 W8A8 rows next to the FP8 ones
    python benchmarks/tiny_quality.py --library-default --quantization int8   # INT8 linears only (flags alone opt in)
    python benchmarks/tiny_quality.py --sensitive-rows      # sensitive layers native / weight_only / fp8
    python benchmarks/tiny_quality.py --step-policies       # step policies for attention and linears
    python benchmarks/tiny_quality.py --prompt-set heldout  # on the 48 held-out prompts instead
    python benchmarks/tiny_quality.py --prompt-set both     # each config on tuning and held-out
    python benchmarks/tiny_quality.py --prompt-set all      # ... and on the third, confirmation set

Prompt sets (fx_fp8/tools/tiny_model/prompt_sets.py): "tuning" (default; prompt i drawn from the
grammar with seed i, noise seed i: the 16 cases the shipped model was fine-tuned and gated on)
and "heldout" (48 fixed cases it was never tuned or evaluated on). Every run compares the same
images. Results are printed as a table; only with --append are they also appended (with date,
machine, versions) to benchmarks/RESULTS.md.
Targets: mean PSNR >= 30 dB, mean SSIM >= 0.97.

The given config is the shipped model's own (fx_fp8/tools/tiny_model/weights/fx_fp8.yaml: the
library default with attention native on steps first:2,last:2), unless --config or
--library-default says otherwise; the FP8 flags apply on top of it. Row names show the steps the
step selectors resolved to in this run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings

import numpy as np
import torch

import fx_fp8
from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args
from fx_fp8.tools.image_metrics import compare_images
from fx_fp8.tools.tiny_model import DEFAULT_NUM_INFERENCE_STEPS, TINY_MODEL_CONFIG, load_tiny_pipeline
from fx_fp8.tools.tiny_model.prompt_sets import PROMPT_SETS, prompt_cases

TARGET_PSNR, TARGET_SSIM = 30.0, 0.97
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
HEADER = "# Benchmark results\n\nDated sections appended by the scripts in benchmarks/; newest last.\n"

# --ablation rows: which part of the FP8 recipe costs quality
ABLATIONS = {
    "attention only": dict(quantization=None),
    "linears only": dict(diffusion_kv_cache_dtype=None),
    "attention, P not quantized": dict(quantization=None, attention={"quantize_p": False}),
    "attention, skip steps 0-1": dict(quantization=None, diffusion_kv_cache_skip_steps="0,1"),
    "linears only, attention projections native": dict(
        diffusion_kv_cache_dtype=None, ignored_layers=["@defaults", r"re:.*attn\..*"]
    ),
    "both, attention projections native, skip steps 0-1": dict(
        diffusion_kv_cache_skip_steps="0,1", ignored_layers=["@defaults", r"re:.*attn\..*"]
    ),
}


# --int8 rows: INT8 W8A8 linears next to FP8 ones, on the same prompts
INT8_ROWS = {
    "linears only, FP8": dict(diffusion_kv_cache_dtype=None, quantization="fp8"),
    "linears only, INT8": dict(diffusion_kv_cache_dtype=None, quantization="int8"),
    "FP8 attention + INT8 linears": dict(diffusion_kv_cache_dtype="fp8", quantization="int8"),
}


# --sensitive-rows: how the sensitive layers (conditioning, adaLN modulation, final projection) run
SENSITIVE_ROWS = {
    f"sensitive: {mode}": dict(quantization_config={"sensitive": mode}) for mode in ("native", "weight_only", "fp8")
}


def step_policy_rows(steps: int) -> dict:
    """--step-policies: the first and last 2 steps in higher precision, for attention, linears, both."""
    edges = f"0-1,{steps - 2}-{steps - 1}"
    # each row sets both selectors: the given config's own step policy does not leak into them
    return {
        "all FP8 (no step policy)": dict(diffusion_kv_cache_skip_steps="", quantization_skip_steps=""),
        f"attention native on steps {edges}": dict(diffusion_kv_cache_skip_steps=edges, quantization_skip_steps=""),
        f"linears weight-only on steps {edges}": dict(diffusion_kv_cache_skip_steps="", quantization_skip_steps=edges),
        f"both on steps {edges}": dict(diffusion_kv_cache_skip_steps=edges, quantization_skip_steps=edges),
    }


def with_resolved_steps(name: str, config, steps: int) -> str:
    """The row name, with the steps its step selectors pick in a run of `steps` steps where they
    are written relative to the run ("first:2,last:2 = 0-1,8-9")."""
    shown = []
    for label, sel, on in (
        ("attention native", config.diffusion_kv_cache_skip_steps, config.attention_step_skips),
        (
            f"linears {config.quantization_config.skip_steps_mode}",
            config.quantization_config.skip_steps,
            config.linear_step_skips,
        ),
    ):
        if on and str(sel) != str(sel.resolve(steps)):
            shown.append(f"{label} on {sel} = {sel.resolve(steps)}")
    return f"{name} ({'; '.join(shown)})" if shown else name


def fp8_flop_fraction(pipe) -> float:
    """FP8 (W8A8 linear and FP8 attention) FLOPs of the last run / those of the same run all in FP8,
    from the reports of the variants each transformer call ran."""
    from fx_fp8 import pipeline_state

    reports = pipeline_state(pipe).reports()["transformer"]
    by_variant: dict = {}
    for r in reports:
        by_variant[r.step_variant] = by_variant.get(r.step_variant, 0.0) + r.flops(("fp8", "int8"))
    full = by_variant.get(None, by_variant.get("fp8", 0.0))
    ran = [c.variant for c in pipeline_state(pipe).calls]
    kept = sum(by_variant.get(v, 0.0) for v in ran)
    return kept / (full * len(ran)) if full and ran else float("nan")


def prompts_and_seeds(n: int) -> list[tuple[str, int]]:
    """The first `n` cases of the tuning set (other benchmarks compare on these)."""
    return prompt_cases("tuning", n)


def generate(pipe, cases, steps) -> list[np.ndarray]:
    out = []
    for prompt, seed in cases:
        res = pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="np")
        out.append(res.images[0])
    return out


def evaluate(config, cases, steps, native, backend, *, pipe=None, prepare: bool = True) -> dict:
    """Compile a fresh pipeline (or `pipe`) with `config`, generate, compare with the native images.
    `cases` and `native` may be dicts (prompt set -> cases / native images): then one compile
    serves every set and the result is a dict of results by set."""
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    if pipe is None:
        pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    fx_fp8.compile_pipeline(pipe, config, backend=backend, prepare=prepare)
    if isinstance(cases, dict):
        return {name: _score(pipe, cases[name], steps, native[name]) for name in cases}
    return _score(pipe, cases, steps, native)


def _score(pipe, cases, steps, native) -> dict:
    t0 = time.perf_counter()
    images = generate(pipe, cases, steps)
    seconds = time.perf_counter() - t0
    flops = fp8_flop_fraction(pipe)
    scores = [compare_images(ref, img) for ref, img in zip(native, images)]
    psnrs = np.array([s["psnr"] for s in scores])
    ssims = np.array([s["ssim"] for s in scores])
    # the graph that quantizes (with step skips there is also a "native" variant)
    summary = [r for r in fx_fp8.get_reports() if r.step_variant in (None, "fp8")][-1].summary()
    # quantized linears of any method ("34/48"; the method is named unless it is fp8: "34/48 int8")
    linear_q = {a: n for a, n in summary["linear"].items() if a not in ("native", "weight-only") and n}
    linear = f"{sum(linear_q.values())}/{sum(summary['linear'].values())}"
    if set(linear_q) - {"fp8"}:
        linear += " " + "+".join(sorted(linear_q))
    return {
        "psnr": float(np.mean(np.minimum(psnrs, 99.0))),
        "psnr_min": float(psnrs.min()),
        "ssim": float(ssims.mean()),
        "ssim_min": float(ssims.min()),
        "seconds": seconds,
        "attn": f"{summary['attention']['fp8']}/{sum(summary['attention'].values())}",
        "linear": linear,
        "fp8_flops": flops,
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"


def versions() -> str:
    import diffusers

    return f"torch {torch.__version__}, diffusers {diffusers.__version__}, python {platform.python_version()}"


def weights_id() -> str:
    """sha256 prefix of the tiny transformer's weights: results are tied to one training run."""
    import hashlib

    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    path = os.path.join(TINY_MODEL_DIR, "transformer", "diffusion_pytorch_model.safetensors")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def append_results(table: str, args, n_cases: str, steps: int, config) -> None:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = (
        f"\n## tiny_quality — {now}\n\n"
        f"- machine: {machine()}\n- versions: {versions()}\n"
        f"- tiny model weights: transformer sha256 {weights_id()}\n"
        f"- command: `python benchmarks/tiny_quality.py {' '.join(sys.argv[1:])}`\n"
        f"- {n_cases} prompts x seeds, {steps} steps, 32x32, FP8 vs native (float32 CPU reference lowering "
        f"unless stated); targets: mean PSNR >= {TARGET_PSNR:g} dB, mean SSIM >= {TARGET_SSIM:g}\n"
        f"- config: `{config.to_dict()}`\n\n{table}\n"
    )
    new = not os.path.exists(RESULTS)
    with open(RESULTS, "a") as f:  # append only: never rewrite other sections
        if new:
            f.write(HEADER)
        f.write(section)
    print(f"appended to {RESULTS}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prompt-set",
        choices=[*PROMPT_SETS, "both", "all"],
        default="tuning",
        help="tuning: the 16 cases the shipped model was tuned on (default); heldout: 48 cases it "
        "never saw in tuning or evaluation; confirm: 48 more, apart from both; both: tuning "
        "and heldout; all: the three",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="the first N cases of each set (default: 16 tuning, 48 held-out, 48 confirm)",
    )
    parser.add_argument("--num-inference-steps", type=int, default=DEFAULT_NUM_INFERENCE_STEPS)
    parser.add_argument("--ablation", action="store_true", help="also measure the parts of the recipe separately")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="also INT8 W8A8 rows: FP8 vs INT8 linears alone, and FP8 attention + INT8 linears",
    )
    parser.add_argument(
        "--sensitive-rows", action="store_true", help="rows for quantization_config.sensitive: native, weight_only, fp8"
    )
    parser.add_argument(
        "--step-policies",
        action="store_true",
        help="rows for step policies: attention / linears / both in higher precision on the first and last 2 steps",
    )
    parser.add_argument("--append", action="store_true", help=f"append a dated section to {RESULTS}")
    parser.add_argument("--no-append", action="store_true", help="do not append (the default; overrides --append)")
    parser.add_argument(
        "--library-default",
        action="store_true",
        help=f"start from the library's default config instead of the shipped model's ({TINY_MODEL_CONFIG})",
    )
    add_fp8_flags(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.library_default and args.config is not None:
        parser.error(f"--library-default and --config {args.config!r} both say which config to start from: give one")
    if args.config is None and not args.library_default:
        args.config = str(TINY_MODEL_CONFIG)  # the shipped model's own config
    config = config_from_args(args)
    names = {"both": ["tuning", "heldout"], "all": list(PROMPT_SETS)}.get(args.prompt_set, [args.prompt_set])
    try:
        sets = {name: prompt_cases(name, args.num_prompts) for name in names}
    except ValueError as e:
        parser.error(f"--num-prompts: {e}")
    steps = args.num_inference_steps

    pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    t0 = time.perf_counter()
    native = {name: generate(pipe, cases, steps) for name, cases in sets.items()}
    native_s = time.perf_counter() - t0

    given = (
        "FP8 ("
        + (
            "shipped model's config"
            if args.config == str(TINY_MODEL_CONFIG)
            else "library default config"
            if args.library_default and args.config is None
            else "given config"
        )
        + ")"
    )
    if config.linear_enabled and config.quantization != "fp8":
        given = f"{config.quantization.upper()} linears" + given[3:]
    rows = [(given, config)]
    if args.ablation:
        rows += [(name, config.replace(**over)) for name, over in ABLATIONS.items()]
    if args.int8:
        rows += [(name, config.replace(**over)) for name, over in INT8_ROWS.items()]
    if args.sensitive_rows:
        rows += [(name, config.replace(**over)) for name, over in SENSITIVE_ROWS.items()]
    if args.step_policies:
        rows += [(name, config.replace(**over)) for name, over in step_policy_rows(steps).items()]
    from tabulate import tabulate

    table_rows = []
    for name, cfg in rows:
        name = with_resolved_steps(name, cfg, steps)
        results = evaluate(cfg, sets, steps, native, args.backend)
        for set_name, r in results.items():
            ok = "yes" if r["psnr"] >= TARGET_PSNR and r["ssim"] >= TARGET_SSIM else "no"
            table_rows.append(
                [
                    name,
                    f"{set_name} ({len(sets[set_name])})",
                    r["attn"],
                    r["linear"],
                    f"{r['psnr']:.2f}",
                    f"{r['psnr_min']:.2f}",
                    f"{r['ssim']:.4f}",
                    f"{r['ssim_min']:.4f}",
                    ok,
                    f"{r['fp8_flops']:.2f}",
                    f"{r['seconds']:.1f}",
                ]
            )
            print(f"{name} [{set_name}]: PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.4f}", flush=True)
    headers = [
        "config",
        "prompts",
        "fp8 attention",
        "fp8 linears",
        "PSNR dB (mean)",
        "PSNR min",
        "SSIM (mean)",
        "SSIM min",
        "meets target",
        "FP8 FLOP fraction",
        "seconds (incl. compile)",
    ]
    table = tabulate(table_rows, headers=headers, tablefmt="github")
    n_cases = sum(len(c) for c in sets.values())
    print(f"\nnative: {native_s:.1f} s for {n_cases} images\n")
    print(table)
    if args.append and not args.no_append:
        append_results(table, args, " + ".join(f"{len(c)} {n}" for n, c in sets.items()), steps, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
