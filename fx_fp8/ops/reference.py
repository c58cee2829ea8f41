"""CPU reference lowering: the exact numerics the device kernels implement.

Runs anywhere (any device torch supports), slowly: this is the quality
reference, never the speed path.
"""

from __future__ import annotations

import torch

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import Lowering

#: fp64 holds a sum of this many e4m3 x e4m3 (or int8 x int8) products exactly, in any order
EXACT_SUM_TERMS = 1 << 17


def exact_product_sum(aq, bq):
    """aq [M, K] @ bq [N, K]^T of FP8 / int8 codes: the exact sum, rounded once to fp32.

    An e4m3 x e4m3 product is exact in fp32, but an fp32 sum of them rounds, so its bits depend
    on the order the BLAS (and its version, and the CPU's vector width) adds in. In fp64 every
    product is a multiple of 2**-18 below 2**18 in magnitude, and every partial sum of up to
    2**17 of them a multiple of 2**-18 below 2**35: within fp64's 53-bit significand, so exact
    whatever the order. The result is therefore the same on every torch, BLAS, CPU and device.
    Longer sums add their 2**17-term pieces in index order (still deterministic). Devices other
    than CPU and CUDA (whose fp64 matmul may be missing) sum on the CPU.
    """
    device = aq.device
    if device.type not in ("cpu", "cuda"):
        aq, bq = aq.cpu(), bq.cpu()
    k = aq.shape[1]
    total = None
    for k0 in range(0, max(k, 1), EXACT_SUM_TERMS):
        part = aq[:, k0 : k0 + EXACT_SUM_TERMS].double() @ bq[:, k0 : k0 + EXACT_SUM_TERMS].double().t()
        total = part if total is None else total + part
    return total.float().to(device)


def block_matmul(xq, xs, wq, ws, *, weight_block, out_dtype):
    """Block weight scales (activations per token and per group of weight_block[1] columns): per
    group of columns the exact product sum in fp32, times both scales, added in group order in
    fp32 (the promotion a blockwise FP8 GEMM does), so the bits depend on no BLAS."""
    br, bc = weight_block
    n = wq.shape[0]
    per_group = xs.dim() == 2 and xs.shape[-1] != 1  # else per token [M, 1] or static []
    out = None
    for g, k0 in enumerate(range(0, xq.shape[1], bc)):
        acc = exact_product_sum(xq[:, k0 : k0 + bc], wq[:, k0 : k0 + bc])
        x_scale = xs[:, g : g + 1] if per_group else xs.reshape(-1, 1)
        w_scale = ws[:, g].repeat_interleave(br)[:n].reshape(1, n)
        part = acc * x_scale.float() * w_scale.float()
        out = part if out is None else out + part
    if out is None:  # no input columns: an empty sum
        out = torch.zeros(xq.shape[0], n, device=xq.device)
    return out.to(out_dtype)


def int8_matmul(xq, xs, wq, ws, *, weight_granularity, weight_block, out_dtype):
    """int8 x int8 with int32 accumulation (torch._int_mm), then one fp32 rescale."""
    if weight_granularity == "block":
        return block_matmul(xq, xs, wq, ws, weight_block=weight_block, out_dtype=out_dtype)
    acc = torch._int_mm(xq.contiguous(), wq.t().contiguous())  # exact integer products
    return (acc.float() * xs.float().reshape(-1, 1) * ws.float().reshape(1, -1)).to(out_dtype)


def fp8_matmul(xq, xs, wq, ws, *, weight_granularity, weight_block, out_dtype):
    """FP8 x FP8 with fp32 scales: the exact product sum rounded to fp32, then one fp32 rescale
    (activation scale, then weight scale), as the device GEMMs apply scales after accumulating.
    Plain tensor ops only, so every supported torch gives the same bits on any device."""
    if weight_granularity == "block":
        return block_matmul(xq, xs, wq, ws, weight_block=weight_block, out_dtype=out_dtype)
    acc = exact_product_sum(xq, wq)
    return (acc * xs.float().reshape(-1, 1) * ws.float().reshape(1, -1)).to(out_dtype)


class ReferenceLowering(Lowering):
    name = "reference"
    description = "CPU reference (exact FP8 / INT8 numerics, not a speed path)"

    def attention(
        self,
        q,
        k,
        v,
        *,
        attn_mask,
        softmax_scale,
        granularity,
        q_block,
        kv_block,
        hadamard,
        smooth_k,
        quantize_p,
        p_scale,
        kernel,
        return_lse,
    ):
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
            q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k
        )
        out = quant.attention_from_fp8(
            qq,
            sq,
            kq,
            sk,
            vq,
            sv,
            softmax_scale=softmax_scale,
            q_block=q_block,
            kv_block=kv_block,
            quantize_p=quantize_p,
            p_scale=p_scale,
            out_dtype=q.dtype,
            attn_mask=attn_mask,
            return_lse=return_lse,
        )
        if return_lse and smooth_k:
            out, lse = out
            return out, lse + quant.smoothing_lse_shift(q, k, softmax_scale)
        return out

    def quantize_activation(self, x2d, static_scale, *, method, granularity, group=None):
        if static_scale is not None:
            return quant.quantize_activation_static(x2d, static_scale, method)
        return quant.quantize_activation(x2d, granularity, method, group)

    def scaled_mm(
        self, xq, x_scale, wq, w_scale, bias, *, method, weight_granularity, weight_block, out_dtype, fast_accum=False
    ):
        matmul = int8_matmul if method == "int8" else fp8_matmul
        out = matmul(
            xq,
            x_scale,
            wq,
            w_scale,
            weight_granularity=weight_granularity,
            weight_block=weight_block,
            out_dtype=out_dtype,
        )
        return out + bias.to(out.dtype) if bias is not None else out

    def weight_only_linear(self, x2d, wq, w_scale, bias, *, method, weight_granularity, weight_block):
        return quant.dequantized_linear(x2d, wq, w_scale, bias, weight_granularity, weight_block)


LOWERING = ReferenceLowering()
