"""The weight-only (W8A16) kernel on the conditioning linears: which form and tile is fastest, side by side.

Flux's sensitive linears (adaLN modulation, the timestep / guidance / text embedders, norm_out) run
weight-only with M = batch rows (1 per image). fx_fp8/ops/triton_w8a16.py has two forms for them:
the tensor-core dot on 16-row tiles (the only form before; `tile_config`) and the FMA form (all rows
in one tile, CUDA-core FMAs); on a GPU the autotuner picks among `small_m_candidates`. One process,
`triton.testing.do_bench` medians with L2 flushed; per row:
  us       microseconds per call
  GB/s     (weight codes + scales + activations + output) bytes / time: how close to the memory bandwidth
  x BF16   BF16 F.linear (cuBLAS) us / us
  x old    the old tile's us / us
  err      relative L2 error against the float64 product of the dequantized weight
Rows: BF16 F.linear, the old tile, every candidate (the two adaLN shapes with the default storage,
INT8 codes with 1 x 32 group scales) or only the tuned pick (the other shapes and storages).

    python benchmarks/w8a16_forms.py [--out RESULTS.md] [--dry-run]

--dry-run: CPU, tiny shapes, Triton's interpreter (checks every row runs; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported (below, through torch / fx_fp8)
try:  # the installed fx_fp8 (a checkout's fx_fp8/ lacks fx_fp8.passes, which the package maps in)
    import fx_fp8  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: (K, N, what) of Flux-dev's conditioning linears
SHAPES = [
    (3072, 18432, "double block norm1.linear"),
    (3072, 9216, "single block norm.linear"),
    (3072, 6144, "norm_out.linear"),
    (3072, 3072, "timestep / guidance / text linear_2"),
    (768, 3072, "text embedder linear_1"),
    (256, 3072, "timestep / guidance linear_1"),
]
DRY_SHAPES = [(96, 160, "tiny adaLN"), (64, 96, "tiny embedder")]
#: (weight-only method, granularity, block): the default storage first
STORAGES = [("int8", "block", (1, 32)), ("fp8", "block", (1, 32)), ("fp8", "channel", None)]
ROWS = (1, 2)
#: shapes whose every candidate is timed (with the default storage, M 1); the rest time the tuned pick
ALL_CANDIDATES = 2


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--out", default=None, help="append a dated section to this markdown file")
    return ap.parse_args(argv)


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def timer(dry: bool):
    if dry:

        def bench(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        return bench
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=50)


def tile_name(config: tuple) -> str:
    """'FMA 1x16x256x1x4x4' / 'dot 16x64x32x0x4x3': the form, then (BLOCK_M, N, K, FMA, warps, stages)."""
    return ("FMA " if config[3] else "dot ") + "x".join(str(int(v)) for v in config)


def rows_for(k: int, n: int, m: int, storage, *, everything: bool, with_bf16: bool, device: str, bench) -> list[list]:
    from fx_fp8.ops import quant
    from fx_fp8.ops import triton_w8a16 as tw

    method, gran, block = storage
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).bfloat16()
    w = torch.randn(n, k, device=device) / k**0.5
    bias = torch.randn(n, device=device).bfloat16()
    wq, ws = quant.quantize_weight(w, gran, block, method)
    exact = x.double() @ quant.dequantize_weight(wq, ws, gran, block).double().t() + bias.double()
    moved = wq.numel() * wq.element_size() + ws.numel() * 4 + (x.numel() + bias.numel() + m * n) * 2
    bc = block[1] if gran == "block" else None
    kw = dict(weight_granularity=gran, weight_block=block)
    w16 = w.bfloat16()
    bf16_us = bench(lambda: F.linear(x, w16, bias)) * 1e3
    old = tw.full_config(None, m, bc)
    old_us = bench(lambda: tw.w8a16_linear(x, wq, ws, bias, config=old, **kw)) * 1e3
    case = f"M{m} {k}->{n}"
    what = f"{method} {gran}{'' if block is None else ' ' + 'x'.join(map(str, block))}"
    out = []
    if with_bf16:  # its error against the float64 product of its own (unquantized) weight
        out.append(
            [
                case,
                "bf16",
                "F.linear (cuBLAS)",
                bf16_us,
                (w16.numel() + x.numel() + 2 * m * n) * 2 / bf16_us / 1e3,
                1.0,
                None,
                rel(F.linear(x, w16, bias), x.double() @ w16.double().t() + bias.double()),
            ]
        )

    def row(label, config, us):
        y = tw.w8a16_linear(x, wq, ws, bias, config=config, **kw)
        return [case, what, label, us, moved / us / 1e3, bf16_us / us, old_us / us, rel(y, exact)]

    out.append(row(f"old tile {tile_name(old)}", old, old_us))
    if everything:
        for c in tw.small_m_candidates(m, bc):
            if c != old:
                out.append(
                    row(tile_name(c), c, bench(lambda c=c: tw.w8a16_linear(x, wq, ws, bias, config=c, **kw)) * 1e3)
                )
    if device == "cuda":  # config None: the autotuned call; its pick is known once it has run
        tuned_us = bench(lambda: tw.w8a16_linear(x, wq, ws, bias, **kw)) * 1e3
        out.append(row(f"tuned: {tile_name(tw.candidate_of(tw._w8a16_small_m_tuned.best_config))}", None, tuned_us))
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import gpu_timing as gt

    if args.dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        print("no CUDA GPU here: run with --dry-run for the CPU check of every row", file=sys.stderr)
        return 2
    bench = timer(args.dry_run)
    t0 = time.time()
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    rows = []
    for i, (k, n, what) in enumerate(shapes):
        for m in ROWS:
            for j, storage in enumerate(STORAGES):
                if j and (i >= ALL_CANDIDATES or m > 1):
                    continue  # other storages: on the two adaLN shapes at M 1 only
                rows += rows_for(
                    k,
                    n,
                    m,
                    storage,
                    everything=i < ALL_CANDIDATES and j == 0 and m == 1,
                    with_bf16=j == 0,
                    device=device,
                    bench=bench,
                )
                print(f"[{time.time() - t0:5.0f} s] {what} M{m} {storage[0]} {storage[1]}", file=sys.stderr, flush=True)
    table = gt.markdown_table(["case", "storage", "kernel", "us", "GB/s", "x BF16", "x old", "err"], rows)
    title = "w8a16_forms.py: the weight-only kernel on the conditioning linears"
    print(f"\n### {title} ({time.time() - t0:.0f} s)\n\n{table}")
    if args.out:
        command = " ".join(["python benchmarks/w8a16_forms.py"] + list(sys.argv[1:] if argv is None else argv))
        gt.append_section(args.out, title, gt.environment(device), command, time.time() - t0, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
