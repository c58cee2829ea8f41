"""torch.library custom ops: opaque to Dynamo and Inductor, with fake impls.

Every op takes its static attributes as keyword arguments (the passes build
the nodes by name, never by position), including `lowering`, the name of the
implementation chosen at compile time (fx_fp8.ops.lowering). (No argument may be
called `kernel`: Inductor's fallback kernels take that name themselves.)

    fp8_attention        SDPA semantics, Q/K/V quantized to FP8 inside
    fp8_attention_lse    the same, also returning the log-sum-exp (ring attention, aten flash ops)
    quantize_activation  the fused activation quantization of lowerings that have one (NPU)
    scaled_mm            quantized activation x quantized weight, fp32 scales, bias (the lowerings whose
                         GEMM is not written into the graph as aten ops: CPU reference, NPU, CUDA INT8)
    weight_only_linear   quantized weight storage, native matmul (devices without FP8/INT8 units)
    quantized_linear     the eager composite a prepared QuantizedLinear calls; the linear pass
                         rewrites it into the compiled form
    step_scale           per-step static scales: an [n_groups] table indexed by the published step

Every weight these ops read is a graph input: a prepared layer's own parameter, or the quantized
copy of a model's weight that fx_fp8 appends to the graph (fx_fp8/quant/weight_feeds.py). No op looks
weight state up at run time.

The ops are inference-only: their autograd formula lets a graph that
requires grad compile, and raises only if a backward actually runs through them.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from fx_fp8 import steps
from fx_fp8.ops import quant
from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.ops.lowering import get_lowering


# -- attention ------------------------------------------------------------------------------
def _attention(
    query,
    key,
    value,
    attn_mask,
    softmax_scale,
    granularity,
    q_block,
    kv_block,
    hadamard,
    smooth_k,
    quantize_p,
    p_scale,
    attention_kernel,
    lowering,
    return_lse,
):
    return get_lowering(lowering).attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        softmax_scale=softmax_scale,
        granularity=granularity,
        q_block=q_block,
        kv_block=kv_block,
        hadamard=hadamard,
        smooth_k=smooth_k,
        quantize_p=quantize_p,
        p_scale=p_scale,
        kernel=attention_kernel,
        return_lse=return_lse,
    )


@torch.library.custom_op("fx_fp8::fp8_attention", mutates_args=())
def fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    softmax_scale: float,
    *,
    granularity: str,
    q_block: int,
    kv_block: int,
    hadamard: bool,
    smooth_k: bool,
    quantize_p: bool,
    p_scale: float,
    attention_kernel: str,
    lowering: str,
) -> torch.Tensor:
    """SDPA on (B, H, S, D) inputs (attn_mask as in SDPA): Q/K/V quantized to FP8 e4m3, fused attention."""
    out = _attention(
        query,
        key,
        value,
        attn_mask,
        softmax_scale,
        granularity,
        q_block,
        kv_block,
        hadamard,
        smooth_k,
        quantize_p,
        p_scale,
        attention_kernel,
        lowering,
        False,
    )
    return out.contiguous()


@fp8_attention.register_fake
def _(query, key, value, attn_mask, softmax_scale, **_):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("fx_fp8::fp8_attention_lse", mutates_args=())
def fp8_attention_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    softmax_scale: float,
    *,
    granularity: str,
    q_block: int,
    kv_block: int,
    hadamard: bool,
    smooth_k: bool,
    quantize_p: bool,
    p_scale: float,
    attention_kernel: str,
    lowering: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_attention that also returns lse = log(sum(exp(scores))) per query row, fp32 (B, H, Sq)."""
    out, lse = _attention(
        query,
        key,
        value,
        attn_mask,
        softmax_scale,
        granularity,
        q_block,
        kv_block,
        hadamard,
        smooth_k,
        quantize_p,
        p_scale,
        attention_kernel,
        lowering,
        True,
    )
    return out.contiguous(), lse.float().contiguous()


@fp8_attention_lse.register_fake
def _(query, key, value, attn_mask, softmax_scale, **_):
    return (query.new_empty(*query.shape[:-1], value.shape[-1]), query.new_empty(query.shape[:-1], dtype=torch.float32))


# -- linears --------------------------------------------------------------------------------
@torch.library.custom_op("fx_fp8::quantize_activation", mutates_args=())
def quantize_activation(
    x: torch.Tensor, static_scale: Optional[torch.Tensor], *, method: str, granularity: str, group: int, lowering: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq [M, K], fp32 scale [M, 1] per token, [] per tensor / static, [M, groups] per group)."""
    x2d = x.reshape(-1, x.shape[-1])
    return get_lowering(lowering).quantize_activation(
        x2d, static_scale, method=method, granularity=granularity, group=group or None
    )


@quantize_activation.register_fake
def _(x, static_scale, *, method, granularity, group, lowering):
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    if (static_scale is not None and method != "int8") or granularity == "tensor":
        scale_shape = ()
    elif static_scale is not None:  # int8: per row, NaN where the row holds one (quant.quantize_activation_static)
        scale_shape = (m, 1)
    else:
        scale_shape = (m, 1) if granularity == "token" else (m, -(-k // group))
    return (x.new_empty((m, k), dtype=quant.METHODS[method][0]), x.new_empty(scale_shape, dtype=torch.float32))


@torch.library.custom_op("fx_fp8::scaled_mm", mutates_args=())
def scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    method: str,
    weight_granularity: str,
    weight_block: list[int],
    out_dtype: torch.dtype,
    fast_accum: bool,
    lowering: str,
) -> torch.Tensor:
    """xq [M, K] (quantized) x quantized weight [N, K] with its fp32 scale -> [M, N] in out_dtype."""
    if xq.shape[0] == 0:  # a 0-row input: the GEMMs refuse it, native returns an empty tensor
        return xq.new_zeros((0, weight.shape[0]), dtype=out_dtype)
    out = get_lowering(lowering).scaled_mm(
        xq,
        x_scale,
        weight,
        weight_scale,
        bias,
        method=method,
        weight_granularity=weight_granularity,
        weight_block=tuple(weight_block) or None,
        out_dtype=out_dtype,
        fast_accum=fast_accum,
    )
    return out.contiguous()


@scaled_mm.register_fake
def _(xq, x_scale, weight, weight_scale, bias, *, out_dtype, **_):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fx_fp8::weight_only_linear", mutates_args=())
def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    method: str,
    weight_granularity: str,
    weight_block: list[int],
    lowering: str,
) -> torch.Tensor:
    """x [..., K] with a quantized weight [N, K] dequantized for a native matmul -> [..., N]."""
    x2d = x.reshape(-1, x.shape[-1])
    out = get_lowering(lowering).weight_only_linear(
        x2d,
        weight,
        weight_scale,
        bias,
        method=method,
        weight_granularity=weight_granularity,
        weight_block=tuple(weight_block) or None,
    )
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@weight_only_linear.register_fake
def _(x, weight, weight_scale, bias, **_):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fx_fp8::quantized_linear", mutates_args=())
def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    input_scale: Optional[torch.Tensor],
    input_smoothing: Optional[torch.Tensor] = None,
    *,
    method: str,
    weight_granularity: str,
    weight_block: list[int],
    act_granularity: str,
    lowering: str,
) -> torch.Tensor:
    """y = x @ W^T + b for a prepared QuantizedLinear, eagerly: smooth x (x * 1/s, when the
    weight holds W * s), quantize it (dynamic per token / per tensor, or with the static
    `input_scale`), then the lowering's scaled_mm."""
    impl = get_lowering(lowering)
    x2d = x.reshape(-1, x.shape[-1])
    block = tuple(weight_block) or None
    if act_granularity == WEIGHT_ONLY:  # W8A16: activations stay unquantized
        if input_smoothing is not None:
            x2d = quant.smooth_activation(x2d, input_smoothing)
        out = impl.weight_only_linear(
            x2d, weight, weight_scale, bias, method=method, weight_granularity=weight_granularity, weight_block=block
        )
        return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()
    if input_smoothing is not None:
        x2d = quant.smooth_activation(x2d, input_smoothing)
    block = tuple(weight_block) or None
    if input_scale is not None:
        xq, xs = quant.quantize_activation_static(x2d, input_scale, method)
    else:
        xq, xs = quant.quantize_activation(x2d, act_granularity, method, block[1] if block else None)
    if x2d.shape[0] == 0:  # a 0-row input: the GEMMs refuse it, native returns an empty tensor
        return x.new_zeros((*x.shape[:-1], weight.shape[0]))
    out = impl.scaled_mm(
        xq,
        xs,
        weight,
        weight_scale,
        bias,
        method=method,
        weight_granularity=weight_granularity,
        weight_block=block,
        out_dtype=x.dtype,
    )
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@quantized_linear.register_fake
def _(x, weight, weight_scale, bias, input_scale, input_smoothing=None, **_):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Per-step scales: the published step (a ContextVar, read in Python) picks the scale on every call, so
# changing steps recompiles nothing. A CUDA graph would replay the first step's pick: the tag makes
# Inductor keep these ops out of captured graphs.
def _pick_step_scale(groups, table: Optional[torch.Tensor], fallback: torch.Tensor) -> torch.Tensor:
    i = steps.step_group(groups) if table is not None else None
    if i is None and table is not None:
        warnings.warn(
            "fx_fp8: per-step activation scales, but no denoising step is published: static linears "
            "use their all-steps scale (publish the step with fx_fp8.set_step / denoising_step, or "
            "run the pipeline through compile_pipeline / publish_steps)",
            stacklevel=2,
        )
    return (fallback if i is None else table[i]).clone()


@torch.library.custom_op("fx_fp8::step_scale", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def step_scale(scales: torch.Tensor, fallback: torch.Tensor, *, groups: list[int]) -> torch.Tensor:
    """scales[i] (fp32 [n_groups]) for the group i holding the published step (`groups`: flat
    [first0, last0, ...]); `fallback` (the all-steps scale) when no step is published."""
    return _pick_step_scale(groups, scales, fallback)


@step_scale.register_fake
def _(scales, fallback, *, groups):
    return fallback.new_empty((), dtype=torch.float32)


# -- inference only ---------------------------------------------------------------------------
@torch.library.custom_op("fx_fp8::no_backward", mutates_args=())
def no_backward(grad: torch.Tensor, like: torch.Tensor, op: str) -> torch.Tensor:
    raise RuntimeError(
        f"fx_fp8::{op} is inference-only: .backward() reached a quantized node. Compile the "
        "model for training without fx_fp8's backends, or run inference under torch.no_grad()"
    )


@no_backward.register_fake
def _(grad, like, op):
    return torch.empty_like(like)


def _register_inference_only(op, name: str) -> None:
    """An autograd formula whose backward raises when (and only when) it runs, so graphs that
    require grad still compile (AOTAutograd traces the backward with the fake impl)."""

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)])
        ctx.is_tensor = [isinstance(t, torch.Tensor) for t in inputs]

    def backward(ctx, *grads):
        g = next(g for g in grads if g is not None)
        saved = iter(ctx.saved_tensors)
        out = []
        for i, is_tensor in enumerate(ctx.is_tensor):
            t = next(saved) if is_tensor else None
            out.append(torch.ops.fx_fp8.no_backward(g, t, name) if is_tensor and ctx.needs_input_grad[i] else None)
        return tuple(out)

    op.register_autograd(backward, setup_context=setup_context)


for _op, _name in (
    (fp8_attention, "fp8_attention"),
    (fp8_attention_lse, "fp8_attention_lse"),
    (scaled_mm, "scaled_mm"),
    (weight_only_linear, "weight_only_linear"),
    (quantized_linear, "quantized_linear"),
    (quantize_activation, "quantize_activation"),
):
    _register_inference_only(_op, _name)
