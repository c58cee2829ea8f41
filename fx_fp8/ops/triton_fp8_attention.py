"""FP8 flash-attention forward in Triton (written for sm90 / Hopper; runs on sm89 too).

Inputs are what `triton_quant.prepare_qkv` writes: Q and K as (B, H, S_pad, D)
e4m3, V transposed to (B, H, D, S_pad) e4m3 (Hopper's FP8 wgmma wants the
second operand K-major), fp32 scales (B, H, n) per block of `q_block` /
`kv_block` rows (n = 1 for per-head or per-tensor scales).

Per (query tile, key tile), with BLOCK_N dividing kv_block so that the tile's
keys share one K scale sk and one V scale sv (scalars, no per-column gather):
  S   = Qq @ Kq^T                                   FP8 dot (a fresh accumulator over the head dim)
  c   = sq[row] * softmax_scale * log2(e) * sk      the tile's score scale, > 0
  m   = max(m, c * rowmax(S))                       online softmax in fp32, base 2
  P'  = exp2(S * c - (m - log2(p_scale)))           = P * p_scale, P in [0, 1] against the running max:
                                                    one FMA an element, no separate scale multiplies
  l   = l * alpha + rowsum(P')                      from the unquantized P', as the reference
  acc = acc * alpha * (sv_prev / sv) + e4m3(P') @ Vq
The tile's P @ V runs as dots of at most PV_KEYS (64) keys, each from a fresh
accumulator, added to acc in fp32 on the CUDA cores (two-level accumulation;
a 128-key tile splits its P in registers). Hopper's FP8 tensor cores accumulate
with about 14 bits (DeepSeek-V3's report; SageAttention2 promotes its FP8 P @ V
the same way), so `acc = tl.dot(Pq, Vq, acc)` across every key tile loses a
little at each tile: on an H200 that in-place form gave 3.2 % error at 4608
keys and 11.5 % at 16384, growing with length, against 0.36 / 0.28 % for the
reference; under the emulation of tests/ops/test_attention_accumulation.py, dots of
128 keys still cost 1.3-1.4x the reference's error at 16k-32k keys, 64 keys
1.15-1.26x. Triton's `max_num_imprecise_acc` would promote inside the dot
instead, but its lowering reads the wgmma accumulator before the wait, and
ptxas then serializes every wgmma of the kernel (warning C7514). The
accumulator is kept in units of the current tile's V scale: when a tile with
another sv starts, the rescale also carries sv_prev / sv. At the end
O = acc * sv_last / l.
tests/ops/test_attention_accumulation.py pins this structure (the compiled PV dot
starts from zero and is not folded back into an in-place dot; no ptxas
serialization) and shows, with the tensor cores' accumulation emulated in the
interpreter, the in-place form's error growing with length and this one's not.

Difference from `quant.attention_from_fp8` (the reference): the reference
quantizes P = exp(S - final row max); this kernel quantizes P against the
running row max of the tiles seen so far and rescales the fp32 accumulator
when the max grows, as every online-softmax kernel must. Both put the row's
largest probability at p_scale, so the relative rounding is the same; values
computed against a smaller running max sit higher in the e4m3 range, so fewer
of them flush to zero. Exponentials use exp2 (softmax_scale * log2(e) folded
into the score scale). A query row whose keys are all masked gives O = 0 and
LSE = -inf, as the reference.

LSE (RETURN_LSE): the natural-log log-sum-exp of the scaled scores,
(m + log2(l) - log2(p_scale)) * ln(2), fp32 (B, H, S_q).

Masks: an additive fp32 bias per key (B, Hm, S_pad), Hm in {1, H}, already in
log2 units, -inf on padding keys (a key-padding mask); other masks are
rejected by the lowering.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fx_fp8.ops.triton_quant import SEQ_PAD, interpreting, padded_len, round_bf16, round_e4m3

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: pointer loads only
    TensorDescriptor = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)  # read inside the kernel

# -- autotune configs -------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N must divide kv_block. None of them may spill.
#
# Register math (sm90: at most 255 32-bit registers a thread, 64K a block). With T = 32 * num_warps
# threads, a thread of the loop holds
#   acc     BLOCK_M * D / T            fp32 output accumulator
#   S, P    BLOCK_M * BLOCK_N / T      fp32 scores, exponentiated in place
#   Pq      BLOCK_M * BLOCK_N / (4 T)  e4m3 probabilities, 4 a register (the A operand of P @ V)
#   ~80     row max / sum / scale vectors, exp2 and conversion temporaries, loop state
# so (128, 128, 8 warps) at D = 128 needs 64 + 64 + 16 + ~80 = ~224, inside the budget, while a
# 4-warp config with BLOCK_M = 128 holds a 128-register accumulator: (128, 128, 4 warps) needs
# 128 + 128 + 32 + ~80 and spills; (128, 64, 4 warps) needs 128 + 64 + 16 + ~80 = ~288 and sits at 255.
# Loading K and V through pointer tensors adds a 64-bit address (2 registers) for every 16-byte
# vector a thread loads, for each of the num_stages - 1 tiles in flight: 2 * BLOCK_N * D / (16 T)
# vectors, i.e. 8 vectors -> 32 registers (plus the arithmetic that computes them) for
# (128, 128, 8 warps, 3 stages) at D = 128, which pushes it past 255: it spilled (1012 bytes of
# spill stores). Hopper's TMA (host tensor descriptors) loads a tile from one descriptor and two
# coordinates, so the TMA path only pays the data terms above.
# Two-level P @ V adds a fresh BLOCK_M * min(BLOCK_N, PV_KEYS) / T accumulator (64 registers at
# (128, *, 8 warps), D = 128) while acc is live; (128, 128) tiles also split P in two 64-key dots.
# Measured (`ptxas -v` on sm_90a / sm_89, FP8 P, each of: no flags, LSE, key bias, key bias + LSE),
# PV_KEYS = 64, Triton 3.6 (the GPU's, torch 2.11) and 3.9 (this project's CI):
#   TMA, D=128: (128,64,8,3|4) 237-247 regs, 0 spill; (64,64,4,3|4) 167-245, 0 (both Tritons);
#               (128,128,8,2|3|4) 253-255 regs, 0 spill under 3.6 but 12-92 B under 3.9 in one flag
#               combination each: left out (benchmarks/attention_kernels.py times (128,128,8,3) as
#               triton_pv64 / triton_pv128, to show what it would gain).
#   TMA, D=64:  (128,128,8,2|3), (128,64,8,3|4), (64,64,4,3|4) 127-254 regs, 0 spill.
#   pointers, sm_89: D=128 (128,32,8,3) 242-255, 0; D=64 (128,64,8,3), (128,32,8,3), (64,64,4,3) 0.
#   (Before two-level accumulation, Triton 3.9: TMA D=128 (128,128,8,2|3|4) 219-255 regs, 0 spill;
#   pointers on sm_90a spilled 0-1012 B: that path serves sm89, or a Triton without TMA descriptors.)
# The lists keep only configs with 0 spill stores under both Tritons and every flag combination;
# tests/ops/test_cuda_kernel_spills.py recompiles them (TMA for sm_90a, pointers for sm_89) with the
# installed Triton and checks that they still do not spill and that ptxas does not serialize wgmmas.
TMA_CONFIGS = {
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
    64: [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)],
}
POINTER_CONFIGS = {  # sm89 (no TMA), or a Triton without host tensor descriptors
    128: [(128, 32, 8, 3)],
    64: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
}
#: Candidate tiles a GPU run measures against the autotuned default above; never used unless named
#: (`fp8_flash_attention(tile=...)`, benchmarks/attention_kernels.py): name -> ({head dim: TMA configs},
#: P @ V keys a dot). "m64n128": 64 query rows x 128 keys, one warpgroup, one 128-key P @ V dot a tile
#: (SageAttention2's sm90 shape): ~0.29 instructions a score element against ~0.41 for (64, 64, 4) in
#: the SASS of Triton 3.6. ptxas -v, sm_90a (2026-12-07, CPU), in each of no flags, LSE, key bias, both:
#: Triton 3.9 D=128 (64,128,4,2|3|4) 218-245 registers, D=64 (64,128,4,3) 156-245; Triton 3.6 (the GPU
#: machine's) 226-240 and 137-185; 0 spill stores, no wgmma serialization.
#: tests/ops/test_cuda_kernel_spills.py recompiles it; its numerics run in the interpreter.
TILE_CANDIDATES = {
    "m64n128": ({128: [(64, 128, 4, 3), (64, 128, 4, 2)], 64: [(64, 128, 4, 3)]}, 128),
}
#: the most keys one P @ V dot sums in the tensor cores' limited-precision accumulator before the
#: result joins the fp32 accumulator (see the module docstring)
PV_KEYS = 64
#: every (BLOCK_M, BLOCK_N, num_warps, num_stages) either autotuner may pick
CONFIGS = sorted({c for table in (TMA_CONFIGS, POINTER_CONFIGS) for cs in table.values() for c in cs}, reverse=True)


@triton.jit
def _load_v(VT, vrow0, start_n, S_PAD, offs_d, KEYS: tl.constexpr, QUANT_P: tl.constexpr, USE_TMA: tl.constexpr):
    """V rows start_n .. start_n + KEYS as the (KEYS, D) B operand of P @ V (V^T is stored keys-contiguous)."""
    if USE_TMA:  # V^T viewed as (B*H*D, S_pad); the descriptor's tile is (D, KEYS)
        v = VT.load([vrow0, start_n]).T
    else:
        cols = start_n + tl.arange(0, KEYS)
        v = tl.load(VT + vrow0 * S_PAD + cols[:, None] + offs_d[None, :] * S_PAD)
    if not QUANT_P:
        v = v.to(tl.float16)
    return v


@triton.jit
def _pv(
    acc,
    p,
    VT,
    vrow0,
    start_n,
    S_PAD,
    offs_d,
    KEYS: tl.constexpr,
    QUANT_P: tl.constexpr,
    USE_TMA: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
):
    """acc + p @ V[start_n : start_n + KEYS]: a fresh dot added in fp32 (TWO_LEVEL), or accumulated in place."""
    v = _load_v(VT, vrow0, start_n, S_PAD, offs_d, KEYS, QUANT_P, USE_TMA)
    if TWO_LEVEL:
        return acc + tl.dot(p, v)
    return tl.dot(p, v, acc)


@triton.jit
def _column_halves(x, N: tl.constexpr):
    """(x[:, :N/2], x[:, N/2:]) of an (M, N) tile (a register split, no data movement on Hopper)."""
    return tl.split(tl.permute(tl.reshape(x, [x.shape[0], 2, N // 2]), [0, 2, 1]))


@triton.jit
def _attn_tiles(
    acc,
    l_i,
    m_i,
    sv_cur,
    q,
    row_scale,
    K,
    VT,
    krow0,
    vrow0,
    sk_ptr,
    sv_ptr,
    bias_ptr,
    offs_n,
    offs_d,
    lo,
    hi,
    S_K,
    S_PAD,
    n_k,
    kv_block,
    log2_p,
    BLOCK_N: tl.constexpr,
    CHECK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT_P: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    D: tl.constexpr,
    USE_TMA: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    PV_KEYS: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # BLOCK_N divides kv_block: one K and one V scale a tile (Triton's pipeliner prefetches them)
        blk = tl.minimum(start_n // kv_block, n_k - 1)
        sk = tl.load(sk_ptr + blk)
        sv = tl.load(sv_ptr + blk)
        if USE_TMA:  # K viewed as (B*H*S_pad, D), V^T as (B*H*D, S_pad): TMA tiles, no per-element addresses
            k = K.load([krow0 + start_n, 0]).T  # (D, BLOCK_N), D contiguous
        else:
            k = tl.load(K + (krow0 + cols)[None, :] * D + offs_d[:, None])
        s = tl.dot(q, k)  # integer-valued products of e4m3 codes, fp32
        c = row_scale * sk  # the tile's score scale (log2 units), > 0
        if HAS_BIAS:
            s = s * c[:, None] + tl.load(bias_ptr + cols)[None, :]
            if CHECK:
                s = tl.where(cols[None, :] < S_K, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # rows whose keys so far are all masked: zeros instead of NaN (-inf - -inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - (m_use - log2_p)[:, None])
        else:
            if CHECK:
                s = tl.where(cols[None, :] < S_K, s, float("-inf"))
            # c > 0: the max of the scaled scores is the scaled max; the scale then folds into the
            # exponent's argument (one FMA an element) and p_scale into its offset (2^log2_p = p_scale)
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            m_use = m_new
            p = tl.math.exp2(s * c[:, None] - (m_use - log2_p)[:, None])  # P * p_scale, in [0, p_scale]
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT_P:
            if EXACT_CAST:
                p = round_e4m3(p)
            pq = p.to(tl.float8e4nv)
        else:
            pq = p.to(tl.float16)
        # acc is kept in units of this tile's V scale: the online-softmax rescale also carries sv_prev / sv
        acc = acc * (alpha * (sv_cur / sv))[:, None]
        # P @ V in dots of at most PV_KEYS keys, each from a fresh accumulator whose result is added to acc
        # in fp32 on the CUDA cores (TWO_LEVEL): Hopper's FP8 tensor cores accumulate with ~14 bits, so a
        # product accumulated in place across every key tile loses more the more tiles there are (11.5 %
        # error at 16k keys on an H200). TWO_LEVEL=False accumulates in place: measurement only.
        if PV_KEYS >= BLOCK_N:
            acc = _pv(acc, pq, VT, vrow0, start_n, S_PAD, offs_d, BLOCK_N, QUANT_P, USE_TMA, TWO_LEVEL)
        else:
            tl.static_assert(PV_KEYS * 4 >= BLOCK_N, "a key tile splits into at most 4 P @ V dots")
            p0, p1 = _column_halves(pq, BLOCK_N)
            if PV_KEYS * 2 == BLOCK_N:
                acc = _pv(acc, p0, VT, vrow0, start_n, S_PAD, offs_d, PV_KEYS, QUANT_P, USE_TMA, TWO_LEVEL)
                acc = _pv(acc, p1, VT, vrow0, start_n + PV_KEYS, S_PAD, offs_d, PV_KEYS, QUANT_P, USE_TMA, TWO_LEVEL)
            else:  # four dots of BLOCK_N / 4 keys
                p00, p01 = _column_halves(p0, BLOCK_N // 2)
                p10, p11 = _column_halves(p1, BLOCK_N // 2)
                acc = _pv(acc, p00, VT, vrow0, start_n, S_PAD, offs_d, PV_KEYS, QUANT_P, USE_TMA, TWO_LEVEL)
                acc = _pv(acc, p01, VT, vrow0, start_n + PV_KEYS, S_PAD, offs_d, PV_KEYS, QUANT_P, USE_TMA, TWO_LEVEL)
                acc = _pv(
                    acc, p10, VT, vrow0, start_n + 2 * PV_KEYS, S_PAD, offs_d, PV_KEYS, QUANT_P, USE_TMA, TWO_LEVEL
                )
                acc = _pv(
                    acc, p11, VT, vrow0, start_n + 3 * PV_KEYS, S_PAD, offs_d, PV_KEYS, QUANT_P, USE_TMA, TWO_LEVEL
                )
        sv_cur = sv
        m_i = m_new
    return acc, l_i, m_i, sv_cur


@triton.jit
def _attn_fwd_kernel(
    Q,
    K,
    VT,
    SQ,
    SK,
    SV,
    BIAS,
    OUT,
    LSE,
    H,
    S_Q,
    S_K,
    SQ_PAD,
    SK_PAD,
    n_q,
    n_k,
    q_block,
    kv_block,
    bias_stride_b,
    bias_stride_h,
    o_stride_b,
    o_stride_h,
    o_stride_s,
    qk_scale,
    log2_p,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT_P: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_TMA: tl.constexpr,
    ROUND_BF16: tl.constexpr = False,
    TWO_LEVEL: tl.constexpr = True,
    PV_KEYS: tl.constexpr = 128,
    Q_TMA: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if Q_TMA:  # Q viewed as (B*H*Sq_pad, D): one TMA load of the tile (a candidate, see fp8_flash_attention)
        q = Q.load([(bh * SQ_PAD + pid_m * BLOCK_M).to(tl.int32), 0])
    else:
        q = tl.load(Q + bh * SQ_PAD * D + offs_m[:, None] * D + offs_d[None, :])
    row_scale = tl.load(SQ + bh * n_q + tl.minimum(offs_m // q_block, n_q - 1)) * qk_scale
    if USE_TMA:  # TMA coordinates are 32-bit
        krow0 = (bh * SK_PAD).to(tl.int32)
        vrow0 = (bh * D).to(tl.int32)
    else:
        krow0 = bh * SK_PAD
        vrow0 = bh * D
    sk_ptr = SK + bh * n_k
    sv_ptr = SV + bh * n_k
    bias_ptr = BIAS + b * bias_stride_b + h * bias_stride_h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    sv_cur = tl.load(sv_ptr)
    full = (S_K // BLOCK_N) * BLOCK_N
    last = tl.cdiv(S_K, BLOCK_N) * BLOCK_N
    # full key tiles need no bounds check; the partial last one does
    acc, l_i, m_i, sv_cur = _attn_tiles(
        acc,
        l_i,
        m_i,
        sv_cur,
        q,
        row_scale,
        K,
        VT,
        krow0,
        vrow0,
        sk_ptr,
        sv_ptr,
        bias_ptr,
        offs_n,
        offs_d,
        0,
        full,
        S_K,
        SK_PAD,
        n_k,
        kv_block,
        log2_p,
        BLOCK_N,
        False,
        HAS_BIAS,
        QUANT_P,
        EXACT_CAST,
        D,
        USE_TMA,
        TWO_LEVEL,
        PV_KEYS,
    )
    acc, l_i, m_i, sv_cur = _attn_tiles(
        acc,
        l_i,
        m_i,
        sv_cur,
        q,
        row_scale,
        K,
        VT,
        krow0,
        vrow0,
        sk_ptr,
        sv_ptr,
        bias_ptr,
        offs_n,
        offs_d,
        full,
        last,
        S_K,
        SK_PAD,
        n_k,
        kv_block,
        log2_p,
        BLOCK_N,
        True,
        HAS_BIAS,
        QUANT_P,
        EXACT_CAST,
        D,
        USE_TMA,
        TWO_LEVEL,
        PV_KEYS,
    )
    # l sums P * p_scale, as acc does: O = acc * sv / l, no p_scale left to divide out
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a fully masked row: acc is 0, O = 0
    out = acc * (sv_cur / l_safe)[:, None]
    if ROUND_BF16:  # the interpreter's bf16 cast truncates
        out = round_bf16(out)
    row_ok = offs_m < S_Q
    o_ptrs = OUT + b * o_stride_b + h * o_stride_h + offs_m[:, None] * o_stride_s + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:  # log2(0) = -inf: a fully masked row gets -inf
        tl.store(LSE + bh * S_Q + offs_m, (m_i + tl.math.log2(l_i) - log2_p) * _LN2, mask=row_ok)


def _make_prune(table):
    def prune(configs, named_args, **kwargs):
        d = kwargs.get("D", named_args.get("D"))
        kv_block = named_args["kv_block"]
        allowed = set(table.get(d, ()))
        kept = [
            c
            for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed
            and kv_block % c.kwargs["BLOCK_N"] == 0
        ]
        return kept or [c for c in configs if kv_block % c.kwargs["BLOCK_N"] == 0][-1:] or configs[-1:]

    return prune


def _set_tile_shapes(nargs):
    """Autotune pre-hook: the TMA descriptors' tile shapes follow the config's BLOCK_N (V's: the keys of
    one P @ V dot, at most PV_KEYS)."""
    bn, d = nargs["BLOCK_N"], nargs["D"]
    nargs["K"].block_shape = [bn, d]
    nargs["VT"].block_shape = [d, min(bn, nargs.get("PV_KEYS", bn))]
    if nargs.get("Q_TMA"):
        nargs["Q"].block_shape = [nargs["BLOCK_M"], d]


def _autotuned(table, pre_hook=None):
    configs = sorted({c for cs in table.values() for c in cs}, reverse=True)
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=pre_hook)
            for m, n, w, s in configs
        ],
        key=["S_Q", "S_K", "D", "HAS_BIAS", "QUANT_P", "kv_block", "RETURN_LSE", "TWO_LEVEL", "PV_KEYS", "Q_TMA"],
        prune_configs_by={"early_config_prune": _make_prune(table)},
    )(_attn_fwd_kernel)


_attn_fwd_tma_tuned = _autotuned(TMA_CONFIGS, _set_tile_shapes)
_attn_fwd_pointer_tuned = _autotuned(POINTER_CONFIGS)


def _tile_table(tile: str | None, use_tma: bool) -> dict:
    if tile is None:
        return TMA_CONFIGS if use_tma else POINTER_CONFIGS
    if tile not in TILE_CANDIDATES:
        raise ValueError(f"unknown attention tile {tile!r}: expected one of {sorted(TILE_CANDIDATES)}")
    if not use_tma:
        raise ValueError(f"attention tile {tile!r} is a Hopper tile: it needs TMA loads (sm90+, Triton >= 3.4)")
    return TILE_CANDIDATES[tile][0]


def launch_candidates(d: int, kv_block: int, use_tma: bool, tile: str | None = None) -> list[tuple]:
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) configs the autotuner chooses among for a launch
    (its pick among them is by time; BLOCK_N must divide kv_block): the default lists, or a named
    candidate tile's."""
    kept = [c for c in _tile_table(tile, use_tma).get(d, ()) if kv_block % c[1] == 0]
    if not kept:
        raise ValueError(
            f"no {tile or ('TMA' if use_tma else 'pointer')} attention config for head dim {d} has "
            f"a key tile dividing kv_block={kv_block}"
        )
    return kept


_tile_tuned: dict = {}  # candidate tile name -> its autotuned kernel (made on first use)


def _tuned_kernel(tile: str | None, use_tma: bool):
    if tile is None:
        return _attn_fwd_tma_tuned if use_tma else _attn_fwd_pointer_tuned
    if tile not in _tile_tuned:
        _tile_tuned[tile] = _autotuned(_tile_table(tile, use_tma), _set_tile_shapes)
    return _tile_tuned[tile]


def interpreter_config(d: int, kv_block: int, use_tma: bool, tile: str | None = None) -> tuple:
    """The config Triton's CPU interpreter runs when none is given: the autotuner's first candidate for
    this launch, one stage (pipelining does not change the numerics; BLOCK_M does not either: each query
    row's arithmetic is the same in any tile). tests/ops/test_attention_shipped_numerics.py runs this
    launch from the lowering's own call under Hopper's emulated accumulation, and every other key tile
    (BLOCK_N) the autotuner may pick."""
    bm, bn, warps, _ = launch_candidates(d, kv_block, use_tma, tile)[0]
    return bm, bn, warps, 1


def tma_available(device: torch.device) -> bool:
    """Host tensor descriptors exist in this Triton and the GPU has TMA (sm90+)."""
    if TensorDescriptor is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def key_bias(attn_mask: torch.Tensor | None, b: int, h: int, s_k: int) -> torch.Tensor | None:
    """A key-padding mask (broadcastable to (B, H, 1, Sk)) as an additive fp32 bias (B, Hm, S_pad)
    in log2 units with -inf on padding keys; None for no mask. Raises for other masks."""
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if (
        m.dim() != 4
        or m.shape[2] != 1
        or m.shape[0] not in (1, b)
        or m.shape[1] not in (1, h)
        or m.shape[3] not in (1, s_k)
    ):
        raise ValueError(
            f"FP8 attention kernel takes key-padding masks broadcastable to (B, H, 1, Sk) = "
            f"({b}, {h}, 1, {s_k}), got shape {tuple(attn_mask.shape)}"
        )
    if m.dtype == torch.bool:
        bias = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    else:
        bias = m.float() * LOG2E
    s_pad = padded_len(s_k)
    out = torch.full((b, m.shape[1], s_pad), float("-inf"), dtype=torch.float32, device=m.device)
    out[:, :, :s_k] = bias[:, :, 0, :].expand(b, m.shape[1], s_k)
    return out


def fp8_flash_attention(
    qq,
    sq,
    kq,
    sk,
    vt,
    sv,
    *,
    s_q: int,
    s_k: int,
    softmax_scale: float,
    q_block: int,
    kv_block: int,
    quantize_p: bool = True,
    p_scale: float = 448.0,
    out_dtype=torch.bfloat16,
    bias: torch.Tensor | None = None,
    return_lse: bool = False,
    config: tuple | None = None,
    use_tma: bool | None = None,
    exact_cast: bool | None = None,
    two_level: bool = True,
    pv_keys: int | None = None,
    tile: str | None = None,
    q_tma: bool = False,
):
    """The attention kernel alone on prepared inputs; returns (B, H, s_q, D) in out_dtype, and
    with return_lse also the fp32 (B, H, s_q) natural-log LSE.

    sq / sk / sv: (B, H, n) fp32 (n = 1 for per-head scales; per-tensor scales are expanded).
    config = (BLOCK_M, BLOCK_N, num_warps, num_stages) bypasses the autotuner (the
    interpreter uses a fixed config unless given one). use_tma: load K and V through TMA
    descriptors (default: where `tma_available`; the interpreter runs both paths). pv_keys: the
    most keys one P @ V dot sums before its result is added to the fp32 accumulator (default
    PV_KEYS; 32, 64 or 128). two_level=False accumulates P @ V in place across key tiles (the
    old, inaccurate structure: measurement only). tile: a name of TILE_CANDIDATES, autotuned over its
    configs with its P @ V keys (pv_keys default), instead of the default lists: measurement only.
    q_tma: load the Q tile through a TMA descriptor too (with use_tma; measurement only: the same output
    bit for bit in the interpreter, 164-185 registers instead of 237-247 at (128, 64, 8 warps) on sm_90a,
    Triton 3.6 and 3.9, no spills; not yet timed on a GPU)."""
    b, h, sq_pad, d = qq.shape
    sk_pad = kq.shape[2]
    if d not in (64, 128):
        raise ValueError(f"FP8 attention kernel supports head dims 64 and 128, got {d}")
    if vt.shape != (b, h, d, sk_pad) or kq.shape != (b, h, sk_pad, d):
        raise ValueError(f"layout mismatch: q {tuple(qq.shape)}, k {tuple(kq.shape)}, v^T {tuple(vt.shape)}")
    if sq_pad % SEQ_PAD or sk_pad % SEQ_PAD:
        raise ValueError(f"padded lengths must be multiples of {SEQ_PAD}, got {sq_pad} / {sk_pad}")
    n_q, n_k = sq.shape[-1], sk.shape[-1]
    if sv.shape[-1] != n_k:
        raise ValueError("K and V scales must share the kv blocks")
    if tile is not None and tile not in TILE_CANDIDATES:
        raise ValueError(f"unknown attention tile {tile!r}: expected one of {sorted(TILE_CANDIDATES)}")
    if pv_keys is None:
        pv_keys = PV_KEYS if tile is None else TILE_CANDIDATES[tile][1]
    pv_keys = int(pv_keys)
    if pv_keys not in (32, 64, 128):
        raise ValueError(f"pv_keys must be 32, 64 or 128, got {pv_keys}")
    if use_tma is None:  # the interpreter takes Hopper's path: what the lowering launches on an H100 / H200
        use_tma = TensorDescriptor is not None if interpreting() else tma_available(qq.device)
    if q_tma and not use_tma:
        raise ValueError("q_tma=True loads Q through TMA: it needs use_tma (sm90+, Triton >= 3.4)")
    if use_tma and TensorDescriptor is None:
        raise RuntimeError("use_tma=True needs triton.tools.tensor_descriptor (Triton >= 3.4)")
    # one scale for the whole sequence: any block length works, make it span everything
    qb = q_block if n_q > 1 else sq_pad
    kb = kv_block if n_k > 1 else sk_pad
    sq, sk, sv = (t.float().expand(b, h, t.shape[-1]).contiguous() for t in (sq, sk, sv))
    out = torch.empty((b, h, s_q, d), dtype=out_dtype, device=qq.device)
    lse = torch.empty((b, h, s_q), dtype=torch.float32, device=qq.device) if return_lse else sq
    has_bias = bias is not None
    bias_t = bias if has_bias else sq
    bsb, bsh = (bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0) if has_bias else (0, 0)
    qk_scale = softmax_scale * LOG2E
    log2_p = math.log2(p_scale) if quantize_p else 0.0  # P is computed as exp2(x + log2_p) = P * p_scale
    if config is None and interpreting():
        config = interpreter_config(d, kb, use_tma, tile)
    q_arg, k_arg, v_arg = qq, kq, vt
    if use_tma:  # 2-D views: K (B*H*Sk_pad, D), V^T (B*H*D, Sk_pad); tile shapes set per config
        bn0 = config[1] if config is not None else 64
        k_arg = TensorDescriptor.from_tensor(kq.reshape(b * h * sk_pad, d), [bn0, d])
        v_arg = TensorDescriptor.from_tensor(vt.reshape(b * h * d, sk_pad), [d, min(bn0, pv_keys)])
        if q_tma:
            q_arg = TensorDescriptor.from_tensor(qq.reshape(b * h * sq_pad, d), [config[0] if config else 64, d])
    args = (
        q_arg,
        k_arg,
        v_arg,
        sq,
        sk,
        sv,
        bias_t,
        out,
        lse,
        h,
        s_q,
        s_k,
        sq_pad,
        sk_pad,
        n_q,
        n_k,
        qb,
        kb,
        bsb,
        bsh,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        qk_scale,
        log2_p,
    )
    exact = interpreting() if exact_cast is None else exact_cast
    flags = dict(
        D=d,
        HAS_BIAS=has_bias,
        QUANT_P=quantize_p,
        RETURN_LSE=return_lse,
        USE_TMA=use_tma,
        EXACT_CAST=exact,
        ROUND_BF16=exact and out_dtype == torch.bfloat16,
        TWO_LEVEL=bool(two_level),
        PV_KEYS=pv_keys,
        Q_TMA=bool(q_tma),
    )
    if b * h and s_q:
        if config is not None:
            bm, bn, warps, stages = config
            if kb % bn:
                raise ValueError(f"BLOCK_N={bn} must divide kv_block={kb}")
            grid = (triton.cdiv(s_q, bm), b * h)
            _attn_fwd_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags)
        else:
            grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * h)  # noqa: E731
            _tuned_kernel(tile, use_tma)[grid](*args, **flags)
    return (out, lse) if return_lse else out


def default_softmax_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
