"""CPU reference lowering: the exact numerics the device kernels implement.

Runs anywhere (any device torch supports), slowly: this is the quality
reference, never the speed path.
"""
from __future__ import annotations

import torch

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import Lowering


def quantize_activation(x2d: torch.Tensor, input_scale, act_granularity: str):
    """(x_fp8, scale [M,1] or []) for a 2-D activation."""
    if input_scale is not None:
        scale = input_scale.float().reshape(())
        return quant.cast_fp8(x2d, scale), scale
    if act_granularity == "tensor":
        return quant.quantize_per_tensor(x2d)
    return quant.quantize_per_row(x2d)


def w8a8_matmul(xq, xs, wq, ws, *, weight_granularity, weight_block, out_dtype):
    """FP8 x FP8 matmul with fp32 scales, via torch._scaled_mm where it applies."""
    m, n = xq.shape[0], wq.shape[0]
    if weight_granularity in ("tensor", "channel") and xq.device.type == "cpu":
        sa = xs.reshape(-1, 1).expand(m, 1) if xs.numel() > 1 else xs.reshape(1, 1).expand(m, 1)
        sb = ws.reshape(1, -1).expand(1, n) if ws.numel() > 1 else ws.reshape(1, 1).expand(1, n)
        return torch._scaled_mm(xq, wq.t(), scale_a=sa.contiguous(), scale_b=sb.contiguous(), out_dtype=out_dtype)
    x = xq.float() * xs
    w = quant.dequantize_weight(wq, ws, weight_granularity, weight_block)
    return (x @ w.t()).to(out_dtype)


class ReferenceLowering(Lowering):
    name = "reference"
    description = "CPU reference (exact FP8 numerics, not a speed path)"

    def attention(self, q, k, v, *, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, quantize_p, p_scale):
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
            q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k
        )
        return quant.attention_from_fp8(
            qq, sq, kq, sk, vq, sv, softmax_scale=softmax_scale, q_block=q_block, kv_block=kv_block,
            quantize_p=quantize_p, p_scale=p_scale, out_dtype=q.dtype, attn_mask=attn_mask,
        )

    def linear(self, x, weight, weight_scale, bias, input_scale, *, weight_granularity, weight_block, act_granularity, weight_only):
        x2d = x.reshape(-1, x.shape[-1])
        if weight_only:
            w = quant.dequantize_weight(weight, weight_scale, weight_granularity, weight_block).to(x.dtype)
            out = x2d @ w.t()
        else:
            xq, xs = quantize_activation(x2d, input_scale, act_granularity)
            out = w8a8_matmul(xq, xs, weight, weight_scale, weight_granularity=weight_granularity,
                              weight_block=weight_block, out_dtype=x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])


LOWERING = ReferenceLowering()
