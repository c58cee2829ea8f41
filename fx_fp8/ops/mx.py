"""MXFP8 numerics: the CPU reference of `attention.granularity: mx`.

OCP microscaling: blocks of 32 consecutive elements share one power-of-two
scale, stored on the device as e8m0 (an 8-bit biased exponent). Q and K are
blocked along the head dim (the contraction axis of Q.K^T), V along the
sequence (the contraction axis of P.V). This is how MindIE-SD 3.1.0 quantizes
attention for the MXFP8 case (mindiesd/quantization/layer.py,
MXFP8RotateQuantFA.forward: `npu_dynamic_mx_quant(q or k, axis=-1)` and
`npu_dynamic_mx_quant(v, axis=0)` on (tokens, heads, head_dim) tensors) and
how CANN's fused attention reads them (aclnnFusedInferAttentionScoreV5,
query/key quant mode 6 "per-token-group", value mode 8 "per-channel-group").

Scale rule: aclnnDynamicMxQuant with scaleAlg 0, the default that MindIE-SD
uses for FP8 (it passes no scale_alg):

    shared_exp = floor(log2(max_i |x_i|)) - emax      (emax = 8 for float8_e4m3fn)
    scale      = 2 ** shared_exp
    x_q        = cast_e4m3(x / scale)                  (round to nearest even, "rint")

The block maximum lands in [256, 512) after the division, so values above 448
saturate to +-448 (the OCP MX rule; the CANN doc does not say what its cast
does with them: saturation is an assumption only hardware can confirm).
shared_exp is clamped to e8m0's range [-127, 127]; an all-zero block gets -127.
Dividing by a power of two is exact in fp32, so the only rounding is the e4m3 cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fx_fp8.ops.formats import FP8_DTYPE, FP8_MAX

MX_BLOCK = 32
E4M3_EMAX = 8  # exponent of float8_e4m3fn's largest normal (448 = 1.75 * 2**8)
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 exponent of the block scale: floor(log2(amax)) - emax, clamped to e8m0's range.

    floor(log2(a)) comes from frexp (a = m * 2**e with m in [0.5, 1): floor(log2(a)) = e - 1),
    exact for every float, where log2 + floor can round up just below a power of two."""
    amax = amax.float()
    _, e = torch.frexp(amax)
    exp = e.to(torch.int32) - 1 - E4M3_EMAX
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def exp2(exp: torch.Tensor) -> torch.Tensor:
    """fp32 2**exp for an int tensor (exact, down to the subnormal 2**-127)."""
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp.to(torch.int32))


def quantize_mx(x: torch.Tensor, dim: int, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn of x's shape, scale fp32): blocks of `block` along `dim`.

    scale has x's shape with dim `dim` replaced by ceil(size / block) (the block axis stays in
    place); the last block is zero-padded (zeros never raise a block's maximum)."""
    dim = dim % x.dim()
    xf = x.float().movedim(dim, -1)
    n = xf.shape[-1]
    nblk = -(-n // block)
    blocks = F.pad(xf, (0, nblk * block - n)).reshape(*xf.shape[:-1], nblk, block)
    scale = exp2(shared_exponent(blocks.abs().amax(dim=-1)))
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*xf.shape[:-1], nblk * block)[..., :n]
    return q.movedim(-1, dim).contiguous(), scale.movedim(-1, dim).contiguous()


def expand_scale(scale: torch.Tensor, dim: int, size: int, block: int = MX_BLOCK) -> torch.Tensor:
    """Per-element view of a block scale: repeat each block's scale `block` times along `dim`."""
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor, dim: int, block: int = MX_BLOCK) -> torch.Tensor:
    """fp32 values the kernel multiplies: q * 2**shared_exp (exact)."""
    dim = dim % q.dim()
    return q.float() * expand_scale(scale, dim, q.shape[dim], block)


# -- attention (B, H, S, D) ---------------------------------------------------------------
#: the axis each of Q, K, V is blocked along: head dim for Q and K, sequence for V
QKV_DIMS = (-1, -1, 2)


def quantize_qkv(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor):
    """(qq, sq, kq, sk, vq, sv) in MX form. qf / kf: Q and K already smoothed and rotated.
    Scales: Q, K (B, H, S, ceil(D/32)); V (B, H, ceil(S/32), D)."""
    (qq, sq), (kq, sk), (vq, sv) = (quantize_mx(t, d) for t, d in zip((qf, kf, v), QKV_DIMS))
    return qq, sq, kq, sk, vq, sv


def reference_qkv(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor):
    """What quant.prepare_qkv returns for granularity "mx": the dequantized fp32 Q, K, V with
    unit scales [1, 1, 1], so quant.attention_from_fp8 runs the exact MX math (products of the
    dequantized values in fp32) without knowing about MX blocks."""
    qq, sq, kq, sk, vq, sv = quantize_qkv(qf, kf, v)
    one = torch.ones(1, 1, 1, dtype=torch.float32, device=qf.device)
    return (dequantize_mx(qq, sq, -1), one, dequantize_mx(kq, sk, -1), one, dequantize_mx(vq, sv, 2), one)


# -- e8m0 bytes -----------------------------------------------------------------------------
def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 encoding (biased exponent) of exact power-of-two fp32 scales."""
    _, e = torch.frexp(scale.float())
    return (e.to(torch.int32) - 1 + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def from_e8m0(b: torch.Tensor) -> torch.Tensor:
    """fp32 scale of e8m0 bytes."""
    return exp2(b.to(torch.int32) - E8M0_BIAS)
