"""Fused weight-only (W8A16) GEMM for the CUDA lowering: quantized weights dequantized in the tile loop.

y = x @ (Wq * scale)^T + bias with x bf16 / fp16 [M, K] and Wq [N, K] FP8 e4m3 or INT8. Each
program owns a BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps: it loads the
quantized weight tile (1 byte per value: half the bf16 weight traffic), widens it to the
activations' dtype in registers and runs a tensor-core dot with fp32 accumulation. No bf16
copy of the weight is ever written to memory (the unfused path writes and re-reads one).

Scales (fp32), as `quant.quantize_weight` makes them:
* tensor [] and channel [N, 1]: the dot runs on the raw codes and the output column is
  multiplied by its scale once, in the epilogue (exact: sum_k x_k q_nk s_n = s_n sum_k x_k q_nk);
* block [ceil(N / BR), ceil(K / BC)] (weight-only groups are [1, g]; W8A8 weights on a
  weight-only step may carry 128 x 128 blocks): BLOCK_K divides BC, so each K step lies in one
  group; its partial dot is multiplied by the group's scale before it is accumulated.
Few rows (M <= SMALL_M: the conditioning layers, one row per image) make a tensor-core dot mostly
padding, so the kernel has a second form, FMA: one program per BLOCK_N output channels takes all M
rows, reads the weight tile N-major (each channel's bytes contiguous), multiplies block scales into
the widened tile in registers and reduces with fp32 CUDA-core FMAs; its K steps may span several
scale groups (the tensor-core form's must lie in one: 32 columns for the default weight-only groups).
On a GPU, calls with M <= SMALL_M are autotuned over both forms (small_m_candidates: the tensor-core
tile that ran before the FMA form existed is always among them), per (M, N, K, scales, storage).
Verified on CPU only (every candidate's numerics in Triton's interpreter, the autotuner end to end with a
stand-in timer, every tile compiled for sm_90a without spills); which one is fastest, and by how much,
needs a GPU run (benchmarks/w8a16_forms.py; cuda_bench.py --quick's conditioning linears).
e4m3 values (3 mantissa bits) and INT8 codes (|q| <= 127) are exact in bf16 and fp16, so the
widening is exact: the only roundings are the dot's fp32 accumulation and the final cast. The
CPU reference instead rounds each dequantized weight (q * s) to the activation dtype before its
matmul; the kernel is the more exact of the two (both within bf16 rounding of the fp64 product).

Triton's CPU interpreter (TRITON_INTERPRET=1) mishandles bf16 dots and truncates fp32 -> bf16
casts: when interpreting, the dot runs in fp32 and the output is rounded to nearest-even bf16
in fp32 bits first (`triton_quant.round_bf16`), as the other kernels of this lowering do.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import triton
import triton.language as tl

from fx_fp8.ops.triton_quant import interpreting, round_bf16

#: activation dtypes the kernel takes (the dot runs in this dtype)
ACT_DTYPES = (torch.bfloat16, torch.float16)
#: weight storages it widens in registers
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)
#: K steps it can take: the largest dividing the group width of block scales is used
K_STEPS = (64, 32, 16)
#: rows up to which GPU calls are autotuned over SMALL_M_CONFIGS
SMALL_M = 16
#: FMA tiles (BLOCK_N, BLOCK_K, num_warps, num_stages), largest weight tile first; a padded row count BLOCK_M
#: keeps the first six whose broadcast product BLOCK_M x BLOCK_N x BLOCK_K stays within 64 fp32 values per
#: thread. All compile for sm_90a without spills, weights read in 8- or 16-byte vectors
#: (tests/ops/test_cuda_kernel_spills.py)
_FMA_TILES = (
    (16, 512, 4, 4),
    (32, 256, 8, 3),
    (16, 256, 4, 4),
    (32, 128, 4, 4),
    (64, 64, 4, 4),
    (8, 512, 2, 4),
    (16, 128, 4, 4),
    (32, 64, 4, 4),
    (16, 64, 4, 4),
)
#: small-M candidates (BLOCK_M, BLOCK_N, BLOCK_K, FMA, num_warps, num_stages): tensor-core tiles (tile_config's
#: and a narrower one, at every K step) and, per padded row count, at most six FMA tiles
SMALL_M_CONFIGS = tuple(
    [(16, bn, bk, False, 4, 3) for bn in (64, 32) for bk in K_STEPS]
    + [
        (bm, bn, bk, True, w, st)
        for bm in (1, 2, 4, 8, 16)
        for bn, bk, w, st in [t for t in _FMA_TILES if bm * t[0] * t[1] <= 64 * 32 * t[2]][:6]
    ]
)


def tile_config(m: int, bc: Optional[int]) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows; bc: block scales' column width (None: none).
    Small M (the one-token-per-image conditioning layers) gets short, wide-N tiles: the kernel is
    then a weight-streaming GEMV and its speed is the weight bytes it reads. Untuned: a GPU run
    of benchmarks/cuda_bench.py should confirm or replace these."""
    block_k = 64 if bc is None else next(s for s in K_STEPS if bc % s == 0)
    if m <= 16:
        return 16, 64, block_k, 4
    if m <= 64:
        return 64, 64, block_k, 4
    return 128, 64, block_k, 8


def fit_reason(x2d: torch.Tensor, wq: torch.Tensor, granularity: str, block) -> Optional[str]:
    """None when the fused kernel takes these operands, else why not (the caller falls back)."""
    if x2d.dtype not in ACT_DTYPES:
        return f"activations in {x2d.dtype} (the fused W8A16 kernel takes bf16 / fp16)"
    if wq.dtype not in WEIGHT_DTYPES:
        return f"weight storage {wq.dtype} (the fused W8A16 kernel takes float8_e4m3fn / int8)"
    if granularity not in ("tensor", "channel", "block"):
        return f"weight granularity {granularity!r}"
    if granularity == "block":
        if block is None or len(block) != 2:
            return f"block scales without a block size ({block!r})"
        if block[1] % K_STEPS[-1]:
            return (
                f"weight block {list(block)}: its {block[1]} columns are not a multiple of "
                f"{K_STEPS[-1]} (each K step of the kernel must lie in one scale group)"
            )
    return None


@triton.jit
def _dot_step(
    x_ptr,
    w_ptr,
    s_ptr,
    rm,
    rn,
    kk,
    mm,
    mn,
    mk,
    k0,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    W_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One K step of the tensor-core form: a dot on the raw codes, times the step's group scale (block scales)."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mm[:, None] & mk[None, :], other=0.0)
    # the weight tile read K-major ([BLOCK_K, BLOCK_N]), widened in registers: exact for e4m3 and int8
    w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk, mask=mk[:, None] & mn[None, :], other=0)
    if W_FP8:  # e4m3 codes travel as bytes (a masked FP8 load has no `other`); byte 0 is +0.0
        w = w.to(tl.float8e4nv, bitcast=True)
    if DOT_F32:
        part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(x, w.to(tl.float32).to(x.dtype))
    if SCALE_MODE == 2:
        s = tl.load(s_ptr + (rn // BLOCK_ROWS) * stride_sn + (k0 // BLOCK_COLS) * stride_sk, mask=mn, other=0.0)
        part = part * s[None, :]
    return part


@triton.jit
def _fma_step(
    x_ptr,
    w_ptr,
    s_ptr,
    rm,
    rn,
    kk,
    mm,
    mn,
    mk,
    k0,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    W_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One K step of the FMA form: x[rows, kk] . dequant(W[rn, kk]) -> [BLOCK_M, BLOCK_N] fp32 partial sums.
    The weight tile is read N-major ([BLOCK_N, BLOCK_K]: each channel's bytes contiguous)."""
    w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :] * stride_wk, mask=mn[:, None] & mk[None, :], other=0)
    if W_FP8:
        w = w.to(tl.float8e4nv, bitcast=True)
    w = w.to(tl.float32)
    if SCALE_MODE == 2:
        if BLOCK_K > BLOCK_COLS:  # whole scale groups per step: one scale per (channel, group), broadcast
            gk = k0 // BLOCK_COLS + tl.arange(0, BLOCK_K // BLOCK_COLS)
            s = tl.load(
                s_ptr + (rn // BLOCK_ROWS)[:, None] * stride_sn + gk[None, :] * stride_sk,
                mask=mn[:, None] & (gk * BLOCK_COLS < K)[None, :],
                other=0.0,
            )
            w = tl.reshape(
                tl.reshape(w, (BLOCK_N, BLOCK_K // BLOCK_COLS, BLOCK_COLS)) * s[:, :, None], (BLOCK_N, BLOCK_K)
            )
        else:  # the step lies in one group
            s = tl.load(s_ptr + (rn // BLOCK_ROWS) * stride_sn + (k0 // BLOCK_COLS) * stride_sk, mask=mn, other=0.0)
            w = w * s[:, None]
    x = tl.load(
        x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mm[:, None] & mk[None, :], other=0.0
    ).to(tl.float32)
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    W_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FMA: tl.constexpr,
):
    # SCALE_MODE: 0 one scale, 1 per output channel, 2 per (BLOCK_ROWS x BLOCK_COLS) block.
    # FMA (BLOCK_M >= M): the few-rows form, CUDA-core FMAs instead of a mostly-padding tensor-core dot.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles walk the same weight columns while they are in L2
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mk = kk < K
        if FMA:
            acc += _fma_step(
                x_ptr,
                w_ptr,
                s_ptr,
                rm,
                rn,
                kk,
                mm,
                mn,
                mk,
                k0,
                K,
                stride_xm,
                stride_xk,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_ROWS,
                BLOCK_COLS,
                SCALE_MODE,
                W_FP8,
                BLOCK_N,
                BLOCK_K,
            )
        else:
            acc += _dot_step(
                x_ptr,
                w_ptr,
                s_ptr,
                rm,
                rn,
                kk,
                mm,
                mn,
                mk,
                k0,
                stride_xm,
                stride_xk,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_ROWS,
                BLOCK_COLS,
                SCALE_MODE,
                W_FP8,
                DOT_F32,
            )
    if SCALE_MODE == 1:
        acc = acc * tl.load(s_ptr + rn * stride_sn, mask=mn, other=0.0)[None, :]
    elif SCALE_MODE == 0:
        acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mm[:, None] & mn[None, :],
    )


def fma_fits(m: int, bc: Optional[int], bm: int, bk: int) -> bool:
    """The FMA form takes all m rows in one tile (bm: the next power of two) and, with block scales of bc
    columns, K steps that are whole groups (bk a multiple of a power-of-two bc) or lie in one (bc % bk == 0)."""
    if bm != triton.next_power_of_2(m):
        return False
    if bc is None:
        return True
    return bc % bk == 0 if bk <= bc else (bk % bc == 0 and bc & (bc - 1) == 0)


def small_m_candidates(m: int, bc: Optional[int]) -> list[tuple]:
    """The SMALL_M_CONFIGS the autotuner times for m <= SMALL_M rows (bc: block scales' column width, None:
    none): tile_config's tensor-core tile (what ran before the FMA form, so tuning never loses it), a
    narrower one, and the FMA tiles that fit."""
    bk_dot = tile_config(m, bc)[2]
    return [
        c
        for c in SMALL_M_CONFIGS
        if (c[3] and fma_fits(m, bc, c[0], c[2])) or (not c[3] and c[0] >= m and c[2] == bk_dot)
    ]


def candidate_of(config: triton.Config) -> tuple:
    """The SMALL_M_CONFIGS tuple of an autotuner config (e.g. its best_config)."""
    kw = config.kwargs
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["FMA"], config.num_warps, config.num_stages


def _prune_small_m(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}  # the constexpr flags come as keywords
    m = args["M"]
    bc = args["BLOCK_COLS"] if args["SCALE_MODE"] == 2 else None
    keep = set(small_m_candidates(m, bc))
    kept = [c for c in configs if candidate_of(c) in keep]
    if not kept:  # tile_config's tile is always a candidate for m <= SMALL_M: only a bug gets here
        raise RuntimeError(f"w8a16: no small-M candidate for M={m}, block columns {bc}")
    return kept


def _bench_kwargs() -> dict:
    """Short timing runs (the candidates take microseconds); a Triton without autotune's do_bench
    argument times with its defaults."""
    if "do_bench" not in inspect.signature(triton.autotune).parameters:
        return {}
    from triton.testing import do_bench

    return {"do_bench": lambda fn, quantiles: do_bench(fn, warmup=5, rep=25, quantiles=quantiles)}


_w8a16_small_m_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FMA": fma}, num_warps=w, num_stages=st)
        for bm, bn, bk, fma, w, st in SMALL_M_CONFIGS
    ],
    key=["M", "N", "K", "SCALE_MODE", "BLOCK_ROWS", "BLOCK_COLS", "W_FP8", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune_small_m},
    **_bench_kwargs(),
)(_w8a16_kernel)


def uses_autotuner(m: int, *, interpreting_now: bool, capturing: bool) -> bool:
    """Whether a call with m rows runs the autotuned small-M kernel: on a GPU, outside CUDA-graph capture
    (timing candidates would be recorded into the graph: a capture runs tile_config's tile)."""
    return m <= SMALL_M and not interpreting_now and not capturing


def full_config(config, m: int, bc: Optional[int]) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, FMA, num_warps, num_stages) from a 4-tuple (tensor-core) or 6-tuple
    config, or tile_config's."""
    config = tuple(config or tile_config(m, bc))
    if len(config) == 4:  # the tensor-core form, 3 stages
        bm, bn, bk, warps = config
        return bm, bn, bk, False, warps, 3
    return config


def w8a16_linear(
    x2d: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    weight_granularity: str,
    weight_block=None,
    config=None,
) -> torch.Tensor:
    """x2d [M, K] (bf16 / fp16) x dequant(wq [N, K], w_scale)^T (+ bias) -> [M, N] in x2d's dtype.
    The caller checks fit_reason first. On a GPU, up to SMALL_M rows run the autotuned candidates
    (small_m_candidates), more rows tile_config's tile; config overrides both (tests, benchmarks):
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for the tensor-core form or a full_config 6-tuple."""
    reason = fit_reason(x2d, wq, weight_granularity, weight_block)
    if reason is not None:
        raise ValueError(f"w8a16_linear: {reason}")
    m, k = x2d.shape
    n = wq.shape[0]
    if wq.shape[1] != k:
        raise ValueError(f"w8a16_linear: activation has {k} features, weight {tuple(wq.shape)}")
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if m == 0 or n == 0:
        return out
    scale = w_scale.float()
    if weight_granularity == "block":
        br, bc = (int(v) for v in weight_block)
        mode, s_n, s_k = 2, scale.stride(0), scale.stride(1)
    elif scale.numel() == 1:
        br = bc = 1
        mode, s_n, s_k = 0, 0, 0
        scale = scale.reshape(1)
    else:
        br = bc = 1
        scale = scale.reshape(-1)
        if scale.numel() != n:
            raise ValueError(f"w8a16_linear: {scale.numel()} channel scales for {n} output channels")
        mode, s_n, s_k = 1, scale.stride(0), 0
    interp = interpreting()
    fp8 = wq.dtype == torch.float8_e4m3fn
    args = (
        x2d,
        wq.view(torch.uint8) if fp8 else wq,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x2d.stride(0),
        x2d.stride(1),
        wq.stride(0),
        wq.stride(1),
        s_n,
        s_k,
        out.stride(0),
    )
    flags = dict(
        BLOCK_ROWS=br,
        BLOCK_COLS=bc,
        SCALE_MODE=mode,
        W_FP8=fp8,
        HAS_BIAS=bias is not None,
        DOT_F32=interp,
        ROUND_BF16=interp and x2d.dtype == torch.bfloat16,
        GROUP_M=8,
    )
    capturing = x2d.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if config is None and uses_autotuner(m, interpreting_now=interp, capturing=capturing):
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _w8a16_small_m_tuned[grid](*args, **flags)
        return out
    bm, bn, bk, fma, warps, stages = full_config(config, m, bc if mode == 2 else None)
    if fma and not fma_fits(m, bc if mode == 2 else None, bm, bk):
        raise ValueError(
            f"w8a16_linear: FMA tile BLOCK_M {bm} x BLOCK_K {bk} does not fit {m} rows / scale "
            f"groups of {bc if mode == 2 else None} columns"
        )
    if not fma and mode == 2 and bc % bk:
        raise ValueError(f"w8a16_linear: BLOCK_K {bk} does not divide the scale group width {bc}")
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _w8a16_kernel[grid](
        *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FMA=fma, num_warps=warps, num_stages=1 if interp else stages
    )
    return out
