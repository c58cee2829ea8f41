"""Calibration: static activation scales and per-channel activation statistics.

`calibrate` runs the model on real inputs and records, per linear that prepare_model and
the backend quantize (fx_fp8.rules.is_plain_linear), the
largest |input| (the per-tensor static scale, max|x| / 448) and the largest
|input| of every input channel ("channel_amax", what SmoothQuant-style
smoothing needs: quantization_config.smoothing_alpha). The JSON file keeps the
format name of the first version: "channel_amax" is an extra, optional
section, so files without it still load, and readers that do not know it
ignore it.
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping as MappingABC
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8.ops.quant import FP8_MAX, METHODS
from fx_fp8.rules import check_not_prepared, is_plain_linear

FORMAT = "fx_fp8.activation_scales/1"
#: the optional section of per-input-channel |x| maxima (a list of floats per linear)
CHANNEL_SECTION = "channel_amax"


class ActivationScales(MappingABC):
    """What fx_fp8.calibrate measured: a mapping {linear name: static scale (max|x| / 448)}
    that also carries `channel_amax` ({linear name: fp32 CPU tensor [in_features]}, or None
    for calibrations made before per-channel statistics existed).

    It is a read-only Mapping: it compares equal to a plain dict of the same scales and can be
    given as quantization_config.activation_scales directly; copies of a config share it.
    """

    def __init__(self, scales: Mapping[str, float], channel_amax: Optional[Mapping[str, torch.Tensor]] = None, *,
                 where: str = "activation_scales"):
        self._scales = dict(scales)
        self._channel = dict(channel_amax) if channel_amax is not None else None
        self.where = where

    # Mapping over the per-tensor scales
    def __getitem__(self, name):
        return self._scales[name]

    def __iter__(self):
        return iter(self._scales)

    def __len__(self):
        return len(self._scales)

    def __repr__(self):
        extra = f", channel_amax for {len(self._channel)} linears" if self._channel is not None else ""
        return f"ActivationScales({len(self._scales)} scales{extra})"

    def __deepcopy__(self, memo):  # read-only: dataclasses.asdict / replace of a config share it
        return self

    @property
    def channel_amax(self) -> Optional[Mapping[str, torch.Tensor]]:
        return MappingProxyType(self._channel) if self._channel is not None else None

    def to_json(self) -> dict:
        data = {"format": FORMAT, "scales": dict(self._scales)}
        if self._channel is not None:
            data[CHANNEL_SECTION] = {n: [float(v) for v in t.tolist()] for n, t in self._channel.items()}
        return data


def calibrate(model: nn.Module, run: Callable[[nn.Module], object] | Iterable, *,
              progress: bool = False) -> ActivationScales:
    """Run the (uncompiled) model on a few real inputs and return per-linear scales
    (max |input| / 448) keyed by module name, with the per-input-channel maxima of |input|
    (`.channel_amax`, for quantization_config.smoothing_alpha).

    `run` is either a callable `run(model)` that does the forward passes, or an
    iterable of kwargs dicts / argument tuples fed to `model`.
    """
    amax: dict[str, float] = {}
    channel: dict[str, torch.Tensor] = {}
    hooks = []

    def hook_for(name):
        def hook(_mod, args):
            x = args[0].detach()
            per_channel = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            seen = channel.get(name)
            channel[name] = per_channel if seen is None else torch.maximum(seen, per_channel)
            amax[name] = max(amax.get(name, 0.0), float(per_channel.max()))
        return hook

    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the names of the model it wraps
    check_not_prepared(model, "it cannot be calibrated (its linears no longer see their original weights)",
                       "calibrate the original model, then prepare it with that calibration")
    for name, module in model.named_modules():
        if is_plain_linear(module):
            hooks.append(module.register_forward_pre_hook(hook_for(name)))
    try:
        with torch.no_grad():
            if callable(run):
                run(model)
            else:
                for i, batch in enumerate(run):
                    if isinstance(batch, Mapping):
                        model(**batch)
                    else:
                        model(*batch)
                    if progress:
                        print(f"calibration batch {i + 1}", flush=True)
    finally:
        for h in hooks:
            h.remove()
    if not amax:
        raise ValueError("calibration saw no nn.Linear inputs (linears as fx_fp8.rules.is_plain_linear "
                         "defines them): did `run` call the model?")
    return ActivationScales({name: max(v, 1e-12) / FP8_MAX for name, v in amax.items()},
                            {name: t.cpu() for name, t in channel.items()}, where="fx_fp8.calibrate")


def save_activation_scales(scales: Mapping[str, float], path) -> None:
    """Write a calibration (ActivationScales, or a plain {name: scale} mapping) as JSON."""
    with open(path, "w") as f:
        json.dump(load_activation_scales(scales).to_json(), f, indent=1, sort_keys=True)


def load_activation_scales(source) -> ActivationScales:
    """A calibration -> ActivationScales ({module name: scale}, plus `channel_amax` when present).

    `source`: an ActivationScales, a mapping {name: scale}, the JSON dict of a file
    ({"format", "scales", optional "channel_amax"}), or the path of a file written by
    save_activation_scales. Every scale must be a finite number > 0 and every channel
    maximum a finite number >= 0; the error names the first layer that breaks the rule.
    Files are parsed once per (path, modification time).
    """
    if source is None:
        raise ValueError("no activation_scales given for activation_scheme 'static'")
    if isinstance(source, ActivationScales):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
        if "format" in data:
            return _parse(data.get("scales", {}), data.get(CHANNEL_SECTION), "activation_scales")
        return _parse(data, None, "activation_scales")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise ValueError(f"activation_scales file not found: {path!r}")
    st = os.stat(path)
    return _load_file(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _load_file(path: str, _mtime_ns: int, _size: int) -> ActivationScales:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("scales"), Mapping):
        raise ValueError(f"{path!r} is not an fx_fp8 activation-scales file (format {FORMAT!r})")
    return _parse(data["scales"], data.get(CHANNEL_SECTION), repr(path))


def _parse(scales, channel, where: str) -> ActivationScales:
    if not isinstance(scales, Mapping):
        raise ValueError(f"invalid scales section in {where}: expected a mapping {{layer name: scale}}")
    out = {}
    for name, value in scales.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"invalid activation scale {value!r} for {name!r} in {where}: "
                             "expected a finite number > 0")
        out[str(name)] = float(value)
    per_channel = None
    if channel is not None:
        if not isinstance(channel, Mapping):
            raise ValueError(f"invalid {CHANNEL_SECTION!r} section in {where}: expected a mapping "
                             "{layer name: [max |x| per input channel]}")
        per_channel = {str(name): _channel_vector(name, values, where) for name, values in channel.items()}
    return ActivationScales(out, per_channel, where=where)


def _channel_vector(name, values, where: str) -> torch.Tensor:
    bad = f"invalid {CHANNEL_SECTION} for {name!r} in {where}"
    if isinstance(values, torch.Tensor):
        t = values.detach().float().cpu()
    elif isinstance(values, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        t = torch.tensor([float(v) for v in values], dtype=torch.float32)
    else:
        raise ValueError(f"{bad}: expected a list of numbers (max |x| per input channel)")
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{bad}: expected a non-empty list of numbers, got shape {list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        i = int(torch.nonzero(~torch.isfinite(t) | (t < 0))[0])
        raise ValueError(f"{bad}: channel {i} is {float(t[i])!r}, expected a finite number >= 0")
    return t


# -- what the linear pass and prepare_model take from a calibration --------------------------
def channel_stats(source, *, what: str = "quantization_config.smoothing_alpha") -> Mapping[str, torch.Tensor]:
    """The per-channel |x| maxima of a calibration; a ValueError naming the missing key when the
    calibration has none (made before they existed) or none was given."""
    if source is None:
        raise ValueError(f"{what} needs quantization_config.activation_scales (a calibration from fx_fp8.calibrate)")
    scales = load_activation_scales(source)
    if scales.channel_amax is None:
        raise ValueError(f"{what} needs per-channel activation statistics, but the calibration in {scales.where} has "
                         f"no {CHANNEL_SECTION!r} section (written by an older fx_fp8.calibrate): recalibrate "
                         "with fx_fp8.calibrate and save it again")
    if not scales.channel_amax:
        raise ValueError(f"{what}: the {CHANNEL_SECTION!r} section of {scales.where} is empty")
    return scales.channel_amax


def check_channel_amax(name: str, amax: torch.Tensor, in_features: int) -> None:
    """A layer's channel maxima must have one value per input feature."""
    if amax.numel() != in_features:
        raise ValueError(f"{CHANNEL_SECTION} for {name!r} has {amax.numel()} values but the layer has {in_features} "
                         "input features (calibrated on another model?): recalibrate with fx_fp8.calibrate")


def method_scale(scale: float, method: str) -> float:
    """A calibrated scale (max|x| / 448, whatever the method) as the scale of `method`
    (max|x| / 127 for int8), so the calibrated maximum maps to the method's largest value."""
    qmax = METHODS[method][1]
    return float(scale) if qmax == FP8_MAX else float(scale) * FP8_MAX / qmax


def smoothed_static_scale(amax: torch.Tensor, inverse: torch.Tensor, method: str) -> float:
    """The static scale of a smoothed activation x / s: its calibrated maximum is max_j amax_j / s_j."""
    return max(float((amax.float() * inverse.float().cpu()).max()), 1e-12) / METHODS[method][1]


def check_scales_match(scales: Mapping, linear_names, what: str = "static activation scales",
                       one: str = "static activation scale") -> None:
    """Static scales (or channel statistics) keyed by names that match no linear of the model are
    an error, not a silent all-native run (e.g. scales calibrated on another model, or with
    `_orig_mod.` prefixes)."""
    names = set(linear_names)
    unknown = sorted(k for k in scales if k not in names)
    if unknown and len(unknown) == len(scales):
        raise ValueError(f"none of the {len(scales)} {what} names a linear of this model "
                         f"(first: {unknown[:3]}; model linears look like {sorted(names)[:3]}): "
                         "calibrate this model with fx_fp8.calibrate")
    if unknown:
        raise ValueError(f"{len(unknown)} {one}(s) name no linear of this model: {unknown[:5]}")
