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
e4m3 values (3 mantissa bits) and INT8 codes (|q| <= 127) are exact in bf16 and fp16, so the
widening is exact: the only roundings are the dot's fp32 accumulation and the final cast. The
CPU reference instead rounds each dequantized weight (q * s) to the activation dtype before its
matmul; the kernel is the more exact of the two (both within bf16 rounding of the fp64 product).

Triton's CPU interpreter (TRITON_INTERPRET=1) mishandles bf16 dots and truncates fp32 -> bf16
casts: when interpreting, the dot runs in fp32 and the output is rounded to nearest-even bf16
in fp32 bits first (`triton_quant.round_bf16`), as the other kernels of this lowering do.
"""
from __future__ import annotations

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
            return (f"weight block {list(block)}: its {block[1]} columns are not a multiple of "
                    f"{K_STEPS[-1]} (each K step of the kernel must lie in one scale group)")
    return None


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SCALE_MODE: tl.constexpr,
                  W_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # SCALE_MODE: 0 one scale, 1 per output channel, 2 per (BLOCK_ROWS x BLOCK_COLS) block
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
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mm[:, None] & mk[None, :],
                    other=0.0)
        # the weight tile read K-major ([BLOCK_K, BLOCK_N]), widened in registers: exact for e4m3 and int8
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk, mask=mk[:, None] & mn[None, :],
                    other=0)
        if W_FP8:  # e4m3 codes travel as bytes (a masked FP8 load has no `other`); byte 0 is +0.0
            w = w.to(tl.float8e4nv, bitcast=True)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(tl.float32).to(x.dtype))
        if SCALE_MODE == 2:
            s = tl.load(s_ptr + (rn // BLOCK_ROWS) * stride_sn + (k0 // BLOCK_COLS) * stride_sk, mask=mn, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if SCALE_MODE == 1:
        acc = acc * tl.load(s_ptr + rn * stride_sn, mask=mn, other=0.0)[None, :]
    elif SCALE_MODE == 0:
        acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def w8a16_linear(x2d: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], *,
                 weight_granularity: str, weight_block=None, config=None) -> torch.Tensor:
    """x2d [M, K] (bf16 / fp16) x dequant(wq [N, K], w_scale)^T (+ bias) -> [M, N] in x2d's dtype.
    The caller checks fit_reason first; config overrides tile_config (tests)."""
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
    bm, bn, bk, warps = config or tile_config(m, bc if mode == 2 else None)
    if mode == 2 and bc % bk:
        raise ValueError(f"w8a16_linear: BLOCK_K {bk} does not divide the scale group width {bc}")
    interp = interpreting()
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    fp8 = wq.dtype == torch.float8_e4m3fn
    _w8a16_kernel[grid](x2d, wq.view(torch.uint8) if fp8 else wq, scale, bias if bias is not None else scale, out, m, n, k,
                        x2d.stride(0), x2d.stride(1), wq.stride(0), wq.stride(1), s_n, s_k, out.stride(0),
                        BLOCK_ROWS=br, BLOCK_COLS=bc, SCALE_MODE=mode, W_FP8=fp8, HAS_BIAS=bias is not None,
                        DOT_F32=interp, ROUND_BF16=interp and x2d.dtype == torch.bfloat16,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                        num_stages=1 if interp else 3)
    return out
