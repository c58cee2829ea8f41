"""CUDA lowering (sm89 / sm90): torch._scaled_mm linears and a Triton FP8 flash attention.

Linear (W8A8): activations quantized per row by a fused Triton kernel (amax,
scale and cast in one pass; per-tensor / static scales use plain torch ops),
then `torch._scaled_mm` with row-wise scales (per-row activation x per-channel
weight scales, bf16 output, bias fused) or per-tensor scales. Block weight
scales have no `_scaled_mm` path here: they dequantize both operands to bf16
and run a bf16 matmul (a numerics-correct slow path, not a speed path).
GPUs before sm89 have no FP8 tensor cores: weight-only FP8 (FP8 storage,
dequantize + native matmul).

Attention: Q/K/V quantized exactly as `quant.prepare_qkv` (fused Triton
kernels for block scales, torch ops for per-head / per-tensor scales), then
the kernel of `triton_fp8_attention` (head dims 64 and 128, key-padding masks).
Imports Triton lazily: the module loads on machines without it, and every
reason method reports a missing Triton instead of failing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import Lowering

HEAD_DIMS = (64, 128)
KEY_TILE = 64  # smallest BLOCK_N of the attention kernel: kv_block must be a multiple of it


def triton_reason() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install must show up as a reason, not a crash at compile time
        return f"triton not importable ({type(e).__name__}: {e})"
    return None


def device_reason(t) -> Optional[str]:
    """None when `t` lives on a CUDA GPU with FP8 tensor cores (sm89+)."""
    if t.device.type != "cuda":
        return f"the CUDA lowering needs CUDA tensors (got device {t.device.type!r})"
    major, minor = torch.cuda.get_device_capability(t.device)
    if (major, minor) < (8, 9):
        return f"GPU sm{major}{minor} has no FP8 tensor cores (needs sm89 or newer)"
    return None


def is_key_padding_mask(shape, b: int, h: int, s_k: int) -> bool:
    """True for masks broadcastable to (B, H, 1, Sk) with a real key dimension: one row for all queries."""
    shape = (1,) * (4 - len(shape)) + tuple(int(x) for x in shape)
    return len(shape) == 4 and shape[0] in (1, b) and shape[1] in (1, h) and shape[2] == 1 and shape[3] in (1, s_k)


class CudaLowering(Lowering):
    name = "cuda"
    description = "CUDA sm89+/sm90: torch._scaled_mm W8A8 linears, Triton FP8 flash attention"

    # -- decisions (FakeTensor metadata at compile time) ---------------------------
    def attention_reason(self, q, k, v, cfg, attn_mask=None) -> Optional[str]:
        reason = device_reason(q) or triton_reason()
        if reason:
            return reason
        d = q.shape[-1]
        if d not in HEAD_DIMS or v.shape[-1] != d:
            return f"head dim {d} (value {v.shape[-1]}) not supported by the CUDA FP8 kernel (needs {HEAD_DIMS})"
        if cfg.granularity == "block" and cfg.kv_block % KEY_TILE:
            return f"kv_block={cfg.kv_block} is not a multiple of {KEY_TILE} (the CUDA kernel's key tile)"
        if attn_mask is not None and not is_key_padding_mask(attn_mask.shape, q.shape[0], q.shape[1], k.shape[2]):
            return (f"mask not supported by the CUDA FP8 kernel (shape {tuple(attn_mask.shape)}; "
                    "only key-padding masks broadcastable to (B, H, 1, Sk))")
        return None

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        if x.device.type != "cuda":
            return f"the CUDA lowering needs CUDA tensors (got device {x.device.type!r})"
        n, k = weight.shape
        if k % 16 or n % 16:
            return f"features {k}->{n} not multiples of 16 (torch._scaled_mm)"
        if self.weight_only(weight) is None and qcfg.activation_granularity == "token" and triton_reason():
            return triton_reason()
        return None

    def weight_only(self, weight) -> Optional[str]:
        if weight.device.type != "cuda":
            return None  # linear_reason keeps it native
        major, minor = torch.cuda.get_device_capability(weight.device)
        if (major, minor) < (8, 9):
            return f"GPU sm{major}{minor} has no FP8 tensor cores"
        return None

    # -- kernels -----------------------------------------------------------------
    def attention(self, q, k, v, *, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k,
                  quantize_p, p_scale):
        from fx_fp8.ops.triton_fp8_attention import fp8_flash_attention, key_bias
        from fx_fp8.ops.triton_quant import interpreting

        if q.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"fx_fp8 CUDA lowering got tensors on {q.device}; use lowering='reference' off-GPU")
        qq, sq, kq, sk, vt, sv = prepare_qkv_cuda(q, k, v, granularity=granularity, q_block=q_block,
                                                  kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k)
        b, h, s_q, _ = q.shape
        bias = key_bias(attn_mask, b, h, k.shape[2])
        return fp8_flash_attention(qq, sq, kq, sk, vt, sv, s_q=s_q, s_k=k.shape[2], softmax_scale=softmax_scale,
                                   q_block=q_block, kv_block=kv_block, quantize_p=quantize_p, p_scale=p_scale,
                                   out_dtype=q.dtype, bias=bias)

    def linear(self, x, weight, weight_scale, bias, input_scale, *, weight_granularity, weight_block, act_granularity,
               weight_only):
        x2d = x.reshape(-1, x.shape[-1])
        if weight_only:
            w = quant.dequantize_weight(weight, weight_scale, weight_granularity, weight_block).to(x.dtype)
            out = F.linear(x2d, w, bias.to(x.dtype) if bias is not None else None)
        else:
            xq, xs = quantize_activation_cuda(x2d, input_scale, act_granularity)
            if weight_granularity == "block":
                out = block_fallback_matmul(xq, xs, weight, weight_scale, weight_block, bias, x.dtype)
            else:
                out = scaled_mm(xq, xs, weight, weight_scale, bias, x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])


def quantize_activation_cuda(x2d: torch.Tensor, input_scale, act_granularity: str):
    """(x_fp8 row-major, scale [M,1] or []) with the numerics of reference.quantize_activation."""
    if input_scale is not None:
        scale = input_scale.float().reshape(())
        return quant.cast_fp8(x2d, scale).contiguous(), scale
    if act_granularity == "tensor":
        xq, xs = quant.quantize_per_tensor(x2d)
        return xq.contiguous(), xs
    if act_granularity != "token":
        raise ValueError(f"unknown activation granularity {act_granularity!r}")
    from fx_fp8.ops.triton_quant import quantize_rows_fp8

    return quantize_rows_fp8(x2d)


def scaled_mm(xq, xs, wq, ws, bias, out_dtype):
    """torch._scaled_mm for tensor / channel weight scales. Row-wise scaling (any per-row or
    per-channel scale) needs bf16 output: other dtypes are cast afterwards."""
    m, n = xq.shape[0], wq.shape[0]
    if xs.numel() > 1 or ws.numel() > 1:
        sa = xs.reshape(-1, 1).expand(m, 1).contiguous()
        sb = ws.reshape(1, -1).expand(1, n).contiguous()
        out = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                               bias=bias.to(torch.bfloat16) if bias is not None else None)
        return out.to(out_dtype)
    sa, sb = xs.reshape(1, 1).float(), ws.reshape(1, 1).float()
    fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
    out = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                           bias=bias.to(out_dtype) if fused_bias else None)
    if bias is not None and not fused_bias:  # cuBLASLt takes no bias with fp32 output
        out = out + bias.to(out_dtype)
    return out


def block_fallback_matmul(xq, xs, wq, ws, weight_block, bias, out_dtype):
    """Block weight scales: dequantize both operands to bf16 and use a bf16 matmul (fp32 accumulation).
    torch._scaled_mm has no arbitrary-block scaling; this matches the reference up to bf16 rounding
    of the dequantized values (2^-9), far below the FP8 error."""
    x = (xq.float() * xs).to(torch.bfloat16)
    w = quant.dequantize_weight(wq, ws, "block", weight_block).to(torch.bfloat16)
    out = F.linear(x, w, bias.to(torch.bfloat16) if bias is not None else None)
    return out.to(out_dtype)


def prepare_qkv_cuda(q, k, v, *, granularity, q_block, kv_block, hadamard, smooth_k):
    """quant.prepare_qkv in the attention kernel's layouts: (qq (B,H,Sq_pad,D), sq (B,H,n),
    kq (B,H,Sk_pad,D), sk, vt (B,H,D,Sk_pad), sv). Fused Triton kernels for block scales;
    per-head / per-tensor scales need a whole-head amax first, so they use the reference ops."""
    from fx_fp8.ops.triton_quant import padded_len, prepare_qkv_blocks

    if granularity == "block":
        return prepare_qkv_blocks(q, k, v, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k)
    qq, sq, kq, sk, vq, sv = quant.prepare_qkv(q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block,
                                               hadamard=hadamard, smooth_k=smooth_k)

    def pad_rows(t):
        b, h, s, d = t.shape
        out = torch.zeros((b, h, padded_len(s), d), dtype=t.dtype, device=t.device)
        out[:, :, :s] = t
        return out

    vt = pad_rows(vq).transpose(-1, -2).contiguous()
    return pad_rows(qq), sq, pad_rows(kq), sk, vt, sv


LOWERING = CudaLowering()
