#!/usr/bin/env python
"""Per-step static activation scales (fx_fp8.calibrate(..., per_step=True)) against one static scale.

    python benchmarks/per_step_scales.py                     # prints a markdown section (table + setup)
    python benchmarks/per_step_scales.py --num-prompts 4     # a quick look

The shipped tiny model (tiny_quality.py's 16 prompts x seeds, 10 steps, 32x32): mean PSNR / SSIM
against native of static INT8 and FP8 linears (attention native), calibrated once on 4 other prompts
with the pipeline publishing its steps (fx_fp8.publish_steps), then used as
  - one scale per layer (the calibration's .single(): max over all steps, what per_step=False gives),
  - per-step scales in 2 and 5 groups of steps, and one group per step,
prepared (compile_pipeline's default: prepare_model) and, for INT8 with each step, compile-time
(prepare=False) as well. Dynamic per-token activations (the default scheme) are a row for context.
"step scale spread" is the median over the static layers of (largest / smallest) per-group scale:
how much a layer's activation range moves across the denoising steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fx_fp8  # noqa: E402
import tiny_quality as tq  # noqa: E402  (benchmarks/tiny_quality.py: prompts, generation, metrics, machine)
from fx_fp8.tools.tiny_model import DEFAULT_NUM_INFERENCE_STEPS, load_tiny_pipeline, random_prompt  # noqa: E402


def spread(cal) -> str:
    if not cal.per_step:
        return "1"
    ratios = [float(t.max() / t.min()) for t in cal.step_scales.values()]
    return f"{float(np.median(ratios)):.2f}"


def table(num_prompts: int, steps: int, calib_prompts: int) -> tuple[str, str]:
    from tabulate import tabulate

    cases = tq.prompts_and_seeds(num_prompts)
    calib_cases = [(random_prompt(np.random.default_rng(1000 + i)), 1000 + i) for i in range(calib_prompts)]
    pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    native = tq.generate(pipe, cases, steps)

    def run(_model):
        for case in calib_cases:  # one publish_steps block per pipeline call: its steps count from 0
            with fx_fp8.publish_steps(pipe):
                tq.generate(pipe, [case], steps)

    t0 = time.perf_counter()
    each = fx_fp8.calibrate(pipe.transformer, run, per_step=True)
    if each.step_groups != tuple((s, s) for s in range(steps)):
        raise RuntimeError(f"the calibration saw steps {each.step_groups}, expected 0-{steps - 1}")
    calibrations = [
        ("one scale (all steps)", each.single()),
        ("2 step groups", each.regroup(2)),
        ("5 step groups", each.regroup(5)),
        (f"each step ({steps} groups)", each),
    ]
    calib_note = (
        f"calibrated once per step on {calib_prompts} other prompts ({time.perf_counter() - t0:.1f} s; "
        "the groups are its .regroup(n))"
    )
    print(calib_note, flush=True)

    rows = []

    def row(method, label, prepare, r, cal_spread):
        rows.append(
            [
                method.upper(),
                label,
                "prepared" if prepare else "compile-time",
                r["linear"],
                cal_spread,
                f"{r['psnr']:.2f}",
                f"{r['psnr_min']:.2f}",
                f"{r['ssim']:.4f}",
                f"{r['seconds']:.1f}",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)

    for method in ("int8", "fp8"):
        dyn = fx_fp8.FP8Config.from_kwargs(
            quantization=method, diffusion_kv_cache_dtype=None, quantization_config={"method": method}
        )
        row(method, "dynamic per-token (context)", True, tq.evaluate(dyn, cases, steps, native, "fp8"), "-")
        for label, cal in calibrations:
            cfg = fx_fp8.FP8Config.from_kwargs(
                quantization=method,
                diffusion_kv_cache_dtype=None,
                quantization_config={"method": method, "activation_scheme": "static", "activation_scales": cal},
            )
            # compile-time (prepare=False) once: the same numbers through the other path
            for prepare in (True, False) if label.startswith("each") and method == "int8" else (True,):
                row(method, label, prepare, tq.evaluate(cfg, cases, steps, native, "fp8", prepare=prepare), spread(cal))
    headers = [
        "linears",
        "activation scales",
        "weights",
        "quantized linears",
        "step scale spread",
        "PSNR dB (mean)",
        "PSNR min",
        "SSIM (mean)",
        "seconds (incl. compile)",
    ]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), calib_note


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--calibration-prompts", type=int, default=4)
    ap.add_argument("--num-inference-steps", type=int, default=DEFAULT_NUM_INFERENCE_STEPS)
    args = ap.parse_args(argv)
    for name, value in (
        ("--num-prompts", args.num_prompts),
        ("--calibration-prompts", args.calibration_prompts),
        ("--num-inference-steps", args.num_inference_steps),
    ):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    warnings.filterwarnings("ignore")
    if "OMP_NUM_THREADS" not in os.environ:  # a shared machine sets it: keep to it
        torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    tab, note = table(args.num_prompts, args.num_inference_steps, args.calibration_prompts)
    print(
        f"\n## per_step_scales — per-step static activation scales vs one static scale\n\n"
        f"- machine: {tq.machine()}\n- versions: {tq.versions()}\n"
        f"- tiny model weights: transformer sha256 {tq.weights_id()}\n"
        f"- command: `python benchmarks/per_step_scales.py {' '.join(sys.argv[1:])}`\n"
        f"- {args.num_prompts} prompts x seeds (tiny_quality.py's), {args.num_inference_steps} steps, 32x32, "
        f"against native; attention native; {note}\n\n{tab}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
