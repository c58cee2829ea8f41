"""Quantized weights are model state: quantize once, share between graphs, free the originals.

Two ways a quantized weight comes to exist, both owned by the model:
* `fx_fp8.prepare_model(model, config)` (fx_fp8/prepare.py; recommended, `compile_pipeline` calls it)
  replaces eligible nn.Linear modules by QuantizedLinear modules that hold
  only the FP8/INT8 weight and its fp32 scales, as a parameter and buffers the
  graph reads like any other. The original weights are freed.
* `torch.compile(model, backend="fp8")` alone quantizes each weight at
  compile time and keeps the copy on the weight Parameter itself (one entry
  per method/granularity, never evicted by another, dropped with the weight),
  so every graph of the model, both step variants, and another instance of
  the same class each find their own weight's copy. The model keeps its
  original weight too (the report says so).

With SmoothQuant-style smoothing (quantization_config.smoothing_alpha) the
quantized copy is that of W * s: a separate entry whose key includes the
smoothing (alpha and a digest of s), and the Smoothing (s and 1/s) is kept on the
weight too, per alpha, for the fx_fp8::input_smoothing op to read at run time
(never baked into a graph: Dynamo shares one graph between model instances).
A prepared QuantizedLinear holds its 1/s as the `input_smoothing` buffer.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import resolve_lowering_name

#: attribute of a weight tensor holding its quantized copies: {(method, granularity, block): (version, wq, ws)}
_COPIES_ATTR = "_fx_fp8_quantized"
#: attribute of a weight tensor holding the calibrated activation scale of its linear
_STATIC_SCALE_ATTR = "_fx_fp8_input_scale"
#: attribute of a weight tensor holding its smoothing per alpha: {alpha: Smoothing}
_SMOOTHING_ATTR = "_fx_fp8_smoothing"


@dataclass(frozen=True, eq=False)
class Smoothing:
    """SmoothQuant factors of one activation-quantization group: the weight columns are
    multiplied by `factors` (s) before quantization, the activation by `inverse` (1/s)."""

    alpha: float
    factors: torch.Tensor   # s, fp32 [in_features]
    inverse: torch.Tensor   # 1/s, fp32 [in_features], on the weight's device
    key: tuple              # ("smooth", alpha, digest of s): part of the quantized copy's cache key

    @classmethod
    def make(cls, factors: torch.Tensor, alpha: float, device=None) -> "Smoothing":
        s = factors.detach().float().cpu().contiguous()
        digest = hashlib.sha1(s.numpy().tobytes()).hexdigest()[:16]
        return cls(float(alpha), s, (1.0 / s).to(device or "cpu"), ("smooth", float(alpha), digest))


def quantized_weight(weight: torch.Tensor, method: str, granularity: str, block,
                     smoothing: Optional[Smoothing] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, fp32 scale) of `weight` (of W * s with `smoothing`), made once per
    (method, granularity, block[, smoothing]) and kept on the weight; remade only if the
    weight was changed in place since."""
    key = (method, granularity, tuple(block) if block else None)
    if smoothing is not None:
        key = key + (smoothing.key,)
    copies = getattr(weight, _COPIES_ATTR, None)
    if copies is None:
        copies = {}
        setattr(weight, _COPIES_ATTR, copies)
    entry = copies.get(key)
    if entry is None or entry[0] != weight._version:
        with torch.no_grad():
            w = weight.detach()
            if smoothing is not None:
                w = w.float() * smoothing.factors.to(w.device)
            wq, ws = quant.quantize_weight(w, granularity, key[2], method)
        entry = copies[key] = (weight._version, wq, ws)
    return entry[1], entry[2]


def attach_smoothing(weight: torch.Tensor, smoothing: Smoothing) -> None:
    """Keep the smoothing of the group the linear owning `weight` belongs to on that weight
    (one per alpha: a later compile with the same alpha replaces it)."""
    table = getattr(weight, _SMOOTHING_ATTR, None)
    if table is None:
        table = {}
        setattr(weight, _SMOOTHING_ATTR, table)
    table[smoothing.alpha] = smoothing


def smoothing_of(weight: torch.Tensor, alpha: float) -> Smoothing:
    entry = getattr(weight, _SMOOTHING_ATTR, {}).get(float(alpha))
    if entry is None:
        raise RuntimeError(
            f"fx_fp8: no smoothing (alpha {alpha:g}) attached to this weight (a graph compiled for another model "
            "instance?); call fx_fp8.prepare_model(model, config) before torch.compile")
    return entry


def smoothed_quantized_weight(weight: torch.Tensor, alpha: float, method: str, granularity: str,
                              block) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized W * s of `weight` for its attached smoothing of `alpha` (run time)."""
    return quantized_weight(weight, method, granularity, block, smoothing_of(weight, alpha))


def quantized_copies(weight: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The quantized copies kept on `weight` (for memory accounting; a smoothing's 1/s
    vector is counted with its copy)."""
    copies = [(wq, ws) for _, wq, ws in getattr(weight, _COPIES_ATTR, {}).values()]
    return copies + [(sm.inverse, sm.factors) for sm in getattr(weight, _SMOOTHING_ATTR, {}).values()]


def attach_static_input_scale(weight: torch.Tensor, scale: float) -> None:
    """Keep the calibrated activation scale of the linear that owns `weight` on that weight."""
    setattr(weight, _STATIC_SCALE_ATTR, torch.tensor(scale, dtype=torch.float32, device=weight.device))


def static_input_scale(weight: torch.Tensor) -> torch.Tensor:
    scale = getattr(weight, _STATIC_SCALE_ATTR, None)
    if scale is None:
        raise RuntimeError(
            "fx_fp8: no static activation scale attached to this weight (a graph compiled for another "
            "model instance?); call fx_fp8.prepare_model(model, config) before torch.compile"
        )
    return scale


class QuantizedLinear(nn.Module):
    """A linear layer holding only a quantized weight (float8_e4m3fn or int8) and fp32 scales.

    `.to(dtype)` / `.half()` convert the bias and the output dtype and leave the
    quantized weight and its scales as they are; `.to(device)` moves everything.
    """

    _FROZEN_DTYPE = ("weight", "weight_scale", "input_scale", "input_smoothing")

    def __init__(self, weight_q, weight_scale, bias, *, method, weight_granularity, weight_block, act_granularity,
                 input_scale: Optional[torch.Tensor] = None, orig_dtype=torch.bfloat16,
                 input_smoothing: Optional[torch.Tensor] = None):
        """`input_smoothing`: 1/s (fp32 [in_features]) when the weight was quantized as W * s
        (SmoothQuant): the input is multiplied by it before it is quantized."""
        super().__init__()
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]
        self.weight = nn.Parameter(weight_q, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_smoothing", input_smoothing)
        self.method = method
        self.weight_granularity = weight_granularity
        self.weight_block = list(weight_block or [])
        self.act_granularity = act_granularity
        self.orig_dtype = orig_dtype

    def forward(self, x):
        # Eagerly the lowering follows the device; under fx_fp8's backends the linear pass
        # rewrites this call into the compiled form for the chosen lowering.
        return torch.ops.fx_fp8.quantized_linear(
            x, self.weight, self.weight_scale, self.bias, self.input_scale, self.input_smoothing, method=self.method,
            weight_granularity=self.weight_granularity, weight_block=self.weight_block,
            act_granularity=self.act_granularity, lowering=resolve_lowering_name("auto", x.device),
        )

    def _apply(self, fn, recurse=True):
        frozen = {}
        for name in self._FROZEN_DTYPE:
            store = self._parameters if name in self._parameters else self._buffers
            frozen[name] = (store, store.pop(name))
        try:
            super()._apply(fn, recurse)
        finally:
            for name, (store, t) in frozen.items():
                if t is not None:
                    moved = fn(t)  # only its device is kept: a dtype cast would destroy the quantized data
                    moved = moved if moved.dtype == t.dtype else t.to(moved.device)
                    t = nn.Parameter(moved, requires_grad=False) if isinstance(t, nn.Parameter) else moved
                store[name] = t
        if self.bias is not None:
            self.orig_dtype = self.bias.dtype
        else:
            probe = fn(torch.empty((), dtype=self.orig_dtype))
            self.orig_dtype = probe.dtype if probe.is_floating_point() else self.orig_dtype
        return self

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.method} {self.weight_granularity} scales"
                + (", smoothed inputs" if self.input_smoothing is not None else ""))


def reachable_tensor_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from a model or compiled model:
    parameters, buffers, and the quantized copies kept on its weights."""
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
    for t in tensors:
        for wq, ws in quantized_copies(t):
            add(wq)
            add(ws)
    return total
