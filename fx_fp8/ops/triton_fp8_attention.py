"""FP8 flash-attention forward in Triton (written for sm90 / Hopper; runs on sm89 too).

Inputs are what `triton_quant.prepare_qkv_blocks` writes: Q and K as
(B, H, S_pad, D) e4m3, V transposed to (B, H, D, S_pad) e4m3 (Hopper's FP8
wgmma wants the second operand K-major), fp32 scales (B, H, n) per block of
`q_block` / `kv_block` rows (n = 1 for per-head or per-tensor scales).

Per (query tile, key tile):
  S  = (Qq @ Kq^T) * sq[row] * sk[col] * softmax_scale      FP8 dot, fp32 accumulation
  online softmax in fp32 (base 2), row sum l from the unquantized P
  Pq = e4m3(P * p_scale)                                     P in [0, 1] against the running max
  acc += (Pq @ Vq) * sv[key block]                           FP8 dot (BLOCK_N divides kv_block)
  O  = acc / p_scale / l

Difference from `quant.attention_from_fp8` (the reference): the reference
quantizes P = exp(S - final row max); this kernel quantizes P against the
running row max of the tiles seen so far and rescales the fp32 accumulator
when the max grows, as every online-softmax kernel must. Both put the row's
largest probability at p_scale, so the relative rounding is the same; values
computed against a smaller running max sit higher in the e4m3 range, so fewer
of them flush to zero. Exponentials use exp2 (softmax_scale * log2(e) folded
into the score scale). Fully masked rows give NaN, as in the reference.

Masks: an additive fp32 bias per key (B, Hm, S_pad), Hm in {1, H}, already in
log2 units, -inf on padding keys (a key-padding mask); other masks are
rejected by the lowering.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fx_fp8.ops.triton_quant import SEQ_PAD, interpreting, round_e4m3

LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner on GPUs; BLOCK_N must divide kv_block.
CONFIGS = [(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 4), (64, 64, 4, 3)]


@triton.jit
def _attn_tiles(acc, l_i, m_i, q, sq_row, k_base, vt_base, sk_ptr, sv_ptr, bias_ptr, offs_n, offs_d,
                lo, hi, S_K, S_PAD, n_k, kv_block, qk_scale, p_scale,
                BLOCK_N: tl.constexpr, CHECK: tl.constexpr, HAS_BIAS: tl.constexpr,
                QUANT_P: tl.constexpr, EXACT_CAST: tl.constexpr, D: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[None, :] * D + offs_d[:, None])          # (D, BLOCK_N), D contiguous
        qk = tl.dot(q, k)
        sk = tl.load(sk_ptr + tl.minimum(cols // kv_block, n_k - 1))
        s = qk * (sq_row * qk_scale)[:, None] * sk[None, :]
        if HAS_BIAS:
            s = s + tl.load(bias_ptr + cols)[None, :]
        if CHECK:
            s = tl.where(cols[None, :] < S_K, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if HAS_BIAS:  # rows whose keys so far are all masked: zeros instead of NaN (-inf - -inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(vt_base + cols[:, None] + offs_d[None, :] * S_PAD)     # (BLOCK_N, D), keys contiguous
        sv = tl.load(sv_ptr + tl.minimum(start_n // kv_block, n_k - 1))
        if QUANT_P:
            y = p * p_scale
            if EXACT_CAST:
                y = round_e4m3(y)
            pv = tl.dot(y.to(tl.float8e4nv), v)
        else:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc + pv * sv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, VT, SQ, SK, SV, BIAS, OUT,
                     H, S_Q, S_K, SQ_PAD, SK_PAD, n_q, n_k, q_block, kv_block,
                     bias_stride_b, bias_stride_h, o_stride_b, o_stride_h, o_stride_s,
                     qk_scale, p_scale, out_scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                     QUANT_P: tl.constexpr, EXACT_CAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + bh * SQ_PAD * D + offs_m[:, None] * D + offs_d[None, :])
    sq_row = tl.load(SQ + bh * n_q + tl.minimum(offs_m // q_block, n_q - 1))
    k_base = K + bh * SK_PAD * D
    vt_base = VT + bh * D * SK_PAD
    sk_ptr = SK + bh * n_k
    sv_ptr = SV + bh * n_k
    bias_ptr = BIAS + b * bias_stride_b + h * bias_stride_h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    full = (S_K // BLOCK_N) * BLOCK_N
    last = tl.cdiv(S_K, BLOCK_N) * BLOCK_N
    # full key tiles need no bounds check; the partial last one does
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, sq_row, k_base, vt_base, sk_ptr, sv_ptr, bias_ptr, offs_n, offs_d,
                                0, full, S_K, SK_PAD, n_k, kv_block, qk_scale, p_scale,
                                BLOCK_N, False, HAS_BIAS, QUANT_P, EXACT_CAST, D)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, sq_row, k_base, vt_base, sk_ptr, sv_ptr, bias_ptr, offs_n, offs_d,
                                full, last, S_K, SK_PAD, n_k, kv_block, qk_scale, p_scale,
                                BLOCK_N, True, HAS_BIAS, QUANT_P, EXACT_CAST, D)
    out = acc * (out_scale / l_i)[:, None]
    o_ptrs = OUT + b * o_stride_b + h * o_stride_h + offs_m[:, None] * o_stride_s + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(offs_m < S_Q)[:, None])


def _prune(configs, named_args, **kwargs):
    kv_block = named_args["kv_block"]
    kept = [c for c in configs if kv_block % c.kwargs["BLOCK_N"] == 0]
    return kept or configs[-1:]


_attn_fwd_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in CONFIGS],
    key=["S_Q", "S_K", "D", "HAS_BIAS", "QUANT_P", "kv_block"],
    prune_configs_by={"early_config_prune": _prune},
)(_attn_fwd_kernel)


def key_bias(attn_mask: torch.Tensor | None, b: int, h: int, s_k: int) -> torch.Tensor | None:
    """A key-padding mask (broadcastable to (B, H, 1, Sk)) as an additive fp32 bias (B, Hm, S_pad)
    in log2 units with -inf on padding keys; None for no mask. Raises for other masks."""
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4 or m.shape[2] != 1 or m.shape[0] not in (1, b) or m.shape[1] not in (1, h) or m.shape[3] not in (1, s_k):
        raise ValueError(f"FP8 attention kernel takes key-padding masks broadcastable to (B, H, 1, Sk) = "
                         f"({b}, {h}, 1, {s_k}), got shape {tuple(attn_mask.shape)}")
    if m.dtype == torch.bool:
        bias = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    else:
        bias = m.float() * LOG2E
    s_pad = -(-s_k // SEQ_PAD) * SEQ_PAD
    out = torch.full((b, m.shape[1], s_pad), float("-inf"), dtype=torch.float32, device=m.device)
    out[:, :, :s_k] = bias[:, :, 0, :].expand(b, m.shape[1], s_k)
    return out


def fp8_flash_attention(qq, sq, kq, sk, vt, sv, *, s_q: int, s_k: int, softmax_scale: float, q_block: int,
                        kv_block: int, quantize_p: bool = True, p_scale: float = 448.0, out_dtype=torch.bfloat16,
                        bias: torch.Tensor | None = None, config: tuple | None = None,
                        exact_cast: bool | None = None) -> torch.Tensor:
    """The attention kernel alone on prepared inputs; returns (B, H, s_q, D) in out_dtype.

    sq / sk / sv: (B, H, n) fp32 (n = 1 for per-head scales; expand per-tensor scales).
    config = (BLOCK_M, BLOCK_N, num_warps, num_stages) bypasses the autotuner (the
    interpreter always uses a fixed config)."""
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
    # one scale for the whole sequence: any block length works, make it span everything
    qb = q_block if n_q > 1 else sq_pad
    kb = kv_block if n_k > 1 else sk_pad
    sq, sk, sv = (t.expand(b, h, t.shape[-1]).contiguous().float() for t in (sq, sk, sv))
    out = torch.empty((b, h, s_q, d), dtype=out_dtype, device=qq.device)
    has_bias = bias is not None
    bias_t = bias if has_bias else sq
    bsb, bsh = (bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0) if has_bias else (0, 0)
    qk_scale = softmax_scale * LOG2E
    out_scale = 1.0 / p_scale if quantize_p else 1.0
    args = (qq, kq, vt, sq, sk, sv, bias_t, out, h, s_q, s_k, sq_pad, sk_pad, n_q, n_k, qb, kb, bsb, bsh,
            out.stride(0), out.stride(1), out.stride(2), qk_scale, p_scale, out_scale)
    flags = dict(D=d, HAS_BIAS=has_bias, QUANT_P=quantize_p,
                 EXACT_CAST=interpreting() if exact_cast is None else exact_cast)
    if config is None and interpreting():
        config = (64, 64, 4, 1)
    if config is not None:
        bm, bn, warps, stages = config
        if kb % bn:
            raise ValueError(f"BLOCK_N={bn} must divide kv_block={kb}")
        grid = (triton.cdiv(s_q, bm), b * h)
        _attn_fwd_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags)
    else:
        grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * h)  # noqa: E731
        _attn_fwd_tuned[grid](*args, **flags)
    return out


def default_softmax_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
