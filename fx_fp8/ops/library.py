"""torch.library custom ops: opaque to Dynamo and Inductor, with fake impls.

The `lowering` string argument is chosen by the passes at compile time; the
implementation is looked up in fx_fp8.ops.lowering.
"""
from __future__ import annotations

from typing import Optional

import torch

from fx_fp8.ops.lowering import get_lowering
from fx_fp8.weights import quantized_weight, static_input_scale


@torch.library.custom_op("fx_fp8::fp8_attention", mutates_args=())
def fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    softmax_scale: float,
    granularity: str,
    q_block: int,
    kv_block: int,
    hadamard: bool,
    smooth_k: bool,
    quantize_p: bool,
    p_scale: float,
    lowering: str,
) -> torch.Tensor:
    """SDPA semantics on (B, H, S, D) inputs (attn_mask as in SDPA, broadcast to
    (B, H, Sq, Sk)): quantize Q/K/V to FP8 e4m3, fused attention."""
    out = get_lowering(lowering).attention(
        query, key, value, attn_mask=attn_mask, softmax_scale=softmax_scale, granularity=granularity, q_block=q_block,
        kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k, quantize_p=quantize_p, p_scale=p_scale,
    )
    return out.contiguous()


@fp8_attention.register_fake
def _fp8_attention_fake(query, key, value, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, quantize_p, p_scale, lowering):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("fx_fp8::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    input_scale: Optional[torch.Tensor],
    weight_granularity: str,
    weight_block: list[int],
    act_granularity: str,
    weight_only: bool,
    lowering: str,
) -> torch.Tensor:
    """y = x @ W^T + b, x quantized here (dynamic per token / per tensor, or
    with the static `input_scale`).

    `weight` is either FP8 with its fp32 `weight_scale` (prepare_model), or the
    model's own weight with `weight_scale=None`: then its FP8 copy is looked up
    by the weight's identity (made once, at compile time). Looking it up per
    weight, rather than baking it into the graph, keeps it right when Dynamo
    reuses one graph for another instance of the same class (Wan2.2's experts).
    act_granularity "static" likewise looks up the static scale registered for
    that weight.
    """
    if weight_scale is None:
        if act_granularity == "static":
            input_scale = static_input_scale(weight)
        weight, weight_scale = quantized_weight(weight, weight_granularity, tuple(weight_block) or None)
    out = get_lowering(lowering).linear(
        x, weight, weight_scale, bias, input_scale, weight_granularity=weight_granularity,
        weight_block=tuple(weight_block) or None, act_granularity=act_granularity, weight_only=weight_only,
    )
    return out.contiguous()


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight, weight_scale, bias, input_scale, weight_granularity, weight_block, act_granularity, weight_only, lowering):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
