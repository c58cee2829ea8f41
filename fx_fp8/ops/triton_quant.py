"""Fused Triton kernels of the CUDA lowering: the attention pre-pass and the INT8 GEMM epilogue.

Attention pre-pass (`prepare_qkv`): the device half of `quant.prepare_qkv`
(smooth K, Hadamard rotation of Q and K, FP8 e4m3 quantization with one scale
per block of rows, per head or per tensor), writing the layouts the kernels
read: Q and K as (B, H, S_out, D), V either so or transposed to (B, H, D, S_out)
(FP8 `tl.dot` on Hopper wants its second operand K-major). S_out is S padded
to a multiple of SEQ_PAD for the Triton attention kernel (padding rows are
zero), or S itself for cuDNN.

Memory traffic:
* block scales: one program per block of rows reads it from memory once.
  Blocks that fit in registers without spilling (measured with ptxas for
  sm_90a at 8 warps, Triton 3.6 and 3.9: 128 x 128 values cast as they are,
  64 x 128 rotated by the Hadamard dots) are loaded, reduced to their amax,
  scaled, cast and stored in one pass. Larger ones (the default 128-row Q
  and 256-row K blocks at head dim 128, rotated; 256-row V blocks) are walked
  twice, the second walk re-reading what the same program has just read, from
  L2: HBM traffic stays one read of each block. Each step of the walk is 64
  rows at head dim 128, 8 warps (`WIDE_STEPS`: the largest rotated tile one
  pass holds; 128 plain rows spill in the two-pass loop); it was 32 rows at 4
  warps, twice the steps and Hadamard dots of 32 rows, which the benchmark still
  times (`wide_steps=False`).
* per-head / per-tensor scales need the whole head's amax before the first
  cast: an amax-only pass, a tiny torch reduction, then the cast pass.
* the K mean of smooth_k is one torch reduction `mean(dtype=float32)`, which
  reads bf16/fp16 K and accumulates in fp32 without materialising an fp32
  copy of K (CUDA reductions cast on load).
* with an LSE and smooth_k, the Q pass also writes q . mean(K) per row (what
  the smoothing took from the scores, added back to the LSE as the reference
  does): Q is read once either way.

Numerics match `fx_fp8.ops.quant` up to fp32 summation order: the scale is
`amax / 448` and the quotient `x / scale` are correctly rounded (`div_rn`),
the cast is round-to-nearest-even after clamping to +-448. The Hadamard
product runs on tensor cores as two fp16 dots (each row scaled by a power of
two, split into an fp16 high part and an fp16 remainder, H with exact +-1
entries, fp32 accumulation), accurate to ~2^-22 of the row's largest value,
far below the e4m3 step of 2^-4. (fp16, not bf16: the interpreter's bf16 dot
is broken in Triton 3.9, and fp16 halves are more precise anyway.)

Triton's CPU interpreter (TRITON_INTERPRET=1, Triton 3.9) rounds fp32 -> fp8
casts wrongly (no carry into the exponent, ties not to even) and truncates
fp32 -> bf16 casts, so under the interpreter the kernels round to the e4m3 /
bf16 grid in fp32 first (EXACT_CAST), which makes the cast itself exact; on
GPUs the native round-to-nearest-even conversions are used.

INT8 epilogue (`int8_rescale`): the int32 product of torch._int_mm times the
activation scale (per row or scalar) times the weight scale (per column or
scalar), plus bias, in one pass: fp32 math, one rounding to the output dtype.
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
#: largest block (rows x head dim) a program holds in registers at 8 warps without spilling, measured with
#: `ptxas -v` for sm_90a (tests/ops/test_cuda_kernel_spills.py): 128 x 128 values cast as they are (256 x 128
#: spills 28-812 bytes at 8 or 16 warps even for a plain cast); rotated (Hadamard dots in registers), 64 x 128:
#: a rotated 128 x 128 block fits Triton 3.9's 254 registers but spills 12-340 bytes on Triton 3.6 (torch 2.11's)
ONE_PASS_ELEMS = 128 * 128
ONE_PASS_ROTATED_ELEMS = 64 * 128
#: a two-pass block's steps: ONE_PASS_ROTATED_ELEMS values at 8 warps (the largest rotated tile one pass holds;
#: 128 x 128 plain values spill 72-252 bytes in the two-pass loop, Triton 3.9; a rotated Q with the LSE term's
#: row dots spills 4 bytes at 64 rows on Triton 3.6 and keeps 32-row steps), instead of 4096 values at 4
#: warps (twice the steps, the Hadamard dots at 32 rows). The same values: the step only
#: groups rows (bit for bit in the interpreter, tests/ops/test_triton_interpret.py); no spills on sm_90a
#: (tests/ops/test_cuda_kernel_spills.py). Not yet timed on a GPU: benchmarks/attention_kernels.py times
#: both (triton_prepass, triton_prepass_narrow).
WIDE_STEPS = True
#: rows a program handles in the amax-only / cast-only passes of per-head and per-tensor scales
CHUNK_ROWS = 128

MODE_BLOCK, MODE_AMAX, MODE_CAST = 0, 1, 2


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
def round_bf16(x):
    """Round fp32 to the nearest-even bf16 value, in fp32 bits (the interpreter's bf16 cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(y, EXACT_CAST: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if EXACT_CAST:
        y = round_e4m3(y)
    return y.to(tl.float8e4nv)


# -- attention Q/K/V quantization -------------------------------------------------
@triton.jit
def _load_rows(x_base, rows, row_ok, offs_d, stride_s, stride_d):
    x = tl.load(x_base + rows[:, None] * stride_s + offs_d[None, :] * stride_d, mask=row_ok[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _transform(x, row_ok, mean, hm, inv_sqrt_d, SMOOTH: tl.constexpr, HADAMARD: tl.constexpr):
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
def _load_transformed(
    x_base,
    rows,
    row_ok,
    offs_d,
    stride_s,
    stride_d,
    mean,
    hm,
    inv_sqrt_d,
    dot_vec,
    dot_ptr,
    S,
    SMOOTH: tl.constexpr,
    HADAMARD: tl.constexpr,
    DOT: tl.constexpr,
):
    """Rows of x, smoothed / rotated; with DOT, also stores x_row . dot_vec (on the raw rows) to dot_ptr."""
    if SMOOTH or HADAMARD or DOT:
        x = _load_rows(x_base, rows, row_ok, offs_d, stride_s, stride_d)
        if DOT:
            tl.store(dot_ptr + rows, tl.sum(x * dot_vec[None, :], 1), mask=row_ok & (rows < S))
        x = _transform(x, row_ok, mean, hm, inv_sqrt_d, SMOOTH, HADAMARD)
    else:  # a plain cast: keep the input dtype (half the registers of fp32 for bf16 / fp16 inputs)
        x = tl.load(x_base + rows[:, None] * stride_s + offs_d[None, :] * stride_d, mask=row_ok[:, None], other=0.0)
    return x


@triton.jit
def _store_e4m3(
    out_base,
    rows,
    store_ok,
    offs_d,
    S_OUT,
    x,
    scale,
    D: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    y = _to_e4m3(tl.math.div_rn(x.to(tl.float32), scale), EXACT_CAST)
    if TRANSPOSE:  # (D, S_OUT): rows contiguous
        tl.store(out_base + offs_d[:, None] * S_OUT + rows[None, :], tl.trans(y), mask=store_ok[None, :])
    else:  # (S_OUT, D)
        tl.store(out_base + rows[:, None] * D + offs_d[None, :], y, mask=store_ok[:, None])


@triton.jit
def _quant_kernel(
    x_ptr,
    mean_ptr,
    had_ptr,
    out_ptr,
    scale_ptr,
    amax_ptr,
    dvec_ptr,
    dot_ptr,
    H,
    S,
    S_OUT,
    n_blocks,
    block,
    stride_b,
    stride_h,
    stride_s,
    stride_d,
    inv_sqrt_d,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    MODE: tl.constexpr,
    ONE_PASS: tl.constexpr,
    SMOOTH: tl.constexpr,
    HADAMARD: tl.constexpr,
    DOT: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    """One program per (block of `block` rows, batch x head): _quant_program."""
    _quant_program(
        tl.program_id(0),
        tl.program_id(1).to(tl.int64),
        x_ptr,
        mean_ptr,
        had_ptr,
        out_ptr,
        scale_ptr,
        amax_ptr,
        dvec_ptr,
        dot_ptr,
        H,
        S,
        S_OUT,
        n_blocks,
        block,
        stride_b,
        stride_h,
        stride_s,
        stride_d,
        inv_sqrt_d,
        D,
        ROWS,
        MODE,
        ONE_PASS,
        SMOOTH,
        HADAMARD,
        DOT,
        TRANSPOSE,
        EXACT_CAST,
    )


@triton.jit
def _qkv_block_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mean_ptr,
    had_ptr,
    qo_ptr,
    ko_ptr,
    vo_ptr,
    sq_ptr,
    sk_ptr,
    sv_ptr,
    dvec_ptr,
    dot_ptr,
    H,
    SQ,
    SQ_OUT,
    SK,
    SK_OUT,
    nq,
    nk,
    q_block,
    kv_block,
    q_sb,
    q_sh,
    q_ss,
    q_sd,
    k_sb,
    k_sh,
    k_ss,
    k_sd,
    v_sb,
    v_sh,
    v_ss,
    v_sd,
    inv_sqrt_d,
    D: tl.constexpr,
    Q_ROWS: tl.constexpr,
    Q_ONE_PASS: tl.constexpr,
    K_ROWS: tl.constexpr,
    K_ONE_PASS: tl.constexpr,
    V_ROWS: tl.constexpr,
    V_ONE_PASS: tl.constexpr,
    SMOOTH_K: tl.constexpr,
    HADAMARD: tl.constexpr,
    DOT: tl.constexpr,
    TRANSPOSE_V: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    """Q, K and V with block scales in one launch: programs [0, nq) quantize Q's blocks, [nq, nq + nk)
    K's (smoothed, rotated), the rest V's (transposed or not); each exactly as _quant_kernel would."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    if blk < nq:
        _quant_program(
            blk,
            bh,
            q_ptr,
            mean_ptr,
            had_ptr,
            qo_ptr,
            sq_ptr,
            sq_ptr,
            dvec_ptr,
            dot_ptr,
            H,
            SQ,
            SQ_OUT,
            nq,
            q_block,
            q_sb,
            q_sh,
            q_ss,
            q_sd,
            inv_sqrt_d,
            D,
            Q_ROWS,
            0,
            Q_ONE_PASS,
            False,
            HADAMARD,
            DOT,
            False,
            EXACT_CAST,
        )
    elif blk < nq + nk:
        _quant_program(
            blk - nq,
            bh,
            k_ptr,
            mean_ptr,
            had_ptr,
            ko_ptr,
            sk_ptr,
            sk_ptr,
            dvec_ptr,
            dot_ptr,
            H,
            SK,
            SK_OUT,
            nk,
            kv_block,
            k_sb,
            k_sh,
            k_ss,
            k_sd,
            inv_sqrt_d,
            D,
            K_ROWS,
            0,
            K_ONE_PASS,
            SMOOTH_K,
            HADAMARD,
            False,
            False,
            EXACT_CAST,
        )
    else:
        _quant_program(
            blk - nq - nk,
            bh,
            v_ptr,
            mean_ptr,
            had_ptr,
            vo_ptr,
            sv_ptr,
            sv_ptr,
            dvec_ptr,
            dot_ptr,
            H,
            SK,
            SK_OUT,
            nk,
            kv_block,
            v_sb,
            v_sh,
            v_ss,
            v_sd,
            inv_sqrt_d,
            D,
            V_ROWS,
            0,
            V_ONE_PASS,
            False,
            False,
            False,
            TRANSPOSE_V,
            EXACT_CAST,
        )


@triton.jit
def _quant_program(
    blk,
    bh,
    x_ptr,
    mean_ptr,
    had_ptr,
    out_ptr,
    scale_ptr,
    amax_ptr,
    dvec_ptr,
    dot_ptr,
    H,
    S,
    S_OUT,
    n_blocks,
    block,
    stride_b,
    stride_h,
    stride_s,
    stride_d,
    inv_sqrt_d,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    MODE: tl.constexpr,
    ONE_PASS: tl.constexpr,
    SMOOTH: tl.constexpr,
    HADAMARD: tl.constexpr,
    DOT: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    """Block `blk` (of `block` rows) of batch x head `bh`.

    MODE_BLOCK: amax of the block, its scale, the cast (one read when ONE_PASS: ROWS >= block).
    MODE_AMAX:  the block's amax only, to amax_ptr (per-head / per-tensor scales).
    MODE_CAST:  the cast with the (batch, head)'s scale from scale_ptr.
    DOT (with MODE_BLOCK / MODE_CAST): also x_row . dvec[b, h] of every raw row, to dot_ptr (B, H, S)."""
    b = bh // H
    h = bh % H
    x_base = x_ptr + b * stride_b + h * stride_h
    out_base = out_ptr + bh * S_OUT * D
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, ROWS)
    row0 = blk * block
    mean = tl.zeros([D], dtype=tl.float32)
    if SMOOTH:
        mean = tl.load(mean_ptr + bh * D + offs_d)
    dot_vec = tl.zeros([D], dtype=tl.float32)
    if DOT:
        dot_vec = tl.load(dvec_ptr + bh * D + offs_d)
    dot_base = dot_ptr + bh * S
    hm = tl.zeros([D, D], dtype=tl.float16)
    if HADAMARD:
        hm = tl.load(had_ptr + offs_d[:, None] * D + offs_d[None, :])
    if ONE_PASS:
        rows = row0 + offs_r
        in_block = offs_r < block
        x = _load_transformed(
            x_base,
            rows,
            in_block & (rows < S),
            offs_d,
            stride_s,
            stride_d,
            mean,
            hm,
            inv_sqrt_d,
            dot_vec,
            dot_base,
            S,
            SMOOTH,
            HADAMARD,
            DOT and MODE != 1,
        )
        if MODE == 2:
            scale = tl.load(scale_ptr + bh)
        else:
            amax = tl.max(tl.max(tl.abs(x), 1), 0).to(tl.float32)
            if MODE == 1:
                tl.store(amax_ptr + bh * n_blocks + blk, amax)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
            if MODE == 0:
                tl.store(scale_ptr + bh * n_blocks + blk, scale)
        if MODE != 1:  # padding rows (S <= row < S_OUT) get zeros
            _store_e4m3(out_base, rows, in_block & (rows < S_OUT), offs_d, S_OUT, x, scale, D, TRANSPOSE, EXACT_CAST)
    else:
        if MODE == 2:
            scale = tl.load(scale_ptr + bh)
        else:
            amax_r = tl.zeros([ROWS], dtype=tl.float32)
            for r0 in range(0, block, ROWS):
                rows = row0 + r0 + offs_r
                ok = (r0 + offs_r < block) & (rows < S)
                x = _load_transformed(
                    x_base,
                    rows,
                    ok,
                    offs_d,
                    stride_s,
                    stride_d,
                    mean,
                    hm,
                    inv_sqrt_d,
                    dot_vec,
                    dot_base,
                    S,
                    SMOOTH,
                    HADAMARD,
                    False,
                )
                amax_r = tl.maximum(amax_r, tl.max(tl.abs(x), 1).to(tl.float32))
            amax = tl.max(amax_r, 0)
            if MODE == 1:
                tl.store(amax_ptr + bh * n_blocks + blk, amax)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
            if MODE == 0:
                tl.store(scale_ptr + bh * n_blocks + blk, scale)
        if MODE != 1:
            for r0 in range(0, block, ROWS):  # a block too large for registers: the second read comes from L2
                rows = row0 + r0 + offs_r
                ok = (r0 + offs_r < block) & (rows < S)
                x = _load_transformed(
                    x_base,
                    rows,
                    ok,
                    offs_d,
                    stride_s,
                    stride_d,
                    mean,
                    hm,
                    inv_sqrt_d,
                    dot_vec,
                    dot_base,
                    S,
                    SMOOTH,
                    HADAMARD,
                    DOT,
                )
                _store_e4m3(
                    out_base,
                    rows,
                    (r0 + offs_r < block) & (rows < S_OUT),
                    offs_d,
                    S_OUT,
                    x,
                    scale,
                    D,
                    TRANSPOSE,
                    EXACT_CAST,
                )


@functools.lru_cache(maxsize=None)
def _hadamard_pm1(n: int, device: str) -> torch.Tensor:
    """The reference's Sylvester Hadamard matrix with +-1 entries (exact in fp16)."""
    return torch.sign(quant._hadamard_cpu(n)).to(device=device, dtype=torch.float16).contiguous()


def _launch_config(
    block: int, d: int, rotated: bool, wide: bool | None = None, dot: bool = False
) -> tuple[int, bool, int]:
    """(ROWS, ONE_PASS, num_warps) for blocks of `block` rows at head dim d, rotated (Hadamard) or not,
    with the LSE term's row dot products (`dot`) or not; a two-pass block's steps are wide (WIDE_STEPS)
    or 4096 values (always with a rotation and the row dots: wide, they spill 4 bytes on Triton 3.6)."""
    rows = triton.next_power_of_2(block)
    limit = ONE_PASS_ROTATED_ELEMS if rotated else ONE_PASS_ELEMS
    if rows * d <= limit:  # the whole block in registers
        return rows, True, 8 if rows * d >= 8192 else 4
    if (WIDE_STEPS if wide is None else wide) and not (rotated and dot):  # 64 rows at d=128 a step
        return ONE_PASS_ROTATED_ELEMS // d, False, 8
    return max(1, 4096 // d), False, 4  # 32 rows at d=128


def token_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of (B, H, S, D), fp32 (B, H, D) contiguous: K's smoothing vector. On CUDA it
    reads x in its own dtype and accumulates in fp32 (no fp32 copy of K); elsewhere it is the
    reference's op (the mean of the fp32 values), bit for bit."""
    if x.device.type == "cuda":
        return torch.mean(x, dim=2, dtype=torch.float32).contiguous()
    return x.float().mean(dim=2).contiguous()


def quantize_heads(
    x: torch.Tensor,
    *,
    granularity: str,
    block: int,
    mean: torch.Tensor | None = None,
    hadamard: bool = False,
    transpose: bool = False,
    pad: bool = True,
    row_dot: torch.Tensor | None = None,
    exact_cast: bool | None = None,
    wide_steps: bool | None = None,
):
    """Quantize (B, H, S, D) as quant.quantize_rows_in_blocks(granularity, block) does on the input
    minus `mean` ((B, H, D) fp32, smoothing), rotated when `hadamard`. Returns (fp8 (B, H, S_out, D),
    or (B, H, D, S_out) if transpose; fp32 scales: block (B, H, ceil(S / block)), head (B, H, 1),
    tensor (1, 1, 1); and with row_dot ((B, H, D) fp32) the fp32 (B, H, S) dot products of the
    raw rows with it, else None). S_out = padded_len(S) when pad, else S. wide_steps: the two-pass
    step (default WIDE_STEPS)."""
    b, h, s, d = x.shape
    if granularity not in ("tensor", "head", "block"):
        raise ValueError(f"quantize_heads: unknown granularity {granularity!r}")
    _check_shape(d, block)
    s_out = padded_len(s) if pad else s
    shape = (b, h, d, s_out) if transpose else (b, h, s_out, d)
    dev = x.device
    had = _hadamard_pm1(d, str(dev)) if hadamard else None
    dots = torch.empty((b, h, s), dtype=torch.float32, device=dev) if row_dot is not None else None
    exact = interpreting() if exact_cast is None else exact_cast

    def launch(mode, blk_rows, n_blocks, out, scale, amax):
        rows, one_pass, warps = _launch_config(blk_rows, d, hadamard, wide_steps, row_dot is not None)
        some = next(t for t in (scale, amax) if t is not None)  # dummy pointer for unused arguments
        _quant_kernel[(n_blocks, b * h)](
            x,
            mean if mean is not None else some,
            had if had is not None else some,
            out if out is not None else some,
            scale if scale is not None else some,
            amax if amax is not None else some,
            row_dot if row_dot is not None else some,
            dots if dots is not None else some,
            h,
            s,
            s_out,
            n_blocks,
            blk_rows,
            *x.stride(),
            1.0 / math.sqrt(d),
            D=d,
            ROWS=rows,
            MODE=mode,
            ONE_PASS=one_pass,
            SMOOTH=mean is not None,
            HADAMARD=hadamard,
            DOT=row_dot is not None,
            TRANSPOSE=transpose,
            EXACT_CAST=exact,
            num_warps=warps,
        )

    if granularity == "block":
        out, scale, _, n_blocks = _block_outputs(x, block, pad, transpose)
        if b * h and n_blocks:
            launch(MODE_BLOCK, block, n_blocks, out, scale, None)
        return out, scale, dots
    n_chunks = max(1, -(-s_out // CHUNK_ROWS))
    amax = torch.zeros((b * h, n_chunks), dtype=torch.float32, device=dev)
    if b * h and s:
        launch(MODE_AMAX, CHUNK_ROWS, n_chunks, None, None, amax)
    if granularity == "head":
        scale = quant.scale_from_amax(amax.amax(dim=1)).reshape(b, h, 1)
    else:
        scale = quant.scale_from_amax(amax.amax()).reshape(1, 1, 1)
    out = torch.empty(shape, dtype=quant.FP8_DTYPE, device=dev)
    if b * h:
        launch(MODE_CAST, CHUNK_ROWS, n_chunks, out, scale.expand(b, h, 1).reshape(b * h).contiguous(), None)
    return out, scale, dots


#: prepare_qkv's default for block scales: Q, K and V in one launch (_qkv_block_kernel) or three. Off until a
#: GPU measures it faster: bit for bit the same output, two launches fewer, but the one kernel runs every block
#: at 8 warps and the largest branch's registers (up to 254: one program per SM; V alone takes 157 at 4 warps).
#: benchmarks/attention_kernels.py times both (triton_prepass, triton_prepass_one_launch).
ONE_LAUNCH = False
#: warps of the one-launch kernel: the three branches live in one kernel, and at 4 warps ptxas spills 4-936
#: bytes (D 64 / 128, Triton 3.6 and 3.9); at 8 none (tests/ops/test_cuda_kernel_spills.py)
QKV_WARPS = 8


def prepare_qkv(
    q,
    k,
    v,
    *,
    granularity: str,
    q_block: int,
    kv_block: int,
    hadamard: bool,
    smooth_k: bool,
    pad: bool = True,
    transpose_v: bool = True,
    lse_shift: bool = False,
    exact_cast: bool | None = None,
    one_launch: bool | None = None,
    wide_steps: bool | None = None,
):
    """quant.prepare_qkv on the GPU, in the kernels' layouts: (qq (B,H,Sq_out,D), sq, kq (B,H,Sk_out,D), sk,
    v (B,H,D,Sk_out) if transpose_v else (B,H,Sk_out,D), sv, shift); scales as quant.quantize_rows_in_blocks.
    shift: with lse_shift and smooth_k, q . mean(K) per query row, fp32 (B, H, Sq) (what the smoothing
    removed from the scores, before softmax_scale: quant.smoothing_lse_shift / softmax_scale), else None.
    one_launch (block scales, Q / K / V of one batch and head count): _qkv_block_kernel instead of three
    launches (default ONE_LAUNCH). wide_steps: the two-pass blocks' step of the three launches (default
    WIDE_STEPS; the one launch always takes 32-row steps)."""
    one_launch = ONE_LAUNCH if one_launch is None else one_launch
    if one_launch and wide_steps:
        raise ValueError(
            "prepare_qkv: one_launch walks its two-pass blocks in 32-row steps (wide steps spill "
            "128-136 bytes in the one kernel); wide_steps=True needs one_launch=False"
        )
    k_mean = token_mean(k) if smooth_k else None
    if one_launch and granularity == "block" and q.shape[:2] == k.shape[:2] and k.shape == v.shape:
        return _prepare_blocks_in_one_launch(
            q,
            k,
            v,
            k_mean,
            q_block=q_block,
            kv_block=kv_block,
            hadamard=hadamard,
            pad=pad,
            transpose_v=transpose_v,
            lse_shift=lse_shift and smooth_k,
            exact_cast=exact_cast,
        )
    kw = dict(granularity=granularity, pad=pad, exact_cast=exact_cast, wide_steps=wide_steps)
    qq, sq, shift = quantize_heads(
        q, block=q_block, hadamard=hadamard, row_dot=k_mean if lse_shift and smooth_k else None, **kw
    )
    kq, sk, _ = quantize_heads(k, block=kv_block, mean=k_mean, hadamard=hadamard, **kw)
    vq, sv, _ = quantize_heads(v, block=kv_block, transpose=transpose_v, **kw)
    return qq, sq, kq, sk, vq, sv, shift


def _check_shape(d: int, block: int) -> None:
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"quantize_heads: head dim {d} not supported (need a power of two in 16..256)")
    if block < 1:
        raise ValueError(f"quantize_heads: block must be positive, got {block}")


def _block_outputs(x: torch.Tensor, block: int, pad: bool, transpose: bool):
    """(fp8 output, fp32 block scales, S_out, number of blocks) as quantize_heads allocates them."""
    b, h, s, d = x.shape
    s_out = padded_len(s) if pad else s
    n_blocks = -(-s // block)
    make = torch.empty if n_blocks * block >= s_out else torch.zeros  # rows past the last block: zeros
    out = make((b, h, d, s_out) if transpose else (b, h, s_out, d), dtype=quant.FP8_DTYPE, device=x.device)
    return out, torch.empty((b, h, n_blocks), dtype=torch.float32, device=x.device), s_out, n_blocks


def _prepare_blocks_in_one_launch(
    q,
    k,
    v,
    k_mean,
    *,
    q_block: int,
    kv_block: int,
    hadamard: bool,
    pad: bool,
    transpose_v: bool,
    lse_shift: bool,
    exact_cast,
):
    """prepare_qkv with block scales: Q, K and V quantized by one launch of _qkv_block_kernel (the
    programs of the three tensors side by side in one grid), after K's token mean."""
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    _check_shape(d, q_block)
    _check_shape(d, kv_block)
    qq, sq, sq_out, nq = _block_outputs(q, q_block, pad, False)
    kq, sk, sk_out, nk = _block_outputs(k, kv_block, pad, False)
    vq, sv, _, _ = _block_outputs(v, kv_block, pad, transpose_v)
    dots = torch.empty((b, h, s_q), dtype=torch.float32, device=q.device) if lse_shift else None
    if b * h and (nq or nk):
        # 32-row steps: with wide ones the three branches in one kernel spill (128-136 bytes, sm_90a, D 128)
        q_rows, q_one, _ = _launch_config(q_block, d, hadamard, False)
        k_rows, k_one, _ = _launch_config(kv_block, d, hadamard, False)
        v_rows, v_one, _ = _launch_config(kv_block, d, False, False)
        had = _hadamard_pm1(d, str(q.device)) if hadamard else sq
        _qkv_block_kernel[(nq + 2 * nk, b * h)](
            q,
            k,
            v,
            k_mean if k_mean is not None else sq,
            had,
            qq,
            kq,
            vq,
            sq,
            sk,
            sv,
            k_mean if lse_shift else sq,
            dots if dots is not None else sq,
            h,
            s_q,
            sq_out,
            s_k,
            sk_out,
            nq,
            nk,
            q_block,
            kv_block,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            1.0 / math.sqrt(d),
            D=d,
            Q_ROWS=q_rows,
            Q_ONE_PASS=q_one,
            K_ROWS=k_rows,
            K_ONE_PASS=k_one,
            V_ROWS=v_rows,
            V_ONE_PASS=v_one,
            SMOOTH_K=k_mean is not None,
            HADAMARD=hadamard,
            DOT=lse_shift,
            TRANSPOSE_V=transpose_v,
            EXACT_CAST=interpreting() if exact_cast is None else exact_cast,
            num_warps=QKV_WARPS,
        )
    return qq, sq, kq, sk, vq, sv, dots


# -- INT8 GEMM epilogue -------------------------------------------------------------
@triton.jit
def _int8_rescale_kernel(
    acc_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_am,
    stride_om,
    XS_ROWS: tl.constexpr,
    WS_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    mn = rn < N
    acc = tl.load(acc_ptr + rm[:, None] * stride_am + rn[None, :], mask=mm[:, None] & mn[None, :], other=0)
    if XS_ROWS:
        xs = tl.load(xs_ptr + rm, mask=mm, other=0.0)[:, None]
    else:
        xs = tl.load(xs_ptr)
    if WS_COLS:
        ws = tl.load(ws_ptr + rn, mask=mn, other=0.0)[None, :]
    else:
        ws = tl.load(ws_ptr)
    y = (acc.to(tl.float32) * xs) * ws  # the reference's order: (acc * x_scale) * w_scale
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        y = round_bf16(y)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :]
    )


def int8_rescale(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias, out_dtype, exact_cast: bool | None = None
) -> torch.Tensor:
    """(acc int32 [M, N] * x_scale ([M, 1] or []) * w_scale ([N, 1] or [])) + bias -> out_dtype, one pass."""
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if m == 0 or n == 0:
        return out
    xs = x_scale.float().reshape(-1).contiguous()
    ws = w_scale.float().reshape(-1).contiguous()
    grid = (triton.cdiv(m, 64), triton.cdiv(n, 128))
    _int8_rescale_kernel[grid](
        acc,
        xs,
        ws,
        bias if bias is not None else xs,
        out,
        m,
        n,
        acc.stride(0),
        out.stride(0),
        XS_ROWS=xs.numel() > 1,
        WS_COLS=ws.numel() > 1,
        HAS_BIAS=bias is not None,
        ROUND_BF16=(interpreting() if exact_cast is None else exact_cast) and out_dtype == torch.bfloat16,
        BLOCK_M=64,
        BLOCK_N=128,
        num_warps=4,
    )
    return out
