"""What the linear pass and prepare_model take from a calibration: per-channel maxima for
smoothing, a calibrated scale in a method's range, the per-step lookup table, and the checks
that a calibration fits the model."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from fx_fp8.config.step_groups import format_step_groups
from fx_fp8.ops.formats import FP8_MAX, METHODS
from fx_fp8.quant.activation_scales import CHANNEL_SECTION, ActivationScales, load_activation_scales


def step_scale_table(scales: ActivationScales, name: str, scale_of: Callable[[float], float]):
    """(flat groups [first0, last0, first1, ...], [scale per group]) of one linear for the
    per-step lookup, each calibrated scale mapped through `scale_of` (method_scale); None when
    the calibration has no per-step scales."""
    if not isinstance(scales, ActivationScales) or not scales.per_step:
        return None
    flat = [v for g in scales.step_groups for v in g]
    return flat, [scale_of(float(v)) for v in scales.step_scales[name].tolist()]


def check_per_step_supported(scales, smoothing_alpha) -> None:
    """Per-step scales are not combined with smoothing: the smoothed activation's static scale
    needs per-channel maxima, which the calibration keeps over all steps only."""
    if isinstance(scales, ActivationScales) and scales.per_step and smoothing_alpha is not None:
        raise ValueError(
            f"quantization_config.smoothing_alpha={smoothing_alpha!r} is not combined with per-step "
            f"activation scales ({scales.where} has step groups "
            f"{format_step_groups(scales.step_groups)}): the calibration keeps per-channel maxima "
            "over all steps only. Use one of them, or the calibration's .single() scales"
        )


def channel_stats(source, *, what: str = "quantization_config.smoothing_alpha") -> Mapping[str, torch.Tensor]:
    """The per-channel |x| maxima of a calibration; a ValueError naming the missing key when the
    calibration has none (made before they existed) or none was given."""
    if source is None:
        raise ValueError(f"{what} needs quantization_config.activation_scales (a calibration from fx_fp8.calibrate)")
    scales = load_activation_scales(source)
    if scales.channel_amax is None:
        raise ValueError(
            f"{what} needs per-channel activation statistics, but the calibration in {scales.where} has "
            f"no {CHANNEL_SECTION!r} section (written by an older fx_fp8.calibrate): recalibrate "
            "with fx_fp8.calibrate and save it again"
        )
    if not scales.channel_amax:
        raise ValueError(f"{what}: the {CHANNEL_SECTION!r} section of {scales.where} is empty")
    return scales.channel_amax


def check_channel_amax(name: str, amax: torch.Tensor, in_features: int) -> None:
    """A layer's channel maxima must have one value per input feature."""
    if amax.numel() != in_features:
        raise ValueError(
            f"{CHANNEL_SECTION} for {name!r} has {amax.numel()} values but the layer has {in_features} "
            "input features (calibrated on another model?): recalibrate with fx_fp8.calibrate"
        )


def method_scale(scale: float, method: str) -> float:
    """A calibrated scale (max|x| / 448, whatever the method) as the scale of `method`
    (max|x| / 127 for int8), so the calibrated maximum maps to the method's largest value."""
    qmax = METHODS[method][1]
    return float(scale) if qmax == FP8_MAX else float(scale) * FP8_MAX / qmax


def smoothed_static_scale(amax: torch.Tensor, inverse: torch.Tensor, method: str) -> float:
    """The static scale of a smoothed activation x / s: its calibrated maximum is max_j amax_j / s_j."""
    return max(float((amax.float() * inverse.float().cpu()).max()), 1e-12) / METHODS[method][1]


def check_scales_match(
    scales: Mapping, linear_names, what: str = "static activation scales", one: str = "static activation scale"
) -> None:
    """Static scales (or channel statistics) keyed by names that match no linear of the model are
    an error, not a silent all-native run (e.g. scales calibrated on another model, or with
    `_orig_mod.` prefixes)."""
    names = set(linear_names)
    unknown = sorted(k for k in scales if k not in names)
    if unknown and len(unknown) == len(scales):
        raise ValueError(
            f"none of the {len(scales)} {what} names a linear of this model "
            f"(first: {unknown[:3]}; model linears look like {sorted(names)[:3]}): "
            "calibrate this model with fx_fp8.calibrate"
        )
    if unknown:
        raise ValueError(f"{len(unknown)} {one}(s) name no linear of this model: {unknown[:5]}")
