"""FP8 fake quantization with straight-through gradients, for quantization-aware fine-tuning.

Used by ``examples/train_tiny_dit.py --fp8-aware`` to fine-tune the shipped tiny model so
that it survives the default FP8 recipe.  The forward values are those of
:mod:`fx_fp8.ops.quant` (the numerics every lowering reproduces): the same scales, the same
clamp + cast to ``float8_e4m3fn``, the same Hadamard rotation and K smoothing, the same
P quantization; weights go through the one weight recipe (fx_fp8.quant.recipe, with the
config's method and granularity, as prepare_model and the linear pass quantize them); only
the fp32 summation order of the matmuls may differ.  Gradients pass
straight through the rounding (``x + (xq - x).detach()``); the float math around it
(smoothing, rotation, softmax, scale products) stays differentiable.

Inference never uses this module: compiled models get real FP8 ops from the passes.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import quant
from fx_fp8.quant.recipe import WeightRecipe
from fx_fp8.quant.linear_plan import plan_linear
from fx_fp8.quant.rules import attention_call_reason, short_keys_reason


def _ste(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Forward: xq; backward: identity (straight-through estimator)."""
    return x + (xq - x).detach()


def fake_quant_rows(x: torch.Tensor, method: str = "fp8") -> torch.Tensor:
    """Per-row (last dim) quantize -> dequantize, as quant.quantize_per_row."""
    with torch.no_grad():
        q, s = quant.quantize_per_row(x.detach(), method)
        deq = q.float() * s
    return _ste(x.float(), deq)


def fake_quant_weight(w: torch.Tensor, granularity="channel", block=None) -> torch.Tensor:
    """Weight quantize -> dequantize through the one weight recipe (fx_fp8.quant.recipe) that
    prepare_model and the linear pass use; `granularity` may be a WeightRecipe itself (FP8 otherwise)."""
    recipe = granularity if isinstance(granularity, WeightRecipe) else WeightRecipe("fp8", granularity, block)
    with torch.no_grad():
        deq = recipe.dequantize(*recipe.quantize(w))
    return _ste(w.float(), deq)


def fake_quant_blocks(x: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    """(B, H, S, D) quantize -> dequantize as quant.quantize_rows_in_blocks (float32 result)."""
    with torch.no_grad():
        q, s = quant.quantize_rows_in_blocks(x.detach(), granularity, block)
        deq = q.float() * quant.expand_row_scale(s, x.shape[2], block)
    return _ste(x.float(), deq)


def fake_fp8_attention(q, k, v, attn_mask, softmax_scale: float, acfg) -> torch.Tensor:
    """Differentiable twin of quant.prepare_qkv + quant.attention_from_fp8."""
    qf, kf = q.float(), k.float()
    if acfg.smooth_k:
        kf = kf - kf.mean(dim=2, keepdim=True)
    if acfg.hadamard:
        qf, kf = quant.hadamard_rotate(qf), quant.hadamard_rotate(kf)
    qd = fake_quant_blocks(qf, acfg.granularity, acfg.q_block)
    kd = fake_quant_blocks(kf, acfg.granularity, acfg.kv_block)
    vd = fake_quant_blocks(v, acfg.granularity, acfg.kv_block)
    scores = quant.apply_mask((qd @ kd.transpose(-1, -2)) * softmax_scale, attn_mask)
    scores = scores - scores.amax(dim=-1, keepdim=True).detach()  # softmax is shift invariant
    p = torch.exp(scores)
    denom = p.sum(dim=-1, keepdim=True)  # from the unquantized P, as the kernels accumulate it
    if acfg.quantize_p:
        with torch.no_grad():
            pq = (p * acfg.p_scale).to(quant.FP8_DTYPE).float() / acfg.p_scale
        p = _ste(p, pq)
    return ((p @ vd) / denom).to(q.dtype)


def quantized_linear_names(model: torch.nn.Module, config: FP8Config) -> list[str]:
    """Names of the nn.Linear modules the FP8 linear pass quantizes W8A8 under `config` (weight-only
    sensitive layers are not simulated: their activations stay unquantized)."""
    qcfg = config.quantization_config
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and plan_linear(name, m.in_features, m.out_features, m.weight.dtype, qcfg).w8a8
    ]


def _fake_linear_forward(module: torch.nn.Linear, qcfg):
    recipe = WeightRecipe.w8a8(qcfg)

    def forward(x):
        if qcfg.activation_granularity != "token" or qcfg.activation_scheme != "dynamic":
            raise ValueError(
                f"fake quantization implements dynamic per-token activations, got "
                f"{qcfg.activation_scheme!r}/{qcfg.activation_granularity!r}"
            )
        if qcfg.smoothing_alpha is not None:
            raise ValueError(
                f"fake quantization does not simulate quantization_config.smoothing_alpha="
                f"{qcfg.smoothing_alpha!r} (it needs a calibration): train without it"
            )
        w = fake_quant_weight(module.weight, recipe)
        xd = fake_quant_rows(x.reshape(-1, x.shape[-1]), recipe.method)
        out = (xd @ w.t()).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
        return out if module.bias is None else out + module.bias

    return forward


@contextlib.contextmanager
def fake_fp8(model: torch.nn.Module, config: FP8Config | None = None):
    """Within the block, `model` runs with FP8 fake quantization where `config` quantizes:
    its eligible linears (instance-level forward override, removed on exit, so saving and
    deep-copying the model are unaffected) and every self-attention SDPA call (patched
    ``torch.nn.functional.scaled_dot_product_attention``; diffusers looks it up per call)."""
    config = config or FP8Config()
    names = quantized_linear_names(model, config) if config.linear_enabled else []
    modules = dict(model.named_modules())
    original_sdpa = F.scaled_dot_product_attention
    acfg = config.attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # the attention pass's own rules (fx_fp8.quant.rules)
        reason = attention_call_reason(
            query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa
        ) or short_keys_reason(query, key, acfg)
        if reason is not None:
            return original_sdpa(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        softmax_scale = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        return fake_fp8_attention(query, key, value, attn_mask, softmax_scale, acfg)

    try:
        for n in names:
            modules[n].forward = _fake_linear_forward(modules[n], config.quantization_config)
        if config.attention_enabled:
            F.scaled_dot_product_attention = sdpa
        yield names
    finally:
        F.scaled_dot_product_attention = original_sdpa
        for n in names:
            modules[n].__dict__.pop("forward", None)
