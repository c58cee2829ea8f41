"""`fx_fp8.tune` on Flux-dev's and Wan-14B's shapes on one GPU: the time it takes (budget: 60 s for
Flux-dev on an H100, compilation included) and the table it writes.

    python benchmarks/tune_run.py                       # Flux-dev 1024x1024 and Wan-14B 720p x 81 frames
    python benchmarks/tune_run.py --only flux --out-dir tune_out/
    python benchmarks/tune_run.py --dry-run             # CPU, tiny configs, CPU timings (not a GPU's)
    python benchmarks/tune_run.py --only flux --compare # then auto against the fixed configurations, timed
    benchmarks/gpu_run.sh tune                          # the same on the GPU machine, with its logs

The models are built from their released configs with seeded
random bf16 weights (never downloaded; Flux by cuda_bench.build_flux, Wan built on the device). The distinct shapes of a transformer
do not depend on its depth (every block of a kind has the same shapes), so each is built with one
block of each kind (--full-depth: Flux-dev's 19 + 38 blocks; the trace then takes longer): the
shapes tuned are full-depth Flux-dev's (4096 image + 512 text tokens) and Wan-14B's (width 5120,
40 heads, 720p x 81 frames: 75600 tokens, 512 text tokens). Each model's table goes to
OUT_DIR/<model>.json, its summary to stdout, and a dated section to --results (RESULTS.md) when given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

WAN_14B_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
TINY_WAN_CONFIG = dict(
    WAN_14B_CONFIG, num_attention_heads=2, attention_head_dim=32, text_dim=64, freq_dim=32, ffn_dim=128, num_layers=1
)


def flux(args, device):
    from cuda_bench import FLUX_DEV_CONFIG, TINY_FLUX_CONFIG, build_flux, flux_inputs

    config = dict(TINY_FLUX_CONFIG if args.dry_run else FLUX_DEV_CONFIG)
    if not args.full_depth:
        config["num_layers"], config["num_single_layers"] = 1, 1
    side, txt = (8, 8) if args.dry_run else (64, 512)  # 64 x 64 = 4096 image tokens: 1024 x 1024
    model = build_flux(config, device)
    return model, flux_inputs(config, side, txt, device)


def wan(args, device):
    import diffusers

    config = dict(TINY_WAN_CONFIG if args.dry_run else WAN_14B_CONFIG)
    if not args.full_depth:
        config["num_layers"] = 1
    frames, h, w, txt = (2, 8, 8, 8) if args.dry_run else (21, 90, 160, 512)  # 720p x 81 frames, latent / 8
    with warnings.catch_warnings():  # built on the device (its RoPE tables are buffers): torch's default init
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        with torch.device(device):
            model = diffusers.WanTransformer3DModel(**config)
        model = model.to(torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(0)
    kw = dict(
        hidden_states=torch.randn(
            1, config["in_channels"], frames, h, w, device=device, generator=g, dtype=torch.bfloat16
        ),
        timestep=torch.full((1,), 500.0, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, txt, config["text_dim"], device=device, generator=g, dtype=torch.bfloat16),
        return_dict=False,
    )
    return model, kw


MODELS = {"flux": flux, "wan": wan}
#: --compare: the fixed configurations `auto` must match or beat (never slower by the measurement), and `auto` itself
FIXED = {
    "native (BF16, fx_fp8 off)": {"quantization": None, "diffusion_kv_cache_dtype": None},
    "all FP8 (sensitive: fp8)": {"quantization_config": {"kernel": "rules", "sensitive": "fp8"}},
    "FP8, sensitive weight-only (the rules)": {"quantization_config": {"kernel": "rules"}},
}


def predicted_ms(reports, table: dict) -> tuple[float, float, int]:
    """(predicted ms, native ms, nodes) of one forward from the auto compile's report rows: each linear's
    measured pick (its row's timing) and each attention node's kernel time from the table's row."""
    from fx_fp8.ops import attention_table

    pick = native = 0.0
    nodes = 0
    rows = {"bar": table["bar"], "rows": [dict(r, gpu="this") for r in table["attention"]]}
    for e in (e for r in reports for e in r.entries):
        if e.op == "linear" and e.timing.get("native") is not None:
            pick, native, nodes = (
                pick + (e.timing["pick"] or e.timing["native"]),
                native + e.timing["native"],
                nodes + 1,
            )
        elif e.op == "attention" and e.dims and None not in e.dims[0] and None not in e.dims[1]:
            row = attention_table.find_row(rows, "this", e.dims[0][3], e.dims[1][2], False)
            kernel = "native" if e.action == "native" else ("cudnn" if "cuDNN" in e.reason else "triton")
            if row is not None and kernel in row["kernels"] and "native" in row["kernels"]:
                # a row measured one (B x H, Sq): scale by this node's share of that work
                scale = (e.dims[0][0] * e.dims[0][1] * e.dims[0][2]) / (row.get("bh", 1) * row.get("s_q", 1))
                pick += row["kernels"][kernel]["ms"] * scale
                native += row["kernels"]["native"]["ms"] * scale
                nodes += 1
    return pick, native, nodes


def compare(name, args, device, table_path: Path, table: dict) -> str:
    """The model compiled whole (backend fp8, Inductor downstream) with each fixed configuration and
    with `auto` following the table just written, every one timed the same way; auto's predicted
    total (the table's times of what its report says runs) against its measured time."""
    import fx_fp8
    from fx_fp8.tuning.run import cpu_timer, cuda_timer

    timer = cpu_timer if args.dry_run else cuda_timer
    variants = dict(
        FIXED, **{"auto (the table)": {"quantization_config": {"kernel": "auto", "tune_table": str(table_path)}}}
    )

    def timed(config) -> tuple[float, float]:
        """(ms per forward, first call s) of a freshly built model compiled with `config`."""
        model, kw = MODELS[name](args, device)
        torch._dynamo.reset()
        fx_fp8.clear_reports()
        compiled = torch.compile(model, backend="fp8", options={"config": config})
        with torch.no_grad():
            t0 = time.perf_counter()
            compiled(**kw)
            first = time.perf_counter() - t0
            return timer(lambda: compiled(**kw)), first

    rows, auto_reports = [], None
    for label, config in variants.items():
        ms, first = timed(config)
        rows.append((label, ms, first))
        if label.startswith("auto"):
            auto_reports = fx_fp8.get_reports()
        if device == "cuda":
            torch.cuda.empty_cache()
    best_fixed = min(ms for label, ms, _ in rows if not label.startswith("auto"))
    auto_ms = rows[-1][1]
    pick, native, nodes = predicted_ms(auto_reports, table)
    out = [f"{label:<42} {ms:9.3f} ms   first call {first:6.1f} s" for label, ms, first in rows]
    out.append(
        f"auto / best fixed: {best_fixed / auto_ms:.2f}x ({'at least as fast' if auto_ms <= best_fixed else 'SLOWER'})"
    )
    out.append(
        f"auto predicted {pick:.3f} ms over {nodes} measured nodes (native {native:.3f} ms), measured "
        f"{auto_ms:.3f} ms: predicted / measured {pick / auto_ms:.2f}"
        if auto_ms
        else ""
    )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(MODELS), action="append", help="tune only this model (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, CPU timings (not a GPU's)")
    ap.add_argument("--full-depth", action="store_true", help="build every block (the same shapes, a longer trace)")
    ap.add_argument("--out-dir", default="tune_out", help="where each model's table goes (default tune_out/)")
    ap.add_argument("--results", default=None, help="append a dated section to this RESULTS.md")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="then compile each model with the fixed configurations and with auto, time them, and set "
        "auto's predicted total against its measured time",
    )
    args = ap.parse_args(argv)
    import fx_fp8
    from fx_fp8.tuning import format_summary

    if not args.dry_run and not torch.cuda.is_available():
        print("tune_run.py: no CUDA GPU: give --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    out_dir = Path(args.out_dir)
    lines = []
    for name in args.only or list(MODELS):
        model, kw = MODELS[name](args, device)
        t0 = time.perf_counter()
        table = fx_fp8.tune(model, kw, out=out_dir / f"{name}.json", dry_run=args.dry_run, write_cache=not args.dry_run)
        seconds = time.perf_counter() - t0
        summary = format_summary(table)
        print(f"== {name}: tune took {seconds:.1f} s (trace, compiles and timings)\n{summary}\n", flush=True)
        lines.append(f"### {name}: {seconds:.1f} s\n\n```\n{summary}\n```\n")
        del model, kw
        if args.compare:
            text = compare(name, args, device, out_dir / f"{name}.json", table)
            print(f"== {name}: fixed configurations against auto\n{text}\n", flush=True)
            lines.append(f"fixed configurations against auto:\n\n```\n{text}\n```\n")
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.results:
        key = json.dumps(fx_fp8.ops.tune_table.device_key(torch.device(device)))
        with open(args.results, "a") as f:
            f.write(
                f"\n## tune_run.py — {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n- key: {key}\n\n" + "\n".join(lines)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
