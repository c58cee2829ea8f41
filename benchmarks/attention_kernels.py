"""Every attention kernel fx_fp8 could run, side by side on one GPU: speed and error, one table.

    python benchmarks/attention_kernels.py --out-dir OUT            # full grid (~3 min on an H200)
    python benchmarks/attention_kernels.py --quick --out-dir OUT    # fewer rows (~1.5 min)
    python benchmarks/attention_kernels.py --dry-run --out-dir OUT  # CPU, tiny shapes, every row
    python benchmarks/attention_kernels.py --table-from OUT/attention_kernels.json
                                            # write the measured table `attention.kernel: auto` reads

B1 H24, head dim 64 and 128, S 1024 / 4608 / 16384 / 32760 / 32768 keys = queries; a few rows with a
key-padding mask (the last 10 % of keys masked) and one with outlier channels in Q and K (four
channels x5). Q, K ~ N(0, 1), V ~ N(0.5, 1), bf16. Candidates (each cell is measured on its own;
a failing candidate shows its error in the table and the run goes on):

  cudnn_bf16      torch SDPA, cuDNN backend (the baseline every ratio is against)
  flash_bf16      torch SDPA, flash backend (no masks)
  efficient_bf16  torch SDPA, memory-efficient backend (the baseline where cuDNN takes no mask)
  fa3_bf16        FlashAttention-3 (fa3_fwd wheel) in bf16, if it loads
  triton          fx_fp8's path: Q/K/V pre-pass (smooth K, Hadamard, block scales) + Triton FP8 kernel,
                  autotuned (the chosen config is printed)
  triton_kernel   the kernel alone on prepared inputs;  triton_prepass: the pre-pass alone
  triton_prepass_one_launch  the pre-pass with Q, K and V in one launch (triton_quant.ONE_LAUNCH's candidate)
  triton_prepass_narrow      the pre-pass as before WIDE_STEPS: two-pass blocks in 32-row steps at 4 warps
  gluon           fx_fp8's FA3-style Gluon kernel (ops/gluon_fp8_attention.py) alone on prepared inputs: a candidate,
                  numerically unverified until this cell's error says otherwise; no masks
  triton_qtma     the kernel alone with Q loaded through a TMA descriptor too (q_tma=True; a candidate)
  triton_m64n128  the kernel alone on the candidate tile TILE_CANDIDATES["m64n128"] (64 x 128, one warpgroup,
                  128-key P @ V dots), autotuned over its configs: against triton_kernel, the default
  triton_pvN      the kernel alone at a fixed config with P @ V dots of N keys (PV_KEYS sweep)
  triton_inplace  the kernel alone, P @ V accumulated in place across tiles (the old structure)
  cudnn_fp8       fx_fp8's cuDNN FP8 SDPA path (per-tensor scales, FP8 O, the pre-pass included)
  cudnn_fp8_bf16o the same graph asked for a BF16 O (outside cuDNN's documented matrix: tried)
  fa3_fp8         FlashAttention-3 FP8 with fx_fp8's pre-pass (per-head scales), if it loads
  sage            SageAttention 1 (INT8 Q.K, fp16 P.V; Triton), if installed

Time: triton.testing.do_bench median (L2 flushed). Error: relative Frobenius error against float64
attention on the first two heads and 256 query rows; `ref` is fx_fp8's CPU reference lowering
(block scales, the numerics the Triton kernel implements) on the same rows, and `xref` the ratio
of a candidate's error to it (issue bar: <= 1.5x). The JSON under --out-dir keeps every cell;
--table-from writes its rows into that GPU's table in fx_fp8/ops/tune_tables/ (see fx_fp8.ops.attention_table).

On the GPU machine the wheels from /work/whl_cache go in with
`pip install --no-deps --target /tmp/site <wheels>` and PYTHONPATH=/tmp/site; diffusers is not needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--dry-run" in sys.argv[1:]:
    # Triton reads TRITON_INTERPRET when it decorates its own library (tl.zeros, ...) and our kernels:
    # before the first import of triton, which importing torch._dynamo (fx_fp8 below) already does
    os.environ["TRITON_INTERPRET"] = "1"
try:  # the installed fx_fp8 (a checkout's fx_fp8/ lacks fx_fp8.passes, which the package maps in)
    import fx_fp8  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)

H = 24
# 32768 beside 32760 (Wan's 480p length): cuDNN BF16 runs slowly at the odd length, flattering every ratio there
FULL_GRID = [(d, s) for d in (128, 64) for s in (1024, 4608, 16384, 32760, 32768)]
QUICK_GRID = [(128, 4608), (128, 16384), (128, 32760), (128, 32768), (64, 4608)]
MASK_ROWS = [(128, 4608), (128, 16384), (64, 16384)]
QUICK_MASK_ROWS = [(128, 4608)]
OUTLIER_ROWS = [(128, 4608)]
DRY_GRID = [(64, 200), (128, 130)]
DRY_MASK_ROWS = [(64, 200)]
DRY_OUTLIER_ROWS = [(64, 200)]
DRY_VARIANT_ROW = (128, 130, False)
OUTLIER_CHANNELS = (3, 17, 40, 60)
ERR_HEADS, ERR_ROWS = 2, 256
BAR = 1.5  # issue bar: a kernel's error at most 1.5x the reference lowering's
#: the kernel-alone variants: (name, pv_keys, two_level, config)
VARIANTS = [
    ("triton_pv128", 128, True, (128, 128, 8, 3)),
    ("triton_pv64", 64, True, (128, 128, 8, 3)),
    ("triton_pv32", 32, True, (128, 64, 8, 3)),
    ("triton_inplace", 128, False, (128, 128, 8, 3)),
]
CANDIDATES = (
    [
        "cudnn_bf16",
        "flash_bf16",
        "efficient_bf16",
        "fa3_bf16",
        "triton",
        "triton_kernel",
        "triton_prepass",
        "triton_prepass_one_launch",
        "triton_prepass_narrow",
        "triton_m64n128",
        "triton_qtma",
        "gluon",
    ]
    + [v[0] for v in VARIANTS]
    + ["cudnn_fp8", "cudnn_fp8_bf16o", "fa3_fp8", "sage"]
)
#: candidates that need a GPU library (skipped in a dry run)
GPU_ONLY = {
    "gluon",
    "cudnn_bf16",
    "flash_bf16",
    "efficient_bf16",
    "fa3_bf16",
    "cudnn_fp8",
    "cudnn_fp8_bf16o",
    "fa3_fp8",
    "sage",
}
NO_MASK = {"gluon", "flash_bf16", "fa3_bf16", "cudnn_fp8", "cudnn_fp8_bf16o", "fa3_fp8", "sage"}
#: one fixed D / S per variant in quick mode (they answer "which PV_KEYS", not "how fast everywhere")
QUICK_VARIANT_ROWS = {(128, 16384, False), (128, 32760, False)}


class Skip(Exception):
    """A candidate that does not apply to this row (not an error)."""


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows (D128 S 4608 / 16384 / 32760 / 32768, D64 S 4608)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: every row")
    ap.add_argument("--out-dir", default=None, help="write attention_kernels.json here")
    ap.add_argument("--only", default=None, help="comma-separated candidate names to run (default: all)")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: start no new row after this, still print the table and write the JSON",
    )
    ap.add_argument("--table-from", default=None, help="a results JSON: write its rows into fx_fp8/ops/tune_tables/")
    return ap.parse_args(argv)


# -- inputs and errors ----------------------------------------------------------------------------
def make_inputs(torch, d, s, device, *, outlier=False, heads=H, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(1, heads, s, d, generator=g, device=device) for _ in range(3))
    v += 0.5
    if outlier:
        q[..., list(OUTLIER_CHANNELS)] *= 5
        k[..., list(OUTLIER_CHANNELS)] *= 5
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def key_padding_mask(torch, s, device):
    keep = torch.ones(1, 1, 1, s, dtype=torch.bool, device=device)
    keep[..., s - s // 10 :] = False
    return keep


def exact_subset(torch, q, k, v, mask, scale):
    """float64 attention of the first ERR_HEADS heads and ERR_ROWS query rows."""
    qs, ks, vs = (t[:, :ERR_HEADS].double() for t in (q[:, :, :ERR_ROWS], k, v))
    scores = (qs @ ks.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ vs


def reference_subset(torch, q, k, v, mask, scale):
    """fx_fp8's reference lowering (block recipe) on the same heads / rows (whole q blocks: same scales)."""
    from fx_fp8.ops.reference import LOWERING as R

    out = R.attention(
        q[:, :ERR_HEADS, :ERR_ROWS],
        k[:, :ERR_HEADS],
        v[:, :ERR_HEADS],
        attn_mask=mask,
        softmax_scale=scale,
        granularity="block",
        q_block=128,
        kv_block=256,
        hadamard=True,
        smooth_k=True,
        quantize_p=True,
        p_scale=448.0,
        kernel="auto",
        return_lse=False,
    )
    return out


def rel_err(out, exact) -> float:
    o = out[:, :ERR_HEADS, :ERR_ROWS].double()
    return float((o - exact).norm() / exact.norm())


# -- timing -----------------------------------------------------------------------------------------
def timer(dry):
    if dry:

        def bench(fn):  # the interpreter: one call shows the cell runs; its time means nothing
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)

        return bench
    import triton.testing

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    return bench


# -- candidates: each returns fn() -> (B, H, S, D) output, plus a note ----------------------------------
def cand_sdpa(ctx, backend_name):
    torch, F = ctx["torch"], ctx["F"]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    q, k, v, mask = ctx["q"], ctx["k"], ctx["v"], ctx["mask"]

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return fn, ""


def _fp8_kw(granularity="block"):
    return dict(
        granularity=granularity, q_block=128, kv_block=256, hadamard=True, smooth_k=True, quantize_p=True, p_scale=448.0
    )


def cand_triton(ctx):
    from fx_fp8.ops.cuda import CudaLowering

    low = CudaLowering()
    q, k, v, mask, scale = ctx["q"], ctx["k"], ctx["v"], ctx["mask"], ctx["scale"]

    def fn():
        return low.attention(
            q, k, v, attn_mask=mask, softmax_scale=scale, kernel="triton", return_lse=False, **_fp8_kw()
        )

    return fn, ""


def _prepared(ctx):
    if "prepared" not in ctx:
        from fx_fp8.ops import triton_quant
        from fx_fp8.ops.triton_fp8_attention import key_bias

        q, k, v = ctx["q"], ctx["k"], ctx["v"]
        kw = _fp8_kw()
        pre = triton_quant.prepare_qkv(
            q, k, v, granularity=kw["granularity"], q_block=128, kv_block=256, hadamard=True, smooth_k=True
        )
        ctx["prepared"] = (pre[:6], key_bias(ctx["mask"], q.shape[0], q.shape[1], k.shape[2]))
    return ctx["prepared"]


def cand_triton_kernel(ctx, pv_keys=None, two_level=True, config=None, tile=None, q_tma=False):
    from fx_fp8.ops import triton_fp8_attention as ta

    (pre, bias) = _prepared(ctx)
    q = ctx["q"]
    if ctx["dry"] and config is not None:
        config = (64, config[1], 4, 1)  # the interpreter: one small program shape, same key tile
    kw = dict(
        s_q=q.shape[2],
        s_k=ctx["k"].shape[2],
        softmax_scale=ctx["scale"],
        q_block=128,
        kv_block=256,
        out_dtype=q.dtype,
        bias=bias,
        two_level=two_level,
        pv_keys=pv_keys,
        config=config,
        tile=tile,
        q_tma=q_tma,
    )

    def fn():
        return ta.fp8_flash_attention(*pre, **kw)

    note = ""
    if config is None and not ctx["dry"]:
        fn()  # autotune now, to name the config it picked
        tuned = ta._tuned_kernel(tile, ta.tma_available(q.device))
        best = getattr(tuned, "best_config", None)
        if best is not None:
            note = f"{best.kwargs.get('BLOCK_M')}x{best.kwargs.get('BLOCK_N')}x{best.num_warps}w{best.num_stages}s"
    elif config is not None:
        note = "x".join(map(str, config))
    return fn, note


def cand_gluon(ctx):
    from fx_fp8.ops import gluon_fp8_attention as ga

    (pre, _) = _prepared(ctx)
    q = ctx["q"]
    kw = dict(
        s_q=q.shape[2], s_k=ctx["k"].shape[2], softmax_scale=ctx["scale"], q_block=128, kv_block=256, out_dtype=q.dtype
    )

    def fn():
        return ga.fp8_flash_attention(*pre, **kw)

    return fn, f"{ga.BLOCK_M}x2 rows x {ga.BLOCK_N} keys, {ga.STAGES} stages, unverified"


def cand_triton_prepass(ctx, one_launch: bool = False, wide_steps=None):
    from fx_fp8.ops import triton_quant

    q, k, v = ctx["q"], ctx["k"], ctx["v"]

    def fn():
        triton_quant.prepare_qkv(
            q,
            k,
            v,
            granularity="block",
            q_block=128,
            kv_block=256,
            hadamard=True,
            smooth_k=True,
            one_launch=one_launch,
            wide_steps=wide_steps,
        )

    return fn, "time only" + (", Q / K / V in one launch" if one_launch else "") + (
        ", 32-row steps" if wide_steps is False else ""
    )


def cand_cudnn_fp8(ctx):
    from fx_fp8.ops import cudnn_attention
    from fx_fp8.ops.cuda import CudaLowering

    reason = cudnn_attention.import_reason()
    if reason:
        raise Skip(reason)
    low = CudaLowering()
    q, k, v, scale = ctx["q"], ctx["k"], ctx["v"], ctx["scale"]

    def fn():
        return low.attention(
            q, k, v, attn_mask=None, softmax_scale=scale, kernel="cudnn", return_lse=False, **_fp8_kw("tensor")
        )

    cudnn = cudnn_attention.import_cudnn()
    try:
        backend = cudnn.backend_version()
    except Exception:
        backend = "?"
    return fn, f"per-tensor scales, FP8 O; frontend {getattr(cudnn, '__version__', '?')}, backend {backend}"


def cand_cudnn_fp8_bf16o(ctx):
    """The cuDNN FP8 graph with a BF16 output (scale_o = 1): no FP8 rounding of O, if cuDNN takes it."""
    torch = ctx["torch"]
    from fx_fp8.ops import cudnn_attention, triton_quant

    reason = cudnn_attention.import_reason()
    if reason:
        raise Skip(reason)
    cudnn = cudnn_attention.import_cudnn()
    q, k, v, scale = ctx["q"], ctx["k"], ctx["v"], ctx["scale"]
    handle = cudnn.create_handle()
    qq, sq, kq, sk, vq, sv, _ = triton_quant.prepare_qkv(
        q, k, v, granularity="tensor", q_block=1, kv_block=1, hadamard=True, smooth_k=True, pad=False, transpose_v=False
    )
    o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    graph, t = cudnn_attention.build_graph(
        cudnn,
        shape_q=qq.shape,
        stride_q=qq.stride(),
        shape_k=kq.shape,
        stride_k=kq.stride(),
        stride_v=vq.stride(),
        stride_o=o.stride(),
        softmax_scale=scale,
        need_lse=False,
        handle=handle,
        fp8_output=False,
    )
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)
    amax = [torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device) for _ in range(2)]

    def fn():
        qq, sq, kq, sk, vq, sv, _ = triton_quant.prepare_qkv(
            q,
            k,
            v,
            granularity="tensor",
            q_block=1,
            kv_block=1,
            hadamard=True,
            smooth_k=True,
            pad=False,
            transpose_v=False,
        )
        scales = cudnn_attention.scale_tensors(sq, sk, sv, 448.0)
        scales["scale_o"] = torch.ones_like(scales["scale_o"])
        tensors = dict(q=qq, k=kq, v=vq, o=o, amax_s=amax[0], amax_o=amax[1], **scales)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        graph.execute(cudnn_attention.variant_pack(t, tensors), workspace, handle=handle)
        return o

    return fn, "cuDNN accepted a BF16 O"


def _fa3():
    try:
        import fa3_fwd_interface  # noqa: F401  the fa3_fwd wheel (FlashAttention-3 forward, built for torch 2.10)
    except Exception as e:  # ImportError, or the extension failing to load on this torch
        raise Skip(f"fa3_fwd does not load: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return fa3_fwd_interface


def cand_fa3_bf16(ctx):
    fa3 = _fa3()
    q, k, v, scale = (ctx[n] for n in ("q", "k", "v", "scale"))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) views

    def fn():
        return fa3.flash_attn_func(qt, kt, vt, softmax_scale=scale).transpose(1, 2)

    return fn, ""


def cand_fa3_fp8(ctx):
    """FA3's FP8 forward on fx_fp8's pre-pass (K smoothed, Q/K rotated, one scale per head)."""
    fa3 = _fa3()
    from fx_fp8.ops import triton_quant

    q, k, v, scale = (ctx[n] for n in ("q", "k", "v", "scale"))
    b, h = q.shape[:2]

    def fn():
        qq, sq, kq, sk, vq, sv, _ = triton_quant.prepare_qkv(
            q,
            k,
            v,
            granularity="head",
            q_block=1,
            kv_block=1,
            hadamard=True,
            smooth_k=True,
            pad=False,
            transpose_v=False,
        )
        out = fa3.flash_attn_func(
            qq.transpose(1, 2),
            kq.transpose(1, 2),
            vq.transpose(1, 2),
            softmax_scale=scale,
            q_descale=sq.reshape(b, h),
            k_descale=sk.reshape(b, h),
            v_descale=sv.reshape(b, h),
        )
        return out.transpose(1, 2)

    return fn, "per-head scales, fx_fp8 pre-pass"


def cand_sage(ctx):
    try:
        from sageattention import sageattn
    except Exception as e:
        raise Skip(f"sageattention not importable: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    q, k, v, scale = (ctx[n] for n in ("q", "k", "v", "scale"))
    k_own = k.clone()  # sageattn subtracts K's mean in place: its own copy (zero-mean after the first call)

    def fn():
        return sageattn(q, k_own, v, tensor_layout="HND", is_causal=False, sm_scale=scale)

    return fn, "INT8 QK, fp16 PV"


def build(ctx, name):
    if name in GPU_ONLY and ctx["dry"]:
        raise Skip("needs a GPU")
    if name in NO_MASK and ctx["mask"] is not None:
        raise Skip("no key-padding masks")
    if name == "cudnn_bf16":
        return cand_sdpa(ctx, "CUDNN_ATTENTION")
    if name == "flash_bf16":
        return cand_sdpa(ctx, "FLASH_ATTENTION")
    if name == "efficient_bf16":
        return cand_sdpa(ctx, "EFFICIENT_ATTENTION")
    if name == "fa3_bf16":
        return cand_fa3_bf16(ctx)
    if name == "triton":
        return cand_triton(ctx)
    if name == "triton_kernel":
        return cand_triton_kernel(ctx)
    if name == "triton_prepass":
        return cand_triton_prepass(ctx)
    if name == "triton_prepass_one_launch":
        return cand_triton_prepass(ctx, one_launch=True)
    if name == "triton_prepass_narrow":
        return cand_triton_prepass(ctx, wide_steps=False)
    if name == "gluon":
        return cand_gluon(ctx)
    if name == "triton_qtma":
        return cand_triton_kernel(ctx, q_tma=True)
    if name == "triton_m64n128":
        if ctx["outlier"]:
            raise Skip("not on the outlier row")
        return cand_triton_kernel(ctx, tile="m64n128")
    for vname, pv, two_level, config in VARIANTS:
        if name == vname:
            key = (ctx["d"], ctx["s"], ctx["mask"] is not None)
            if ctx["quick"] and key not in QUICK_VARIANT_ROWS:
                raise Skip("quick: measured at D128 S16384 / 32760 only")
            if ctx["dry"] and key != DRY_VARIANT_ROW:
                raise Skip(f"dry run: on D{DRY_VARIANT_ROW[0]} S{DRY_VARIANT_ROW[1]} only")
            if ctx["outlier"]:
                raise Skip("not on the outlier row")
            return cand_triton_kernel(ctx, pv_keys=pv, two_level=two_level, config=config)
    if name == "cudnn_fp8":
        return cand_cudnn_fp8(ctx)
    if name == "cudnn_fp8_bf16o":
        return cand_cudnn_fp8_bf16o(ctx)
    if name == "fa3_fp8":
        return cand_fa3_fp8(ctx)
    if name == "sage":
        return cand_sage(ctx)
    raise ValueError(f"unknown candidate {name!r}")


# -- one row -----------------------------------------------------------------------------------------
def run_row(torch, F, bench, *, d, s, mask_on, outlier, device, dry, quick, only):
    q, k, v = make_inputs(torch, d, s, device, outlier=outlier, heads=2 if dry else H)
    mask = key_padding_mask(torch, s, device) if mask_on else None
    scale = 1.0 / math.sqrt(d)
    ctx = dict(torch=torch, F=F, q=q, k=k, v=v, mask=mask, scale=scale, d=d, s=s, dry=dry, quick=quick, outlier=outlier)
    exact = exact_subset(torch, q, k, v, mask, scale)
    row = {
        "d": d,
        "s": s,
        "heads": q.shape[1],
        "mask": mask_on,
        "inputs": "outlier x5" if outlier else "gaussian",
        "ref_err": None,
        "cells": {},
    }
    try:
        row["ref_err"] = rel_err(reference_subset(torch, q, k, v, mask, scale), exact)
    except Exception as e:  # the reference itself failing is worth a line, not the run
        row["ref_error"] = f"{type(e).__name__}: {e}"
    flops = 4.0 * q.shape[0] * q.shape[1] * s * s * d
    for name in CANDIDATES:
        if only and name not in only:
            continue
        cell = {}
        try:
            fn, note = build(ctx, name)
            out = fn()
            if out is not None:
                cell["err"] = rel_err(out, exact)
            if device == "cuda":
                torch.cuda.synchronize()
            cell["ms"] = bench(fn)
            cell["tflops"] = flops / cell["ms"] / 1e9
            if note:
                cell["note"] = note
        except Skip as e:
            cell = {"skipped": str(e)}
        except Exception as e:  # one failing candidate never ends the run
            cell = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            if os.environ.get("ATTN_PROBE_TRACEBACK"):
                traceback.print_exc()
        row["cells"][name] = cell
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


# -- output --------------------------------------------------------------------------------------------
def format_table(rows) -> str:
    lines = []
    head = f"{'case':<28} {'kernel':<16} {'ms':>8} {'x cuDNN':>8} {'TFLOP/s':>8} {'err %':>7} {'xref':>6}  note"
    lines.append(head)
    lines.append("-" * len(head))
    for r in rows:
        case = f"D{r['d']} S{r['s']} H{r['heads']}{' mask' if r['mask'] else ''}{' outl' if 'outlier' in r['inputs'] else ''}"
        ref = r.get("ref_err")
        lines.append(
            f"{case:<28} {'(reference)':<16} {'':>8} {'':>8} {'':>8} "
            f"{(100 * ref if ref is not None else float('nan')):>7.3f} {'1.00':>6}  CPU-reference numerics"
        )
        base = r["cells"].get("cudnn_bf16", {}).get("ms") or r["cells"].get("efficient_bf16", {}).get("ms")
        for name, c in r["cells"].items():
            if "skipped" in c:
                lines.append(f"{'':<28} {name:<16} {'-':>8} {'':>8} {'':>8} {'':>7} {'':>6}  skipped: {c['skipped']}")
                continue
            if "error" in c:
                lines.append(f"{'':<28} {name:<16} {'-':>8} {'':>8} {'':>8} {'':>7} {'':>6}  error: {c['error']}")
                continue
            speed = f"{base / c['ms']:.2f}" if base and c.get("ms") else ""
            err = c.get("err")
            xref = f"{err / ref:.2f}" if err is not None and ref else ""
            flag = " !" if err is not None and ref and err > BAR * ref else ""
            lines.append(
                f"{'':<28} {name:<16} {c['ms']:>8.3f} {speed:>8} {c['tflops']:>8.1f} "
                f"{(100 * err if err is not None else float('nan')):>7.3f} {xref:>6}{flag:<2} {c.get('note', '')}"
            )
    lines.append("")
    lines.append(
        f"x cuDNN: cuDNN BF16 time (efficient BF16 where cuDNN failed) / this time (>1 is faster). xref: error / the reference lowering's "
        f"error; '!' marks more than {BAR}x (the issue's bar)."
    )
    return "\n".join(lines)


def meta(torch, device, dry, args):
    import triton

    m = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": "CPU dry run (Triton interpreter; timings meaningless)" if dry else torch.cuda.get_device_name(),
        "quick": bool(args.quick),
        "python": sys.version.split()[0],
    }
    if device == "cuda":
        m["capability"] = list(torch.cuda.get_device_capability())
        m["cudnn_backend"] = torch.backends.cudnn.version()
    try:
        import cudnn

        m["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
    except Exception as e:
        m["cudnn_frontend"] = f"not importable ({type(e).__name__})"
    return m


def main(argv=None) -> int:
    args = parse(argv)
    if args.table_from:
        from fx_fp8.ops import attention_table

        with open(args.table_from) as f:
            results = json.load(f)
        # this GPU's rows replace its old ones; other GPUs' rows stay
        table = attention_table.merged(attention_table.load_table(), attention_table.table_from_probe(results))
        attention_table.write_table(table)
        print(f"wrote {attention_table.TABLE_PATH} ({len(table['rows'])} rows)")
        print(attention_table.format_rows(table))
        return 0
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run: TRITON_INTERPRET=1 must be set before triton is imported (done at the top)")
    import torch
    import torch.nn.functional as F

    if args.dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False  # the float64 / fp32 references stay exact
    else:
        print("no CUDA GPU here: run with --dry-run for the CPU check of every row", file=sys.stderr)
        return 2
    bench = timer(args.dry_run)
    only = set(args.only.split(",")) if args.only else None
    if only and only - set(CANDIDATES):
        print(f"unknown candidates {sorted(only - set(CANDIDATES))}; known: {CANDIDATES}", file=sys.stderr)
        return 2
    if args.dry_run:
        grid, masks, outliers = DRY_GRID, DRY_MASK_ROWS, DRY_OUTLIER_ROWS
    elif args.quick:
        grid, masks, outliers = QUICK_GRID, QUICK_MASK_ROWS, OUTLIER_ROWS
    else:
        grid, masks, outliers = FULL_GRID, MASK_ROWS, OUTLIER_ROWS
    plan = (
        [(d, s, False, False) for d, s in grid]
        + [(d, s, True, False) for d, s in masks]
        + [(d, s, False, True) for d, s in outliers]
    )
    t0 = time.time()
    info = meta(torch, device, args.dry_run, args)
    rows = []
    for d, s, mask_on, outlier in plan:
        if args.budget is not None and time.time() - t0 > args.budget:
            rows.append(
                {
                    "d": d,
                    "s": s,
                    "heads": H,
                    "mask": mask_on,
                    "inputs": "outlier x5" if outlier else "gaussian",
                    "ref_err": None,
                    "cells": {n: {"skipped": "time budget"} for n in CANDIDATES},
                }
            )
            continue
        rows.append(
            run_row(
                torch,
                F,
                bench,
                d=d,
                s=s,
                mask_on=mask_on,
                outlier=outlier,
                device=device,
                dry=args.dry_run,
                quick=args.quick,
                only=only,
            )
        )
        print(
            f"[{time.time() - t0:6.1f} s] D{d} S{s}{' mask' if mask_on else ''}{' outlier' if outlier else ''} done",
            file=sys.stderr,
            flush=True,
        )
        results = {"meta": info, "rows": rows, "seconds": time.time() - t0}
        if args.out_dir:  # after every row: a run cut short still leaves what it measured
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "attention_kernels.json"), "w") as f:
                json.dump(results, f, indent=1)
    results = {"meta": info, "rows": rows, "seconds": time.time() - t0}
    print(
        f"\nattention kernels, B1 H{H} (error rows: {ERR_HEADS} heads x {ERR_ROWS} queries vs float64) — "
        f"{results['meta']['device']}, torch {results['meta']['torch']}, Triton {results['meta']['triton']}, "
        f"cudnn-frontend {results['meta']['cudnn_frontend']}, {results['seconds']:.0f} s"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
