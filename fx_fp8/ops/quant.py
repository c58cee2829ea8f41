"""FP8 e4m3 quantization numerics shared by every lowering.

Device lowerings must reproduce these exactly (same scale granularity,
rounding via a plain cast to float8_e4m3fn after clamping, same rotation), so
that quality measured with the CPU reference predicts quality on the device.
"""

from __future__ import annotations

import functools
import math

import torch

from fx_fp8.ops import mx
from fx_fp8.ops.formats import FP8_DTYPE, FP8_MAX, INT8_MAX, METHODS  # noqa: F401 (re-exported)

_TINY = 1e-12


def scale_from_amax(amax: torch.Tensor, qmax: float = FP8_MAX) -> torch.Tensor:
    """fp32 scale so that amax maps to the largest representable value."""
    return amax.float().clamp_min(_TINY) / qmax


def cast_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to the e4m3 range, rounded to float8_e4m3fn."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def cast_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to the nearest integer (ties to even), clamped to [-127, 127] (symmetric)."""
    return torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def cast(x: torch.Tensor, scale: torch.Tensor, method: str = "fp8") -> torch.Tensor:
    return cast_int8(x, scale) if method == "int8" else cast_fp8(x, scale)


def _qmax(method: str) -> float:
    try:
        return METHODS[method][1]
    except KeyError:
        raise ValueError(f"unknown quantization method {method!r}: expected one of {sorted(METHODS)}") from None


# -- activations and weights (2-D) ---------------------------------------------
def quantize_per_row(x: torch.Tensor, method: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of the last dim: scale shape x.shape[:-1] + (1,)."""
    scale = scale_from_amax(x.abs().amax(dim=-1, keepdim=True), _qmax(method))
    return cast(x, scale, method), scale


def quantize_per_tensor(x: torch.Tensor, method: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    # rows' maxima, then one zero appended: an empty (0-row) input has amax 0, without a size check
    rows = x.abs().amax(dim=-1).reshape(-1)
    scale = scale_from_amax(torch.nn.functional.pad(rows, (0, 1)).amax(), _qmax(method)).reshape(())
    return cast(x, scale, method), scale


def quantize_per_group(x2d: torch.Tensor, group: int, method: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row and per `group` consecutive columns (the activation side of block
    weight scales, as blockwise scaled matmuls take it): scale [M, ceil(K / group)]."""
    m, k = x2d.shape
    padded = torch.nn.functional.pad(x2d.float(), (0, (-k) % group))
    groups = padded.reshape(m, padded.shape[1] // group, group)  # no -1: m may be 0
    scale = scale_from_amax(groups.abs().amax(dim=-1), _qmax(method))
    return cast(groups, scale[..., None], method).reshape(m, padded.shape[1])[:, :k].contiguous(), scale


def quantize_activation(x2d: torch.Tensor, granularity: str, method: str = "fp8", group: int | None = None):
    """Dynamic activation quantization of a 2-D [M, K] input: (xq, scale [M, 1], [] or [M, groups])."""
    if granularity == "token":
        return quantize_per_row(x2d, method)
    if granularity == "tensor":
        return quantize_per_tensor(x2d, method)
    if granularity == "group":
        return quantize_per_group(x2d, group, method)
    raise ValueError(f"unknown activation granularity {granularity!r}")


def dequantize_activation(xq: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """float32 activation back from its quantized form (per token, per tensor or per group)."""
    if group is not None and scale.dim() == 2 and scale.shape[-1] != 1:
        return xq.float() * scale.repeat_interleave(group, dim=-1)[:, : xq.shape[-1]]
    return xq.float() * scale


def quantize_activation_static(x2d: torch.Tensor, scale: torch.Tensor, method: str = "fp8"):
    """Static activation quantization with a calibrated scalar scale: (xq, scale []). INT8 has no
    NaN: its scale is per row ([M, 1]), NaN on the rows that hold a NaN, so the output row is NaN
    as it is natively and with FP8 (whose e4m3 NaN carries through)."""
    scale = scale.float().reshape(())
    if method == "int8":
        nan_rows = torch.isnan(x2d).any(dim=-1, keepdim=True)
        return cast(x2d, scale, method), torch.where(nan_rows, float("nan"), scale)
    return cast(x2d, scale, method), scale


#: SmoothQuant factors are clamped to this range (a channel never scaled by more than 1e4 either way)
SMOOTHING_RANGE = (1e-4, 1e4)


def smoothing_factors(channel_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant migration factors per input channel, fp32 [K]:
    s_j = amax_x_j^alpha / amax_w_j^(1 - alpha), clamped to SMOOTHING_RANGE; 1 where the
    channel or the weight column was never non-zero (nothing to migrate).
    The linear then computes (x / s) @ (W * s)^T = x @ W^T: activations are multiplied by 1/s
    before quantization, weight columns by s before theirs."""
    a = channel_amax.detach().double().cpu()
    w = weight_amax.detach().double().cpu()
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(*SMOOTHING_RANGE).float()


def smooth_activation(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x * (1/s) over the last dim, computed in fp32 and returned in x's dtype (the dtype the
    quantizer, or a fused device quantization kernel, reads)."""
    return (x.float() * inverse.float()).to(x.dtype)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape
    return torch.nn.functional.pad(x, (0, (-c) % cols, 0, (-r) % rows))


def quantize_weight(w: torch.Tensor, granularity: str, block: tuple[int, int] | None = None, method: str = "fp8"):
    """Quantize a [out, in] weight. Scales: tensor -> [], channel -> [out, 1],
    block -> [ceil(out/br), ceil(in/bc)]."""
    if granularity == "tensor":
        return quantize_per_tensor(w, method)
    if granularity == "channel":
        return quantize_per_row(w, method)
    if granularity == "block":
        br, bc = block
        out_f, in_f = w.shape
        padded = _pad_to(w.float(), br, bc)
        blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
        scale = scale_from_amax(blocks.abs().amax(dim=(1, 3)), _qmax(method))
        q = cast(blocks, scale[:, None, :, None], method).reshape(padded.shape)[:out_f, :in_f].contiguous()
        return q, scale
    raise ValueError(f"unknown weight granularity {granularity!r}")


def weight_only_layout(group_size: int | None) -> tuple[str, tuple[int, int] | None]:
    """(weight granularity, block) of weight-only (W8A16) storage: per output channel, or with
    group_size per output channel and per group_size input columns (block [1, group_size])."""
    return ("channel", None) if group_size is None else ("block", (1, int(group_size)))


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, granularity: str, block=None) -> torch.Tensor:
    """float32 weight back from its FP8 form (the exact values the kernels multiply)."""
    if granularity in ("tensor", "channel"):
        return q.float() * scale
    br, bc = block
    expanded = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


# -- attention (B, H, S, D) -----------------------------------------------------
@functools.lru_cache(maxsize=None)
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard_block_size(d: int) -> int:
    """Largest power of two dividing d: the rotation is block-diagonal Hadamard."""
    return d & (-d)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """fp32 n x n orthonormal Hadamard on `device`, made once (no host copy per call,
    which graph capture such as npugraph_ex / CUDA graphs would not allow)."""
    return _hadamard_cpu(n).to(device=device, dtype=torch.float32)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last dim, H orthonormal (block-diagonal when d is not a power of 2)."""
    d = x.shape[-1]
    n = hadamard_block_size(d)
    h = hadamard_matrix(n, x.device)
    xs = x.float().reshape(*x.shape[:-1], d // n, n)
    return (xs @ h).reshape(x.shape)


def quantize_rows_in_blocks(x: torch.Tensor, granularity: str, block: int):
    """Quantize (B, H, S, D). Scales (fp32): tensor -> [1,1,1], head -> [B,H,1],
    block -> [B, H, ceil(S/block)] (one scale per `block` consecutive rows)."""
    b, h, s, d = x.shape
    xf = x.float()
    if granularity == "tensor":
        scale = scale_from_amax(xf.abs().amax()).reshape(1, 1, 1)
        return cast_fp8(xf, scale[..., None]), scale
    if granularity == "head":
        scale = scale_from_amax(xf.abs().amax(dim=(2, 3))).reshape(b, h, 1)
        return cast_fp8(xf, scale[..., None]), scale
    nblk = -(-s // block)
    padded = torch.nn.functional.pad(xf, (0, 0, 0, nblk * block - s))
    blocks = padded.reshape(b, h, nblk, block, d)
    scale = scale_from_amax(blocks.abs().amax(dim=(3, 4)))
    q = cast_fp8(blocks, scale[..., None, None]).reshape(b, h, nblk * block, d)[:, :, :s]
    return q, scale


def expand_row_scale(scale: torch.Tensor, s: int, block: int) -> torch.Tensor:
    """Per-row view [B', H', S, 1] of a [.., nblk] block scale (or [.., 1] per head/tensor)."""
    if scale.shape[-1] == 1:
        return scale[..., None]
    return scale.repeat_interleave(block, dim=-1)[..., :s, None]


def prepare_qkv(q, k, v, *, granularity, q_block, kv_block, hadamard, smooth_k):
    """The pre-kernel half every lowering shares: rotate, smooth, quantize.

    Returns (qq, sq, kq, sk, vq, sv) with FP8 data and fp32 scales as
    quantize_rows_in_blocks describes.
    """
    qf, kf = q.float(), k.float()
    if smooth_k:
        kf = kf - kf.mean(dim=2, keepdim=True)  # q.(k - m) differs by a per-row constant
    if hadamard:
        qf, kf = hadamard_rotate(qf), hadamard_rotate(kf)
    if granularity == "mx":  # MXFP8 (fx_fp8.ops.mx): dequantized values, unit scales
        return mx.reference_qkv(qf, kf, v)
    qq, sq = quantize_rows_in_blocks(qf, granularity, q_block)
    kq, sk = quantize_rows_in_blocks(kf, granularity, kv_block)
    vq, sv = quantize_rows_in_blocks(v, granularity, kv_block)
    return qq, sq, kq, sk, vq, sv


def smoothing_lse_shift(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """What K smoothing removed from the log-sum-exp: softmax_scale * q . mean(K), (B, H, Sq) fp32.

    Subtracting K's token mean shifts every score of a query row by the same
    q . mean(K): the softmax and the output do not change, its log-sum-exp
    does. Lowerings that return an lse with smooth_k add this back, so the lse
    is that of the unsmoothed scores (what ring attention merges)."""
    k_mean = k.float().mean(dim=2, keepdim=True)  # (B, H, 1, D)
    return (q.float() @ k_mean.transpose(-1, -2)).squeeze(-1) * softmax_scale


def apply_mask(scores: torch.Tensor, attn_mask) -> torch.Tensor:
    """SDPA mask semantics: bool True = attend, float = added to the scores."""
    if attn_mask is None:
        return scores
    if attn_mask.dtype == torch.bool:
        return scores.masked_fill(~attn_mask, float("-inf"))
    return scores + attn_mask.float()


def attention_from_fp8(
    qq,
    sq,
    kq,
    sk,
    vq,
    sv,
    *,
    softmax_scale,
    q_block,
    kv_block,
    quantize_p,
    p_scale,
    out_dtype,
    attn_mask=None,
    return_lse=False,
):
    """Reference math of the fused FP8 kernel, in float32.

    S = (Qq Kq^T) * sq * sk * softmax_scale; P = exp(S - rowmax) in [0, 1];
    P is quantized to e4m3 with the fixed scale 1/p_scale when quantize_p;
    O = (Pq Vq) * sv / rowsum(P) with rowsum taken from the unquantized P,
    as flash kernels accumulate it in fp32. A row whose keys are all masked
    gives O = 0 (as native SDPA does) and lse = -inf.
    With return_lse, also lse = rowmax + log(rowsum(P)) (natural log, fp32, (B, H, Sq)).
    """
    s_q, s_k = qq.shape[2], kq.shape[2]
    rows_q = expand_row_scale(sq, s_q, q_block)  # [B,H,Sq,1]
    rows_k = expand_row_scale(sk, s_k, kv_block).transpose(-1, -2)  # [B,H,1,Sk]
    scores = apply_mask((qq.float() @ kq.float().transpose(-1, -2)) * rows_q * rows_k * softmax_scale, attn_mask)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)  # fully masked row
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if quantize_p:
        p = (p * p_scale).to(FP8_DTYPE).float() / p_scale
    vf = vq.float() * expand_row_scale(sv, s_k, kv_block)
    out = ((p @ vf) / denom.clamp_min(_TINY)).to(out_dtype)
    if not return_lse:
        return out
    return out, (row_max + torch.log(denom)).squeeze(-1)


def dequantized_linear(
    x2d: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias, granularity: str, block=None
) -> torch.Tensor:
    """x2d @ dequantize(W)^T + bias with the weight dequantized to x's dtype first: the weight-only
    (W8A16) matmul where no fused kernel takes the layout (the reference's numerics)."""
    w = dequantize_weight(wq, w_scale, granularity, block).to(x2d.dtype)
    out = x2d @ w.t()
    return out + bias.to(out.dtype) if bias is not None else out
