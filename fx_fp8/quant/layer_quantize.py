"""One linear at a time: what a full-precision weight becomes while a checkpoint is being read.

Load-time quantization (fx_fp8/pipeline/diffusers_quantizer.py) sees each weight once, as the loader
hands it over, and must never hold more than that one full-precision layer. This module
decides and builds one layer:
* which linears are quantized, and how: fx_fp8.quant.linear_plan.plan_linear, the plan prepare_model
  and the linear pass use (ignored_layers, the sensitive-layer name patterns, dtype, shape,
  min_features; weight-only storage as the device's lowering takes it), so load time and
  prepare time choose the same layers and recipes; a per-GPU tune table (quantization_config.kernel
  auto) is not followed, since it is looked up at the token count M no checkpoint holds: each such
  plan's reason and an INFO line say so (prepare_model on example inputs follows it);
* the quantized weight: WeightRecipe.quantize applied to slices of rows, moved to the target
  device one slice at a time, so the device never holds the full-precision layer and the
  float32 workspace of quantizing stays a fraction of one layer (ROW_SLICES, SLICE_ELEMENTS). Per-channel and block
  scales are computed row by row (block: whole blocks of rows), so the slices give exactly
  the bytes of quantizing the layer whole; per-tensor scales need the whole layer at once.
Nothing here imports diffusers.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops.formats import METHODS
from fx_fp8.ops.lowering import get_lowering, resolve_lowering_name
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.linear_plan import LinearPlan, plan_linear
from fx_fp8.quant.recipe import WeightRecipe
from fx_fp8.quant.rules import sensitive_reason
from fx_fp8.quant.tuned_plan import rules_plan

#: layer_kind's kinds of a quantized layer
W8A8, WEIGHT_ONLY_KIND = "quantized", "weight_only"
#: a layer is quantized in at least this many slices of rows, each of at most SLICE_ELEMENTS weights
#: (quantizing a slice makes about three float32 copies of it: 12 MiB at most, and at most 3/8 of the
#: layer's bf16 bytes; 0.11 of Flux's largest layer, 3072 -> 18432)
ROW_SLICES = 16
SLICE_ELEMENTS = 2**20
#: why load-time quantization never follows a tune table
TABLE_NOT_APPLIED = (
    "M unknown at load time; planned by the rules (load without quantization_config, then "
    "fx_fp8.prepare_model(model, config, example_inputs=...) to follow it)"
)


def check_load_time_config(cfg: FP8Config) -> None:
    """Raise ValueError for settings that load-time quantization cannot honour, naming them."""
    qcfg = cfg.quantization_config
    if not cfg.linear_enabled:
        raise ValueError(
            "quantization is None: load-time quantization would quantize no linear; give "
            "quantization 'fp8' or 'int8' (or load the model without a quantization_config)"
        )
    if qcfg.activation_scheme == "static" or qcfg.smoothing_alpha is not None:
        what = (
            "activation_scheme 'static'"
            if qcfg.activation_scheme == "static"
            else f"smoothing_alpha {qcfg.smoothing_alpha:g}"
        )
        raise ValueError(
            f"quantization_config {what} needs a calibration of the loaded model, which load-time "
            "quantization does not have: load the model without quantization_config, run "
            "fx_fp8.calibrate, then fx_fp8.prepare_model(model, config)"
        )


def layer_plan(
    name: str, in_features: int, out_features: int, dtype: torch.dtype, cfg: FP8Config, device="cpu"
) -> LinearPlan:
    """The plan of the linear `name` whose weight lives on `device`: prepare_model's, without
    example inputs (the sensitive layers found by name; a tune table that applies to `device` is not
    followed, M being unknown: the plan's reason says so)."""
    device = torch.device(device)
    lowering = get_lowering(resolve_lowering_name(cfg.lowering, device))
    qcfg = cfg.quantization_config
    plan = plan_linear(name, in_features, out_features, dtype, qcfg, lowering=lowering)
    # a tune table is looked up at the linear's token count M, which no checkpoint says: the rules' plan,
    # its reason saying the table was not applied (a guessed M would be a decision nobody measured)
    return rules_plan(
        plan, qcfg, lowering, device, sensitive_reason(name) is not None, "load-time quantization", TABLE_NOT_APPLIED
    )


def layer_kind(
    name: str, in_features: int, out_features: int, dtype: torch.dtype, cfg: FP8Config
) -> tuple[str, Optional[str]]:
    """("quantized" | "weight_only" | "native", why) of the linear `name` (layer_plan's kind)."""
    plan = layer_plan(name, in_features, out_features, dtype, cfg)
    return (W8A8 if plan.w8a8 else plan.kind), plan.reason


def slice_rows(weight_recipe: WeightRecipe, out_features: int, in_features: int, slices: int = ROW_SLICES) -> int:
    """Rows per slice: a multiple of the scale block's rows, at most out_features / slices and
    SLICE_ELEMENTS weights (at least one block of rows); every row at once for per-tensor scales
    (one scale over the whole weight)."""
    if weight_recipe.granularity == "tensor":
        return max(out_features, 1)
    unit = weight_recipe.block[0] if weight_recipe.granularity == "block" else 1
    rows = min(math.ceil(out_features / slices), SLICE_ELEMENTS // max(in_features, 1))
    return max(unit, math.ceil(rows / unit) * unit)


def quantize_by_rows(
    weight_recipe: WeightRecipe, weight: torch.Tensor, device=None, slices: int = ROW_SLICES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, fp32 scale) on `device` (default: the weight's), the bytes of
    weight_recipe.quantize(weight), made from slices of rows moved to `device` one at a time."""
    if weight.dim() != 2:
        raise ValueError(f"a weight to quantize must be [out, in], got shape {list(weight.shape)}")
    device = weight.device if device is None else torch.device(device)
    rows = slice_rows(weight_recipe, weight.shape[0], weight.shape[1], slices)
    if rows >= weight.shape[0]:
        return weight_recipe.quantize(weight.to(device))
    wq = torch.empty(weight.shape, dtype=METHODS[weight_recipe.method][0], device=device)
    scales = []
    for start in range(0, weight.shape[0], rows):
        q, s = weight_recipe.quantize(weight[start : start + rows].to(device))
        wq[start : start + q.shape[0]].copy_(q)
        scales.append(s)
        del q
    return wq, torch.cat(scales)


def quantized_linear(
    weight: torch.Tensor, bias: Optional[torch.Tensor], plan: LinearPlan, device=None
) -> QuantizedLinear:
    """The QuantizedLinear of one full-precision linear as its `plan` says, on `device`; its output
    dtype is the weight's (as prepare_model's). `bias` may still be on the meta device (loaded later)."""
    wq, ws = quantize_by_rows(plan.quantized_recipe(), weight, device)
    return QuantizedLinear.from_plan(plan, wq, ws, bias, orig_dtype=weight.dtype)


def scale_shape(weight_recipe: WeightRecipe, out_features: int, in_features: int) -> tuple:
    """The shape of WeightRecipe.quantize's scale for an [out, in] weight."""
    if weight_recipe.granularity == "tensor":
        return ()
    if weight_recipe.granularity == "channel":
        return (out_features, 1)
    br, bc = weight_recipe.block
    return (-(-out_features // br), -(-in_features // bc))


def empty_quantized_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    weight_recipe: WeightRecipe,
    act_granularity: str,
) -> QuantizedLinear:
    """A QuantizedLinear on the meta device, shaped for a checkpoint that holds the layer
    quantized by `weight_recipe` (the loader then sets its weight, weight_scale and bias)."""
    meta = torch.device("meta")
    wq = torch.empty(out_features, in_features, dtype=METHODS[weight_recipe.method][0], device=meta)
    ws = torch.empty(scale_shape(weight_recipe, out_features, in_features), dtype=torch.float32, device=meta)
    b = torch.empty(out_features, dtype=dtype, device=meta) if bias else None
    return QuantizedLinear.from_plan(LinearPlan.stored(weight_recipe, act_granularity), wq, ws, b, orig_dtype=dtype)
