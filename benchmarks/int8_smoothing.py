#!/usr/bin/env python
"""SmoothQuant-style smoothing (quantization_config.smoothing_alpha): what it buys, per layer and end to end.

    python benchmarks/int8_smoothing.py                  # both tables, appended to benchmarks/RESULTS.md
    python benchmarks/int8_smoothing.py --layers-only --no-append

(1) Per layer: relative MSE (sum (y - y_ref)^2 / sum y_ref^2) of one quantized linear against the
    float32 linear, on Gaussian activations and on the same with 4 fixed input channels x20
    (outlier channels), calibrated on 4 batches and measured on a held-out one; INT8 and FP8,
    smoothing off and at several alphas. Through torch.compile(backend="fp8"), reference lowering.
(2) The shipped tiny model (tiny_quality.py's 16 prompts x seeds, 10 steps): mean PSNR / SSIM
    against native with INT8 linears (attention native, then FP8 attention too), smoothing off and
    alpha 0 / 0.5 / 0.8, and FP8 linears off / 0.5, calibrated on 4 other prompts (fx_fp8.calibrate
    with a callable that runs the pipeline). "prepared" is compile_pipeline's default (prepare_model:
    each layer smoothed on its own); "compile-time" is prepare=False (one smoothing vector per
    activation-quantization group: q/k/v share one).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fx_fp8  # noqa: E402
import tiny_quality as tq  # noqa: E402  (benchmarks/tiny_quality.py: prompts, generation, metrics, machine)
from fx_fp8.tools.tiny_model import DEFAULT_NUM_INFERENCE_STEPS, load_tiny_pipeline, random_prompt  # noqa: E402

SHAPES = [(256, 256), (512, 128), (192, 768), (1024, 1024)]
ALPHAS = [None, 0.0, 0.5, 0.8]
OUTLIER_GAIN = 20.0


def activations(kind: str, in_f: int, seed: int, rows: int = 4 * 77) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g)
    if kind == "outliers":
        x[:, torch.arange(4) * (in_f // 4) + 1] *= OUTLIER_GAIN
    return x


def layer(in_f: int, out_f: int) -> nn.Module:
    g = torch.Generator().manual_seed(in_f + out_f)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)
    return nn.Sequential(lin).eval()


def layer_table() -> str:
    from tabulate import tabulate

    rows = []
    for in_f, out_f in SHAPES:
        m = layer(in_f, out_f)
        for kind in ("gaussian", "outliers"):
            calibration = fx_fp8.calibrate(m, [(activations(kind, in_f, s),) for s in range(4)])
            x = activations(kind, in_f, 100)
            with torch.no_grad():
                ref = m(x)
            for method in ("int8", "fp8"):
                errs = []
                for alpha in ALPHAS:
                    torch._dynamo.reset()
                    opts = {
                        "quantization": method,
                        "lowering": "reference",
                        "downstream": "eager",
                        "quantization_config": {
                            "activation_scales": calibration,
                            "smoothing_alpha": alpha,
                            "min_features": 0,
                        },
                    }
                    with torch.no_grad():
                        y = torch.compile(m, backend="fp8", options=opts)(x)
                    errs.append(float(((y - ref) ** 2).mean() / (ref**2).mean()))
                best = min(errs[1:])
                rows.append(
                    [f"{in_f}->{out_f}", kind, method.upper()] + [f"{e:.2e}" for e in errs] + [f"{errs[0] / best:.1f}x"]
                )
        print(f"layer {in_f}->{out_f} done", flush=True)
    headers = (
        ["layer", "activations", "method"] + [("off" if a is None else f"alpha {a:g}") for a in ALPHAS] + ["off / best"]
    )
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def tiny_table(num_prompts: int, steps: int, calib_prompts: int) -> str:
    from tabulate import tabulate

    cases = tq.prompts_and_seeds(num_prompts)
    calib_cases = [(random_prompt(np.random.default_rng(1000 + i)), 1000 + i) for i in range(calib_prompts)]
    pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    native = tq.generate(pipe, cases, steps)
    t0 = time.perf_counter()
    calibration = fx_fp8.calibrate(pipe.transformer, lambda _model: tq.generate(pipe, calib_cases, steps))
    print(f"calibrated on {calib_prompts} prompts in {time.perf_counter() - t0:.1f} s", flush=True)

    rows = []
    setups = [
        ("INT8 linears, attention native", dict(quantization="int8", diffusion_kv_cache_dtype=None), ALPHAS),
        ("INT8 linears + FP8 attention", dict(quantization="int8", diffusion_kv_cache_dtype="fp8"), ALPHAS),
        ("FP8 linears, attention native", dict(quantization="fp8", diffusion_kv_cache_dtype=None), [None, 0.5]),
    ]
    for label, base, alphas in setups:
        for prepare in (True, False):
            for alpha in alphas:
                cfg = fx_fp8.FP8Config.from_kwargs(
                    **base,
                    quantization_config={
                        "method": base["quantization"],
                        "activation_scales": calibration,
                        "smoothing_alpha": alpha,
                    },
                )
                r = tq.evaluate(cfg, cases, steps, native, "fp8", prepare=prepare)
                rows.append(
                    [
                        label,
                        "prepared" if prepare else "compile-time",
                        "off" if alpha is None else f"{alpha:g}",
                        r["attn"],
                        r["linear"],
                        f"{r['psnr']:.2f}",
                        f"{r['psnr_min']:.2f}",
                        f"{r['ssim']:.4f}",
                        f"{r['seconds']:.1f}",
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
    # static activation scales (unprepared: compile-time smoothing groups are one layer each)
    for alpha in (None, 0.5):
        cfg = fx_fp8.FP8Config.from_kwargs(
            quantization="int8",
            diffusion_kv_cache_dtype=None,
            quantization_config={
                "method": "int8",
                "activation_scheme": "static",
                "activation_scales": calibration,
                "smoothing_alpha": alpha,
            },
        )
        r = tq.evaluate(cfg, cases, steps, native, "fp8", prepare=False)
        rows.append(
            [
                "INT8 linears, static scales, attention native",
                "compile-time",
                "off" if alpha is None else f"{alpha:g}",
                r["attn"],
                r["linear"],
                f"{r['psnr']:.2f}",
                f"{r['psnr_min']:.2f}",
                f"{r['ssim']:.4f}",
                f"{r['seconds']:.1f}",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    headers = [
        "config",
        "weights",
        "smoothing alpha",
        "fp8 attention",
        "quantized linears",
        "PSNR dB (mean)",
        "PSNR min",
        "SSIM (mean)",
        "seconds (incl. compile)",
    ]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--calibration-prompts", type=int, default=4)
    ap.add_argument("--num-inference-steps", type=int, default=DEFAULT_NUM_INFERENCE_STEPS)
    ap.add_argument("--layers-only", action="store_true", help="only the per-layer table")
    ap.add_argument("--no-append", action="store_true", help=f"do not append to {tq.RESULTS}")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))

    layers = layer_table()
    print(layers, flush=True)
    tiny = (
        None if args.layers_only else tiny_table(args.num_prompts, args.num_inference_steps, args.calibration_prompts)
    )
    if tiny:
        print(tiny)
    if args.no_append:
        return 0
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = (
        f"\n## int8_smoothing — {now}\n\n"
        f"- machine: {tq.machine()}\n- versions: {tq.versions()}\n"
        f"- command: `python benchmarks/int8_smoothing.py {' '.join(sys.argv[1:])}`\n"
        "- reference lowering (CPU), float32; smoothing s_j = amax_x_j^alpha / max|W[:, j]|^(1 - alpha), "
        "weights quantized as W * s, activations multiplied by 1/s before quantization\n\n"
        "Per-layer relative MSE against the float32 linear (dynamic per-token activations, per-channel "
        f"weights; 4 calibration batches of 308 tokens, a held-out batch; outliers: 4 input channels "
        f"x{OUTLIER_GAIN:g}):\n\n{layers}\n"
    )
    if tiny:
        section += (
            f"\nShipped tiny model, transformer sha256 {tq.weights_id()}, {args.num_prompts} prompts x seeds "
            f"(tiny_quality.py's), {args.num_inference_steps} steps, against native; calibrated on "
            f"{args.calibration_prompts} other prompts:\n\n{tiny}\n"
        )
    with open(tq.RESULTS, "a") as f:  # append only
        f.write(section)
    print(f"appended to {tq.RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
