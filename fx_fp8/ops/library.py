"""torch.library custom ops: opaque to Dynamo and Inductor, with fake impls.

Every op takes its static attributes as keyword arguments (the passes build
the nodes by name, never by position), including `lowering`, the name of the
implementation chosen at compile time (fx_fp8.ops.lowering). (No argument may be
called `kernel`: Inductor's fallback kernels take that name themselves.)

    fp8_attention        SDPA semantics, Q/K/V quantized to FP8 inside
    fp8_attention_lse    the same, also returning the log-sum-exp (ring attention, aten flash ops)
    quantize_activation  the fused activation quantization of lowerings that have one (NPU)
    scaled_mm            quantized activation x quantized weight, fp32 scales, bias
    weight_only_linear   quantized weight storage, native matmul (devices without FP8/INT8 units)
    quantized_linear     the eager composite a prepared QuantizedLinear calls; the linear pass
                         rewrites it into the compiled form
    static_input_scale   the calibrated activation scale kept on a weight (unprepared static scales)
    static_step_input_scale  the same with per-step scales: the scale of the published step's group
    step_scale           a prepared layer's per-step scale: its [n_groups] buffer indexed by the published step
    input_smoothing      the SmoothQuant 1/s vector kept on a weight (unprepared weights with smoothing_alpha)

The ops are inference-only: their autograd formula lets a graph that
requires grad compile, and raises only if a backward actually runs through them.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import get_lowering
from fx_fp8 import steps, weight_recipe, weights


# -- attention ------------------------------------------------------------------------------
def _attention(query, key, value, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k,
               quantize_p, p_scale, attention_kernel, lowering, return_lse):
    return get_lowering(lowering).attention(
        query, key, value, attn_mask=attn_mask, softmax_scale=softmax_scale, granularity=granularity,
        q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k, quantize_p=quantize_p,
        p_scale=p_scale, kernel=attention_kernel, return_lse=return_lse,
    )


@torch.library.custom_op("fx_fp8::fp8_attention", mutates_args=())
def fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  softmax_scale: float, *, granularity: str, q_block: int, kv_block: int, hadamard: bool,
                  smooth_k: bool, quantize_p: bool, p_scale: float, attention_kernel: str,
                  lowering: str) -> torch.Tensor:
    """SDPA on (B, H, S, D) inputs (attn_mask as in SDPA): Q/K/V quantized to FP8 e4m3, fused attention."""
    out = _attention(query, key, value, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k,
                     quantize_p, p_scale, attention_kernel, lowering, False)
    return out.contiguous()


@fp8_attention.register_fake
def _(query, key, value, attn_mask, softmax_scale, **_):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("fx_fp8::fp8_attention_lse", mutates_args=())
def fp8_attention_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: Optional[torch.Tensor], softmax_scale: float, *, granularity: str, q_block: int,
                      kv_block: int, hadamard: bool, smooth_k: bool, quantize_p: bool, p_scale: float,
                      attention_kernel: str, lowering: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_attention that also returns lse = log(sum(exp(scores))) per query row, fp32 (B, H, Sq)."""
    out, lse = _attention(query, key, value, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard,
                          smooth_k, quantize_p, p_scale, attention_kernel, lowering, True)
    return out.contiguous(), lse.float().contiguous()


@fp8_attention_lse.register_fake
def _(query, key, value, attn_mask, softmax_scale, **_):
    return (query.new_empty(*query.shape[:-1], value.shape[-1]),
            query.new_empty(query.shape[:-1], dtype=torch.float32))


# -- linears --------------------------------------------------------------------------------
@torch.library.custom_op("fx_fp8::quantize_activation", mutates_args=())
def quantize_activation(x: torch.Tensor, static_scale: Optional[torch.Tensor], *, method: str, granularity: str,
                        group: int, lowering: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq [M, K], fp32 scale [M, 1] per token, [] per tensor / static, [M, groups] per group)."""
    x2d = x.reshape(-1, x.shape[-1])
    return get_lowering(lowering).quantize_activation(x2d, static_scale, method=method, granularity=granularity,
                                                      group=group or None)


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


def _weight_and_scale(weight, weight_scale, method, weight_granularity, weight_block, smoothing_alpha=None):
    """A prepared (quantized) weight with its scale (checked unchanged since it was prepared),
    or the model's own weight: then its quantized copy (of W * s with smoothing), made at
    compile time and remade once whenever the weight changed (fx_fp8.weights)."""
    if weight_scale is not None:
        weights.check_prepared_weight(weight)
        return weight, weight_scale
    recipe = weight_recipe.recipe(method, weight_granularity, tuple(weight_block) or None)
    if smoothing_alpha is not None:
        return weights.smoothed_quantized_weight(weight, smoothing_alpha, recipe)
    return weights.quantized_weight(weight, recipe)


@torch.library.custom_op("fx_fp8::scaled_mm", mutates_args=())
def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], *, method: str, weight_granularity: str, weight_block: list[int],
              out_dtype: torch.dtype, fast_accum: bool, lowering: str,
              smoothing_alpha: Optional[float] = None) -> torch.Tensor:
    """xq [M, K] (quantized) x weight [N, K] -> [M, N] in out_dtype. With `smoothing_alpha`
    (an unprepared weight of a smoothed group) the weight's quantized W * s is used."""
    wq, ws = _weight_and_scale(weight, weight_scale, method, weight_granularity, weight_block, smoothing_alpha)
    if xq.shape[0] == 0:  # a 0-row input: the GEMMs refuse it, native returns an empty tensor
        return xq.new_zeros((0, wq.shape[0]), dtype=out_dtype)
    out = get_lowering(lowering).scaled_mm(xq, x_scale, wq, ws, bias, method=method,
                                           weight_granularity=weight_granularity,
                                           weight_block=tuple(weight_block) or None, out_dtype=out_dtype,
                                           fast_accum=fast_accum)
    return out.contiguous()


@scaled_mm.register_fake
def _(xq, x_scale, weight, weight_scale, bias, *, out_dtype, **_):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fx_fp8::weight_only_linear", mutates_args=())
def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], *, method: str, weight_granularity: str, weight_block: list[int],
                       lowering: str) -> torch.Tensor:
    """x [..., K] with a quantized weight dequantized for a native matmul -> [..., N]."""
    wq, ws = _weight_and_scale(weight, weight_scale, method, weight_granularity, weight_block)
    x2d = x.reshape(-1, x.shape[-1])
    out = get_lowering(lowering).weight_only_linear(x2d, wq, ws, bias, method=method,
                                                    weight_granularity=weight_granularity,
                                                    weight_block=tuple(weight_block) or None)
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@weight_only_linear.register_fake
def _(x, weight, weight_scale, bias, **_):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fx_fp8::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                     input_scale: Optional[torch.Tensor], input_smoothing: Optional[torch.Tensor] = None, *,
                     method: str, weight_granularity: str, weight_block: list[int], act_granularity: str,
                     lowering: str) -> torch.Tensor:
    """y = x @ W^T + b for a prepared QuantizedLinear, eagerly: smooth x (x * 1/s, when the
    weight holds W * s), quantize it (dynamic per token / per tensor, or with the static
    `input_scale`), then the lowering's scaled_mm."""
    weights.check_prepared_weight(weight)
    impl = get_lowering(lowering)
    x2d = x.reshape(-1, x.shape[-1])
    block = tuple(weight_block) or None
    if act_granularity == weights.WEIGHT_ONLY:  # W8A16: activations stay unquantized
        if input_smoothing is not None:
            x2d = quant.smooth_activation(x2d, input_smoothing)
        out = impl.weight_only_linear(x2d, weight, weight_scale, bias, method=method,
                                      weight_granularity=weight_granularity, weight_block=block)
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
    out = impl.scaled_mm(xq, xs, weight, weight_scale, bias, method=method, weight_granularity=weight_granularity,
                         weight_block=block, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@quantized_linear.register_fake
def _(x, weight, weight_scale, bias, input_scale, input_smoothing=None, **_):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fx_fp8::static_input_scale", mutates_args=())
def static_input_scale(weight: torch.Tensor) -> torch.Tensor:
    """The calibrated activation scale attached to `weight` at compile time (fp32 scalar)."""
    return weights.static_input_scale(weight).clone()


@static_input_scale.register_fake
def _(weight):
    return weight.new_empty((), dtype=torch.float32)


# Per-step scales: the published step (a ContextVar, read in Python) picks the scale on every call, so
# changing steps recompiles nothing. A CUDA graph would replay the first step's pick: the tag makes
# Inductor keep these ops out of captured graphs.
def _pick_step_scale(groups, table: Optional[torch.Tensor], fallback: torch.Tensor) -> torch.Tensor:
    i = steps.step_group(groups) if table is not None else None
    if i is None and table is not None:
        warnings.warn("fx_fp8: per-step activation scales, but no denoising step is published: static linears "
                      "use their all-steps scale (publish the step with fx_fp8.set_step / denoising_step, or "
                      "run the pipeline through compile_pipeline / publish_steps)", stacklevel=2)
    return (fallback if i is None else table[i]).clone()


@torch.library.custom_op("fx_fp8::static_step_input_scale", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def static_step_input_scale(weight: torch.Tensor) -> torch.Tensor:
    """The calibrated activation scale attached to `weight` for the published step's group (fp32 scalar)."""
    groups, table, fallback = weights.static_step_input_scales(weight)
    return _pick_step_scale(groups, table, fallback)


@static_step_input_scale.register_fake
def _(weight):
    return weight.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fx_fp8::step_scale", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def step_scale(scales: torch.Tensor, fallback: torch.Tensor, *, groups: list[int]) -> torch.Tensor:
    """scales[i] (fp32 [n_groups]) for the group i holding the published step (`groups`: flat
    [first0, last0, ...]); `fallback` (the all-steps scale) when no step is published."""
    return _pick_step_scale(groups, scales, fallback)


@step_scale.register_fake
def _(scales, fallback, *, groups):
    return fallback.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fx_fp8::input_smoothing", mutates_args=())
def input_smoothing(weight: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """1/s, the SmoothQuant factors (fp32 [in_features]) attached to `weight` at compile time for
    `alpha`: looked up per call, never a graph constant, so a graph Dynamo shares between model
    instances multiplies each instance's activations by that instance's own 1/s."""
    return weights.smoothing_of(weight, alpha).inverse.clone()


@input_smoothing.register_fake
def _(weight, *, alpha):
    return weight.new_empty((weight.shape[1],), dtype=torch.float32)


# -- inference only ---------------------------------------------------------------------------
@torch.library.custom_op("fx_fp8::no_backward", mutates_args=())
def no_backward(grad: torch.Tensor, like: torch.Tensor, op: str) -> torch.Tensor:
    raise RuntimeError(f"fx_fp8::{op} is inference-only: .backward() reached a quantized node. Compile the "
                       "model for training without fx_fp8's backends, or run inference under torch.no_grad()")


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


for _op, _name in ((fp8_attention, "fp8_attention"), (fp8_attention_lse, "fp8_attention_lse"),
                   (scaled_mm, "scaled_mm"), (weight_only_linear, "weight_only_linear"),
                   (quantized_linear, "quantized_linear"), (quantize_activation, "quantize_activation")):
    _register_inference_only(_op, _name)
