"""FP8 weights: quantize once, share between graphs, and free the originals.

`torch.compile(model, backend="fp8")` alone quantizes each weight once at
compile time into a graph constant shared by every graph of the model (both
step variants), but the model object still holds its original weight.
`prepare_model(model, config)` before compiling replaces eligible nn.Linear
modules by FP8Linear modules that hold only the FP8 weight and its scales, so
the memory really drops.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from fx_fp8.ops import quant

# Keyed by tensor identity: a plain WeakKeyDictionary compares tensors with ==,
# which raises on a second lookup of the same weight.
_CACHE: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def quantized_weight(weight: torch.Tensor, granularity: str, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale), computed once per (tensor, granularity, block)."""
    key = (granularity, tuple(block) if block else None, weight._version)
    per_tensor = _CACHE.setdefault(weight, {})
    if key not in per_tensor:
        with torch.no_grad():
            per_tensor.clear()  # an in-place update of the weight invalidates older versions
            per_tensor[key] = quant.quantize_weight(weight.detach(), granularity, block)
    return per_tensor[key]


_STATIC_SCALES: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def register_static_input_scale(weight: torch.Tensor, scale: float) -> None:
    """Remember the calibrated activation scale of the linear that owns `weight`."""
    _STATIC_SCALES[weight] = torch.tensor(scale, dtype=torch.float32, device=weight.device)


def static_input_scale(weight: torch.Tensor) -> torch.Tensor:
    try:
        return _STATIC_SCALES[weight]
    except KeyError:
        raise RuntimeError(
            "fx_fp8: no static activation scale registered for this weight (a graph compiled for another "
            "model instance?); call fx_fp8.prepare_model(model, config) before torch.compile"
        ) from None


class FP8Linear(nn.Module):
    """A linear layer holding only an FP8 weight (float8_e4m3fn) and fp32 scales."""

    def __init__(self, weight_fp8, weight_scale, bias, *, weight_granularity, weight_block, act_granularity,
                 input_scale: Optional[torch.Tensor] = None, orig_dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = weight_fp8.shape[1], weight_fp8.shape[0]
        self.weight = nn.Parameter(weight_fp8, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self.register_buffer("input_scale", input_scale)
        self.weight_granularity = weight_granularity
        self.weight_block = list(weight_block or [])
        self.act_granularity = act_granularity
        self.orig_dtype = orig_dtype

    def forward(self, x):
        from fx_fp8.ops.lowering import resolve_lowering_name

        # Eagerly, pick the lowering by device; the linear pass rewrites it at compile time.
        return torch.ops.fx_fp8.fp8_linear(
            x, self.weight, self.weight_scale, self.bias, self.input_scale, self.weight_granularity,
            self.weight_block, self.act_granularity, False, resolve_lowering_name("auto", x.device),
        )

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {self.weight_granularity} scales"


def prepare_model(model: nn.Module, config=None, **overrides) -> dict:
    """Quantize eligible nn.Linear weights of `model` to FP8 in place, freeing the originals.

    Uses the same layer selection as the linear pass (ignored_layers, sizes).
    Returns {"quantized": [names], "native": {name: reason}, "bytes_before", "bytes_after"}.
    Call it once before torch.compile(model, backend="fp8"/"fp8_npu").
    """
    from fx_fp8.calibration import load_activation_scales
    from fx_fp8.config import FP8Config
    from fx_fp8.passes.linear import linear_native_reason

    cfg = FP8Config.load(config, **overrides)
    qcfg = cfg.quantization_config
    patterns, _ = qcfg.effective_ignored_layers()
    scales = load_activation_scales(qcfg.activation_scales) if qcfg.activation_scheme == "static" else None
    result = {"quantized": [], "native": {}, "bytes_before": 0, "bytes_after": 0}
    if not cfg.linear_enabled:
        return result
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        reason = linear_native_reason(name, module.in_features, module.out_features, module.weight.dtype, qcfg, patterns)
        input_scale = None
        if reason is None and scales is not None:
            if name not in scales:
                reason = "no static activation scale for this layer (recalibrate)"
            else:
                input_scale = torch.tensor(scales[name], dtype=torch.float32, device=module.weight.device)
        if reason is not None:
            result["native"][name] = reason
            continue
        wq, ws = quant.quantize_weight(module.weight.detach(), qcfg.weight_granularity, qcfg.weight_block_size)
        new = FP8Linear(wq, ws, module.bias, weight_granularity=qcfg.weight_granularity, weight_block=qcfg.weight_block_size,
                        act_granularity=qcfg.activation_granularity, input_scale=input_scale, orig_dtype=module.weight.dtype)
        result["bytes_before"] += module.weight.numel() * module.weight.element_size()
        result["bytes_after"] += wq.numel() * wq.element_size() + ws.numel() * ws.element_size()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        result["quantized"].append(name)
    return result


def reachable_tensor_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from a model or compiled model:
    parameters, buffers and graph constants of compiled graphs (fx_fp8's weight cache included)."""
    seen, total = set(), 0

    def add(t: torch.Tensor):
        nonlocal total
        st = t.untyped_storage()
        key = (st.data_ptr(), st.device.type)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()

    module = getattr(obj, "_orig_mod", obj)
    tensors = list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []
    for t in tensors:
        add(t)
    # FP8 copies made at compile time for *this* model's weights (not other models').
    for t in tensors:
        for wq, ws in _CACHE.get(t, {}).values():
            add(wq)
            add(ws)
    return total
