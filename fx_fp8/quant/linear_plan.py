"""LinearPlan: how one linear runs (FP8 / INT8 W8A8, weight-only, or native, and why), decided once.

`plan_linear` is the one function that decides, from one chain of reasons, in this order:
  quantization off -> ignored_layers -> sensitive layer -> weight dtype / features / size
  -> what the graph gives the linear (its input, its weight) -> calibration present
  -> what the lowering can run -> the step variant -> weight-only (sensitive, skipped step,
  a device without FP8/INT8 matrix units).
Its consumers, and no one else (tests/quant/test_linear_plan.py checks the call sites): the
linear pass and the pre-quantized pass (on FakeTensor metadata), prepare_model and the
load-time quantizer (fx_fp8/quant/layer_quantize.py; on real modules), adopt_prequantized and
the tiny model's fake quantization. Each native reason is written here once, and says what the
user can set to change it. QuantizedLinear.from_plan builds a prepared layer from a plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from fx_fp8.config.patterns import first_match
from fx_fp8.ops.formats import FLOAT_DTYPES, METHODS, WEIGHT_ONLY
from fx_fp8.quant.activation_scales import load_activation_scales
from fx_fp8.quant.linear_scales import (
    channel_stats,
    check_channel_amax,
    check_per_step_supported,
    method_scale,
    step_scale_table,
)
from fx_fp8.quant.recipe import WeightRecipe
from fx_fp8.quant.rules import sensitive_reason

#: the kinds of a plan besides the W8A8 methods (fp8, int8)
NATIVE, WEIGHT_ONLY_KIND = "native", "weight_only"
#: the native reason of every linear when linear quantization is off
QUANTIZATION_OFF = "linear quantization off (quantization=None)"


@dataclass(frozen=True)
class Calibration:
    """What a calibration gives the linears, loaded once (GraphPlan, prepare_model): static
    activation scales by linear name (activation_scheme static), per-channel maxima
    (smoothing_alpha). Both None when the config asks for neither."""

    scales: Optional[Mapping] = None
    channel: Optional[Mapping] = None

    @classmethod
    def load(cls, config) -> "Calibration":
        qcfg = config.quantization_config
        if not config.linear_enabled:
            return cls()
        scales = load_activation_scales(qcfg.activation_scales) if qcfg.activation_scheme == "static" else None
        check_per_step_supported(scales, qcfg.smoothing_alpha)
        # {linear name: max |x| per input channel} (raises, naming the key, when the calibration has none)
        channel = channel_stats(qcfg.activation_scales) if qcfg.smoothing_alpha is not None else None
        return cls(scales, channel)

    @property
    def per_step(self) -> bool:
        return bool(getattr(self.scales, "per_step", False))


@dataclass(frozen=True)
class LinearPlan:
    """How one linear runs. `kind`: "fp8" / "int8" (W8A8), "weight_only" (W8A16: quantized
    weight, unquantized activations) or "native"."""

    kind: str
    reason: Optional[str] = None  # native: why, and what to set to change it; weight-only: why
    recipe: Optional[WeightRecipe] = None  # how the weight is quantized (None: native, or weight-only
    # planned without a lowering to store it for)
    act: Optional[str] = None  # a QuantizedLinear's act_granularity: token / tensor / group / WEIGHT_ONLY
    static: bool = False  # activations quantized with a calibrated scale
    static_scale: Optional[float] = None  # that scale in the method's range (unsmoothed layers)
    step_scales: Optional[tuple] = None  # per-step scales: (flat step groups, [scale per group])
    smoothing_alpha: Optional[float] = None  # SmoothQuant alpha (with channel_amax)
    channel_amax: Optional[torch.Tensor] = field(default=None, compare=False)  # calibrated max |x| per channel
    warning: Optional[str] = None  # the lowering's message when it runs a W8A8 layer weight-only
    kernel: Optional[str] = None  # the candidate the tune table picked (fx-fp8 tune), when measured
    measurement: Optional[str] = None  # the measurement that pick came from (the report's text)
    timing: Optional[dict] = field(default=None, compare=False)  # {"pick": ms, "native": ms} of that measurement

    def __post_init__(self):
        if self.kind not in (NATIVE, WEIGHT_ONLY_KIND, *METHODS):
            raise ValueError(
                f"unknown linear plan kind {self.kind!r}: expected native, weight_only or one of {sorted(METHODS)}"
            )
        if self.kind == NATIVE and not self.reason:
            raise ValueError("a native linear plan needs its reason")

    @property
    def native(self) -> bool:
        return self.kind == NATIVE

    @property
    def weight_only(self) -> bool:
        return self.kind == WEIGHT_ONLY_KIND

    @property
    def w8a8(self) -> bool:
        return self.kind in METHODS

    def quantized_recipe(self) -> WeightRecipe:
        """The recipe of a quantized plan; a ValueError naming the kind (and why) for one without."""
        if self.recipe is None:
            raise ValueError(
                f"a {self.kind!r} linear plan has no quantization recipe" + (f" ({self.reason})" if self.reason else "")
            )
        return self.recipe

    @property
    def scheme(self) -> Optional[str]:
        """The activation quantization that runs: "static", or the module's act_granularity."""
        return "static" if self.static else self.act

    @classmethod
    def stored(cls, recipe: WeightRecipe, act: str, step_groups=None) -> "LinearPlan":
        """The plan a layer was quantized with, read back from where it was stored (a quantized
        checkpoint's record): its recipe and act_granularity, its per-step scale groups."""
        return cls(
            WEIGHT_ONLY_KIND if act == WEIGHT_ONLY else recipe.method,
            None,
            recipe,
            act,
            step_scales=(tuple(step_groups), None) if step_groups is not None else None,
        )


def native(reason: str) -> LinearPlan:
    return LinearPlan(NATIVE, reason)


def _rule_reason(name: str, in_features: int, out_features: int, dtype, qcfg, why: Optional[str]) -> Optional[str]:
    """The native reasons every consumer shares: ignored_layers, sensitive, dtype, shape, size."""
    hit = first_match(qcfg.ignored_layers, name)
    if hit is not None:
        return (
            f"ignored_layers pattern {hit!r} (remove it from quantization_config.ignored_layers to quantize this layer)"
        )
    if why is not None and qcfg.sensitive == "native":
        return f"{why}; kept native (sensitive: weight_only, or fp8 / quantize_sensitive: true, quantizes it)"
    if dtype not in FLOAT_DTYPES:
        return f"weight dtype {dtype} not supported (load the model in float32, bfloat16 or float16 to quantize it)"
    if in_features % 16 or out_features % 16:
        return (
            f"features {in_features}->{out_features} not multiples of 16 (FP8 matmul tiles; the layer's shape, "
            "no setting changes it)"
        )
    if min(in_features, out_features) < qcfg.min_features:
        return (
            f"small layer ({in_features}->{out_features}, below min_features={qcfg.min_features}): "
            "FP8 only costs time (lower quantization_config.min_features to quantize it)"
        )
    return None


def plan_linear(
    name: str,
    in_features: int,
    out_features: int,
    dtype,
    qcfg,
    *,
    sensitive: Optional[str] = None,
    enabled: bool = True,
    graph_reason: Optional[str] = None,
    calibration: Optional[Calibration] = None,
    lowering=None,
    values: Optional[tuple] = None,
    lowering_config=None,
    step_mode: Optional[str] = None,
    stored: Optional[WeightRecipe] = None,
) -> LinearPlan:
    """The plan of the linear `name` ([out_features, in_features] weight of `dtype`) under `qcfg`.

    `sensitive`: the structural reason the graph found (else the name patterns decide);
    `graph_reason`: why the graph or the model cannot give this linear what a quantized one needs
    (its input dtype, a weight that is no graph input, a transformers model's _keep_in_fp32_modules:
    fx_fp8/quant/keep_fp32.py), None when they can; `calibration`: checked to hold
    this layer (static scales, channel maxima), and the source of its static scale; `lowering`:
    the lowering that runs it (weight-only storage follows it); `values` ((x, w) fake values):
    the lowering is asked whether it runs them (about `lowering_config`, default `qcfg`), and
    whether it must run W8A8 weight-only; `step_mode` ("native" / "weight_only"): the skipped step
    variant's mode; `stored`: a pre-quantized weight's own recipe (its layout is kept).
    """
    if not enabled:
        return native(QUANTIZATION_OFF)
    why = sensitive_reason(name, sensitive) if qcfg.sensitive != "fp8" else None
    reason = _rule_reason(name, in_features, out_features, dtype, qcfg, why) or graph_reason
    if reason is not None:
        return native(reason)
    sensitive_wo = why is not None  # sensitive: weight_only (native returned above)
    cal = calibration or Calibration()
    if not sensitive_wo:
        if cal.scales is not None and name not in cal.scales:
            return native(
                "no static activation scale for this layer (recalibrate with fx_fp8.calibrate, or use "
                "quantization_config.activation_scheme: dynamic)"
            )
        if cal.channel is not None and name not in cal.channel:
            return native(
                "no channel statistics for smoothing_alpha in the calibration (recalibrate with fx_fp8.calibrate)"
            )
    if values is not None and lowering is not None:
        reason = lowering.linear_reason(values[0], values[1], lowering_config or qcfg)
        if reason is not None:
            return native(reason)
    step_why = f"skipped step variant (quantization_config.skip_steps, {step_mode})"
    if step_mode == "native":
        return native(step_why)
    w8a8_recipe = stored or WeightRecipe.w8a8(qcfg)
    if sensitive_wo:  # W8A16: the storage the device's weight-only matmul takes
        recipe = stored or (WeightRecipe.weight_only(qcfg, lowering) if lowering is not None else None)
        return LinearPlan(
            WEIGHT_ONLY_KIND,
            f"{why}; weight-only (sensitive: weight_only): quantized weights, unquantized activations",
            recipe,
            WEIGHT_ONLY,
        )
    if step_mode == "weight_only":
        return LinearPlan(WEIGHT_ONLY_KIND, step_why, w8a8_recipe, WEIGHT_ONLY)
    warning = (
        lowering.weight_only(values[1], qcfg) if values is not None and lowering is not None and not stored else None
    )
    if warning:
        return LinearPlan(WEIGHT_ONLY_KIND, None, w8a8_recipe, WEIGHT_ONLY, warning=warning)
    static = qcfg.activation_scheme == "static" and stored is None
    act = qcfg.activation_granularity if static or stored else qcfg.act_granularity
    plan = LinearPlan(w8a8_recipe.method, None, w8a8_recipe, act, static=static)
    if cal.channel is not None:
        amax = cal.channel[name]
        check_channel_amax(name, amax, in_features)
        return dataclasses.replace(plan, smoothing_alpha=qcfg.smoothing_alpha, channel_amax=amax)
    if static and cal.scales is not None:
        method = plan.recipe.method
        return dataclasses.replace(
            plan,
            static_scale=method_scale(cal.scales[name], method),
            step_scales=step_scale_table(cal.scales, name, lambda v: method_scale(v, method)),
        )
    return plan
