"""CPU reference lowering: the exact numerics the device kernels implement.

Runs anywhere (any device torch supports), slowly: this is the quality
reference, never the speed path.
"""
from __future__ import annotations

import torch

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import Lowering


def block_matmul(xq, xs, wq, ws, *, weight_block, out_dtype):
    """Block weight scales (activations per token and per group of weight_block[1] columns):
    both operands dequantized exactly, fp32 matmul."""
    x = quant.dequantize_activation(xq, xs, group=weight_block[1])
    return (x @ quant.dequantize_weight(wq, ws, "block", weight_block).t()).to(out_dtype)


def int8_matmul(xq, xs, wq, ws, *, weight_granularity, weight_block, out_dtype):
    """int8 x int8 with int32 accumulation (torch._int_mm), then one fp32 rescale."""
    if weight_granularity == "block":
        return block_matmul(xq, xs, wq, ws, weight_block=weight_block, out_dtype=out_dtype)
    acc = torch._int_mm(xq.contiguous(), wq.t().contiguous())  # exact integer products
    return (acc.float() * xs.float().reshape(-1, 1) * ws.float().reshape(1, -1)).to(out_dtype)


def fp8_matmul(xq, xs, wq, ws, *, weight_granularity, weight_block, out_dtype):
    """FP8 x FP8 with fp32 scales, via torch._scaled_mm where it applies (CPU)."""
    m, n = xq.shape[0], wq.shape[0]
    if weight_granularity in ("tensor", "channel") and xq.device.type == "cpu":
        sa = xs.reshape(-1, 1).expand(m, 1) if xs.numel() > 1 else xs.reshape(1, 1).expand(m, 1)
        sb = ws.reshape(1, -1).expand(1, n) if ws.numel() > 1 else ws.reshape(1, 1).expand(1, n)
        return torch._scaled_mm(xq, wq.t(), scale_a=sa.float().contiguous(), scale_b=sb.float().contiguous(),
                                out_dtype=out_dtype)
    if weight_granularity == "block":
        return block_matmul(xq, xs, wq, ws, weight_block=weight_block, out_dtype=out_dtype)
    x = xq.float() * xs
    w = quant.dequantize_weight(wq, ws, weight_granularity, weight_block)
    return (x @ w.t()).to(out_dtype)


class ReferenceLowering(Lowering):
    name = "reference"
    description = "CPU reference (exact FP8 / INT8 numerics, not a speed path)"

    def attention(self, q, k, v, *, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k,
                  quantize_p, p_scale, kernel, return_lse):
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
            q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k
        )
        out = quant.attention_from_fp8(
            qq, sq, kq, sk, vq, sv, softmax_scale=softmax_scale, q_block=q_block, kv_block=kv_block,
            quantize_p=quantize_p, p_scale=p_scale, out_dtype=q.dtype, attn_mask=attn_mask, return_lse=return_lse,
        )
        if return_lse and smooth_k:
            out, lse = out
            return out, lse + quant.smoothing_lse_shift(q, k, softmax_scale)
        return out

    def quantize_activation(self, x2d, static_scale, *, method, granularity, group=None):
        if static_scale is not None:
            return quant.quantize_activation_static(x2d, static_scale, method)
        return quant.quantize_activation(x2d, granularity, method, group)

    def scaled_mm(self, xq, x_scale, wq, w_scale, bias, *, method, weight_granularity, weight_block, out_dtype,
                  fast_accum=False):
        matmul = int8_matmul if method == "int8" else fp8_matmul
        out = matmul(xq, x_scale, wq, w_scale, weight_granularity=weight_granularity, weight_block=weight_block,
                     out_dtype=out_dtype)
        return out + bias.to(out.dtype) if bias is not None else out

    def weight_only_linear(self, x2d, wq, w_scale, bias, *, method, weight_granularity, weight_block):
        w = quant.dequantize_weight(wq, w_scale, weight_granularity, weight_block).to(x2d.dtype)
        out = x2d @ w.t()
        return out + bias.to(out.dtype) if bias is not None else out


LOWERING = ReferenceLowering()
