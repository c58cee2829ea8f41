"""Fused Triton quantization kernels for the CUDA lowering (one pass over the data each).

- `quantize_rows_fp8(x2d)`: per-row (per-token) activation quantization: amax,
  scale and e4m3 cast in one kernel, numerics of `quant.quantize_per_row`.
- `prepare_qkv_blocks(q, k, v, ...)`: the block-granularity half of
  `quant.prepare_qkv` (smooth K, Hadamard rotation of Q and K, one scale per
  block of rows), writing the layouts the FP8 attention kernel reads: Q and K
  as (B, H, S_pad, D), V transposed to (B, H, D, S_pad) because FP8 `tl.dot`
  on Hopper wants its second operand K-major. Padding rows are zero.

Numerics match `fx_fp8.ops.quant` up to fp32 summation order: the scale is
`amax / 448` and the quotient `x / scale` are correctly rounded (`div_rn`),
the cast is round-to-nearest-even after clamping to +-448. The Hadamard
product runs on tensor cores as two fp16 dots (each row scaled by a power of
two, split into an fp16 high part and an fp16 remainder, H with exact +-1
entries, fp32 accumulation), accurate to ~2^-22 of the row's largest value,
far below the e4m3 step of 2^-4. (fp16, not bf16: the interpreter's bf16 dot
is broken in Triton 3.9, and fp16 halves are more precise anyway.)

Triton's CPU interpreter (TRITON_INTERPRET=1, Triton 3.9) rounds fp32 -> fp8
casts wrongly (no carry into the exponent, ties not to even), so under the
interpreter the kernels round to the e4m3 grid in fp32 first (EXACT_CAST),
which makes the cast itself exact; on GPUs the native cvt.rn.satfinite is used.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from fx_fp8.ops import quant

FP8_MAX = quant.FP8_MAX
SEQ_PAD = 128  # sequence padding of the attention layouts: a multiple of every BLOCK_M / BLOCK_N the kernel uses


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (decided when the kernels were decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def padded_len(s: int) -> int:
    return -(-s // SEQ_PAD) * SEQ_PAD


@triton.jit
def round_e4m3(x):
    """Round fp32 values in [-448, 448] to the nearest-even e4m3 value, in fp32 arithmetic.

    Adding and subtracting 1.5 * 2^(e + 20) rounds x to a multiple of its e4m3
    spacing 2^(e - 3) with the FPU's round-to-nearest-even (e = exponent of x,
    at least -6 where e4m3 turns subnormal)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    magic = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    return (x + magic) - magic


@triton.jit
def _to_e4m3(y, EXACT_CAST: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if EXACT_CAST:
        y = round_e4m3(y)
    return y.to(tl.float8e4nv)


# -- per-row activation quantization (linear) -------------------------------------
@triton.jit
def _quant_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om,
                       BLOCK_K: tl.constexpr, EXACT_CAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):  # second read comes from L2: rows are at most a few 10 KiB
        m = k0 + offs < K
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=m, other=0.0).to(tl.float32)
        y = _to_e4m3(tl.math.div_rn(x, scale), EXACT_CAST)
        tl.store(out_ptr + row * stride_om + k0 + offs, y, mask=m)


def quantize_rows_fp8(x2d: torch.Tensor, exact_cast: bool | None = None):
    """(x_fp8 [M, K] row-major, scale [M, 1] fp32) as quant.quantize_per_row."""
    if x2d.dim() != 2:
        raise ValueError(f"quantize_rows_fp8 expects a 2-D tensor, got shape {tuple(x2d.shape)}")
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    out = torch.empty((m, k), dtype=quant.FP8_DTYPE, device=x2d.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2d.device)
    if m == 0:
        return out, scale
    block_k = min(2048, triton.next_power_of_2(k))
    _quant_rows_kernel[(m,)](x2d, out, scale, k, x2d.stride(0), out.stride(0), BLOCK_K=block_k,
                             EXACT_CAST=interpreting() if exact_cast is None else exact_cast,
                             num_warps=4 if block_k <= 1024 else 8)
    return out, scale


# -- attention Q/K/V block quantization -------------------------------------------
@triton.jit
def _load_rotated(x_base, rows, row_ok, offs_d, stride_s, stride_d, mean, hm, inv_sqrt_d,
                  SMOOTH: tl.constexpr, HADAMARD: tl.constexpr):
    x = tl.load(x_base + rows[:, None] * stride_s + offs_d[None, :] * stride_d, mask=row_ok[:, None], other=0.0)
    x = x.to(tl.float32)
    if SMOOTH:
        x = x - mean[None, :]
    if HADAMARD:
        # x = 2^e * (hi + lo) with fp16 hi/lo: the rotation runs as two fp16 tensor-core dots
        # accurate to ~2^-22 of the row max (the power-of-two row factor keeps fp16 from overflowing).
        e = ((tl.max(tl.abs(x), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.minimum(tl.maximum(e, -125), 125) + 1
        down = ((127 - e) << 23).to(tl.float32, bitcast=True)
        up = ((127 + e) << 23).to(tl.float32, bitcast=True)
        xs = x * down[:, None]
        hi = xs.to(tl.float16)
        lo = (xs - hi.to(tl.float32)).to(tl.float16)
        x = (tl.dot(hi, hm) + tl.dot(lo, hm)) * (up * inv_sqrt_d)[:, None]
    return tl.where(row_ok[:, None], x, 0.0)  # smoothing made padding rows nonzero


@triton.jit
def _quant_blocks_kernel(x_ptr, mean_ptr, had_ptr, out_ptr, scale_ptr,
                         H, S, S_PAD, n_blocks, block,
                         stride_b, stride_h, stride_s, stride_d,
                         out_stride_bh, out_stride_s, out_stride_d, inv_sqrt_d,
                         D: tl.constexpr, ROWS: tl.constexpr, SMOOTH: tl.constexpr, HADAMARD: tl.constexpr,
                         EXACT_CAST: tl.constexpr):
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    x_base = x_ptr + b * stride_b + h * stride_h
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, ROWS)
    row0 = blk * block
    mean = tl.zeros([D], dtype=tl.float32)
    if SMOOTH:
        mean = tl.load(mean_ptr + bh * D + offs_d)
    hm = tl.zeros([D, D], dtype=tl.float16)
    if HADAMARD:
        hm = tl.load(had_ptr + offs_d[:, None] * D + offs_d[None, :])
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for r0 in range(0, block, ROWS):
        rows = row0 + r0 + offs_r
        ok = (r0 + offs_r < block) & (rows < S)
        x = _load_rotated(x_base, rows, ok, offs_d, stride_s, stride_d, mean, hm, inv_sqrt_d, SMOOTH, HADAMARD)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    tl.store(scale_ptr + bh * n_blocks + blk, scale)
    out_base = out_ptr + bh * out_stride_bh
    for r0 in range(0, block, ROWS):  # recompute instead of holding a 256-row block in registers
        rows = row0 + r0 + offs_r
        ok = (r0 + offs_r < block) & (rows < S)
        x = _load_rotated(x_base, rows, ok, offs_d, stride_s, stride_d, mean, hm, inv_sqrt_d, SMOOTH, HADAMARD)
        y = _to_e4m3(tl.math.div_rn(x, scale), EXACT_CAST)
        store_ok = (r0 + offs_r < block) & (rows < S_PAD)  # padding rows get zeros
        tl.store(out_base + rows[:, None] * out_stride_s + offs_d[None, :] * out_stride_d, y, mask=store_ok[:, None])


@functools.lru_cache(maxsize=None)
def _hadamard_pm1(n: int, device: str) -> torch.Tensor:
    """The reference's Sylvester Hadamard matrix with +-1 entries (exact in fp16)."""
    return torch.sign(quant._hadamard_cpu(n)).to(device=device, dtype=torch.float16).contiguous()


def quantize_blocks(x: torch.Tensor, block: int, *, smooth: bool = False, hadamard: bool = False,
                    transpose: bool = False, exact_cast: bool | None = None):
    """Quantize (B, H, S, D) in blocks of `block` rows, as quant.quantize_rows_in_blocks on the
    smoothed / rotated input. Returns (fp8 (B, H, S_pad, D) or (B, H, D, S_pad) if transpose,
    fp32 scales (B, H, ceil(S / block)))."""
    b, h, s, d = x.shape
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"quantize_blocks: head dim {d} not supported (need a power of two in 16..256)")
    if block < 1:
        raise ValueError(f"quantize_blocks: block must be positive, got {block}")
    s_pad = padded_len(s)
    n_blocks = -(-s // block)
    make = torch.empty if n_blocks * block >= s_pad else torch.zeros
    shape = (b, h, d, s_pad) if transpose else (b, h, s_pad, d)
    out = make(shape, dtype=quant.FP8_DTYPE, device=x.device)
    scale = torch.empty((b, h, n_blocks), dtype=torch.float32, device=x.device)
    mean = x.float().mean(dim=2).contiguous() if smooth else scale  # same op as the reference; dummy pointer when unused
    had = _hadamard_pm1(d, str(x.device)) if hadamard else scale
    out_s, out_d = (1, s_pad) if transpose else (d, 1)
    rows = 32 if d > 64 else 64
    if b * h and n_blocks:
        _quant_blocks_kernel[(n_blocks, b * h)](
            x, mean, had, out, scale, h, s, s_pad, n_blocks, block, *x.stride(), d * s_pad, out_s, out_d,
            1.0 / math.sqrt(d), D=d, ROWS=rows, SMOOTH=smooth, HADAMARD=hadamard,
            EXACT_CAST=interpreting() if exact_cast is None else exact_cast, num_warps=4,
        )
    return out, scale


def prepare_qkv_blocks(q, k, v, *, q_block: int, kv_block: int, hadamard: bool, smooth_k: bool,
                       exact_cast: bool | None = None):
    """quant.prepare_qkv(granularity="block") in three fused kernels, in the attention kernel's layouts:
    (qq (B,H,Sq_pad,D), sq, kq (B,H,Sk_pad,D), sk, vt (B,H,D,Sk_pad), sv)."""
    qq, sq = quantize_blocks(q, q_block, hadamard=hadamard, exact_cast=exact_cast)
    kq, sk = quantize_blocks(k, kv_block, smooth=smooth_k, hadamard=hadamard, exact_cast=exact_cast)
    vt, sv = quantize_blocks(v, kv_block, transpose=True, exact_cast=exact_cast)
    return qq, sq, kq, sk, vt, sv
