"""Calibration: static activation scales and per-channel activation statistics.

`calibrate` runs the model on real inputs and records, per linear that prepare_model and
the backend quantize (fx_fp8.rules.is_plain_linear), the
largest |input| (the per-tensor static scale, max|x| / 448) and the largest
|input| of every input channel ("channel_amax", what SmoothQuant-style
smoothing needs: quantization_config.smoothing_alpha). The JSON file keeps the
format name of the first version: "channel_amax" is an extra, optional
section, so files without it still load, and readers that do not know it
ignore it.

calibrate(..., per_step=True) also records the largest |input| per group of
denoising steps (the step the pipeline publishes: fx_fp8.publish_steps /
set_step): the sections "step_groups" ([[first, last], ...]) and "step_scales"
({linear name: [scale per group]}). The per-tensor scale stays the maximum over
all steps, so a reader that ignores the step sections uses one static scale.
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
from fx_fp8.selectors import parse_selector
from fx_fp8.steps import current_step

FORMAT = "fx_fp8.activation_scales/1"
#: the optional section of per-input-channel |x| maxima (a list of floats per linear)
CHANNEL_SECTION = "channel_amax"
#: the optional per-step sections: the step groups ([first, last] inclusive) and each linear's scale per group
GROUPS_SECTION, STEP_SECTION = "step_groups", "step_scales"


class ActivationScales(MappingABC):
    """What fx_fp8.calibrate measured: a mapping {linear name: static scale (max|x| / 448)}
    that also carries `channel_amax` ({linear name: fp32 CPU tensor [in_features]}, or None
    for calibrations made before per-channel statistics existed).

    It is a read-only Mapping: it compares equal to a plain dict of the same scales and can be
    given as quantization_config.activation_scales directly; copies of a config share it.

    With per-step scales (`calibrate(..., per_step=True)`), `step_groups` is a tuple of
    (first, last) inclusive step ranges and `step_scales` maps each linear to an fp32 CPU
    tensor [len(step_groups)] of its scale per group; the per-tensor scales stay the maximum
    over all steps (what a static linear uses when no step is published).
    """

    def __init__(self, scales: Mapping[str, float], channel_amax: Optional[Mapping[str, torch.Tensor]] = None, *,
                 where: str = "activation_scales", step_groups=None,
                 step_scales: Optional[Mapping[str, torch.Tensor]] = None):
        self._scales = dict(scales)
        self._channel = dict(channel_amax) if channel_amax is not None else None
        self.where = where
        if (step_groups is None) != (step_scales is None):
            raise ValueError(f"per-step activation scales in {where} need both {GROUPS_SECTION!r} and "
                             f"{STEP_SECTION!r}")
        self._groups = check_step_groups(step_groups, where) if step_groups is not None else None
        self._steps = None
        if step_scales is not None:
            self._steps = {str(n): _step_vector(n, v, len(self._groups), where) for n, v in step_scales.items()}
            if set(self._steps) != set(self._scales):
                odd = sorted(set(self._steps) ^ set(self._scales))
                raise ValueError(f"{STEP_SECTION!r} in {where} must name the same linears as its scales; these "
                                 f"are in only one of them: {odd[:5]}")

    # Mapping over the per-tensor scales
    def __getitem__(self, name):
        return self._scales[name]

    def __iter__(self):
        return iter(self._scales)

    def __len__(self):
        return len(self._scales)

    def __repr__(self):
        extra = f", channel_amax for {len(self._channel)} linears" if self._channel is not None else ""
        if self._groups is not None:
            extra += f", per-step scales for step groups {format_step_groups(self._groups)}"
        return f"ActivationScales({len(self._scales)} scales{extra})"

    def __deepcopy__(self, memo):  # read-only: dataclasses.asdict / replace of a config share it
        return self

    @property
    def channel_amax(self) -> Optional[Mapping[str, torch.Tensor]]:
        return MappingProxyType(self._channel) if self._channel is not None else None

    @property
    def per_step(self) -> bool:
        return self._groups is not None

    @property
    def step_groups(self) -> Optional[tuple[tuple[int, int], ...]]:
        """The (first, last) inclusive step ranges of the per-step scales, or None."""
        return self._groups

    @property
    def step_scales(self) -> Optional[Mapping[str, torch.Tensor]]:
        """{linear name: fp32 CPU tensor [len(step_groups)]} (max|x| / 448 per group), or None."""
        return MappingProxyType(self._steps) if self._steps is not None else None

    def single(self) -> "ActivationScales":
        """The same calibration with one static scale per linear (the per-step sections dropped)."""
        return ActivationScales(self._scales, self._channel, where=self.where)

    def regroup(self, step_groups) -> "ActivationScales":
        """A per-step calibration of one group per step (calibrate(..., per_step=True)) with its steps
        grouped as calibrate's `step_groups` would have (an int n or groups like "0-4,5-9"), without
        running the model again: each group's scale is the largest of its steps'."""
        if self._groups is None or any(lo != hi for lo, hi in self._groups):
            raise ValueError(f"regroup needs a calibration with one step per group (calibrate(..., per_step=True) "
                             f"without step_groups); {self.where} has "
                             + (f"step groups {format_step_groups(self._groups)}" if self._groups
                                else "no per-step scales"))
        seen = [lo for lo, _ in self._groups]
        groups = _group_steps(seen, step_groups)
        index = [[i for i, s in enumerate(seen) if lo <= s <= hi] for lo, hi in groups]
        steps = {n: torch.stack([t[i].max() for i in index]) for n, t in self._steps.items()}
        return ActivationScales(self._scales, self._channel, where=self.where, step_groups=groups, step_scales=steps)

    def to_json(self) -> dict:
        data = {"format": FORMAT, "scales": dict(self._scales)}
        if self._channel is not None:
            data[CHANNEL_SECTION] = {n: [float(v) for v in t.tolist()] for n, t in self._channel.items()}
        if self._groups is not None:
            data[GROUPS_SECTION] = [[lo, hi] for lo, hi in self._groups]
            data[STEP_SECTION] = {n: [float(v) for v in t.tolist()] for n, t in self._steps.items()}
        return data


def calibrate(model: nn.Module, run: Callable[[nn.Module], object] | Iterable, *,
              progress: bool = False, per_step: bool = False, step_groups=None) -> ActivationScales:
    """Run the (uncompiled) model on a few real inputs and return per-linear scales
    (max |input| / 448) keyed by module name, with the per-input-channel maxima of |input|
    (`.channel_amax`, for quantization_config.smoothing_alpha).

    `run` is either a callable `run(model)` that does the forward passes, or an
    iterable of kwargs dicts / argument tuples fed to `model`.

    per_step=True also records the maxima per denoising step: every model call must see a
    published step (run the pipeline inside `with fx_fp8.publish_steps(pipe):`, or
    set_step / denoising_step in a custom loop). `step_groups` says which steps share a
    scale: None (each step seen its own group), an int n (the steps seen, first to last,
    cut into n contiguous groups of near-equal length), or a string / list of groups
    "0-4,5-9" (each comma-separated range or step one group; groups may not overlap and
    every step seen must be in one). A static linear then quantizes with the scale of the
    group of the published step, looked up per call (no recompile).
    """
    if not isinstance(per_step, bool):
        raise ValueError(f"invalid per_step {per_step!r}: expected True or False")
    if step_groups is not None and not per_step:
        raise ValueError(f"step_groups={step_groups!r} needs per_step=True")
    amax: dict[str, float] = {}
    channel: dict[str, torch.Tensor] = {}
    by_step: dict[str, dict[int, float]] = {}
    hooks = []

    def hook_for(name):
        def hook(_mod, args):
            x = args[0].detach()
            per_channel = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            seen = channel.get(name)
            channel[name] = per_channel if seen is None else torch.maximum(seen, per_channel)
            top = float(per_channel.max())
            amax[name] = max(amax.get(name, 0.0), top)
            if per_step:
                step = current_step()
                if step is None:
                    raise ValueError("calibrate(per_step=True): the model was called with no denoising step "
                                     "published; run the pipeline inside `with fx_fp8.publish_steps(pipe):`, "
                                     "or publish it with fx_fp8.set_step / fx_fp8.denoising_step")
                steps = by_step.setdefault(name, {})
                steps[step] = max(steps.get(step, 0.0), top)
        return hook

    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the names of the model it wraps
    check_not_prepared(model, "it cannot be calibrated (its linears no longer see their original weights)",
                       "calibrate the original model, then prepare it with that calibration")
    if step_groups is not None:  # a bad grouping fails before the (long) calibration run
        if isinstance(step_groups, bool) or not isinstance(step_groups, int):
            parse_step_groups(step_groups)
        elif step_groups < 1:
            raise ValueError(f"invalid step_groups {step_groups}: expected a number of groups >= 1")
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
    scales = {name: max(v, 1e-12) / FP8_MAX for name, v in amax.items()}
    groups = per_layer = None
    if per_step:
        groups = _group_steps(sorted({s for steps in by_step.values() for s in steps}), step_groups)
        per_layer = {}
        for name, steps in by_step.items():
            # a group in which this layer ran on no step (a layer some steps skip): its all-steps maximum
            per_layer[name] = torch.tensor(
                [max(max((v for s, v in steps.items() if lo <= s <= hi), default=amax[name]), 1e-12) / FP8_MAX
                 for lo, hi in groups], dtype=torch.float32)
    return ActivationScales(scales, {name: t.cpu() for name, t in channel.items()}, where="fx_fp8.calibrate",
                            step_groups=groups, step_scales=per_layer)


# -- step groups -----------------------------------------------------------------------------
def parse_step_groups(value, what: str = "step_groups") -> tuple[tuple[int, int], ...]:
    """"0-4,5-9" / ["0-4", "5-9"] / [(0, 4), (5, 9)] -> ((0, 4), (5, 9)): each comma-separated
    step or inclusive range is one group; groups must not overlap."""
    if isinstance(value, str):
        tokens = [t for t in value.split(",")]
        if not value.strip():
            raise ValueError(f"invalid {what} {value!r}: expected groups like '0-4,5-9'")
    elif isinstance(value, (list, tuple)) and value:
        tokens = list(value)
    else:
        raise ValueError(f"invalid {what} {value!r}: expected an int (number of groups) or groups like '0-4,5-9'")
    groups = []
    for token in tokens:
        if isinstance(token, (list, tuple)) and len(token) == 2:
            lo, hi = token
        elif isinstance(token, int) and not isinstance(token, bool):
            lo = hi = token
        elif isinstance(token, str):
            sel = parse_selector(token, what=what)
            if len(sel.ranges) != 1:
                raise ValueError(f"invalid group {token!r} in {what} {value!r}: expected one step or range 'a-b'")
            ((lo, hi),) = sel.ranges
        else:
            raise ValueError(f"invalid group {token!r} in {what} {value!r}: expected a step or a range 'a-b'")
        groups.append((lo, hi))
    return check_step_groups(groups, f"{what} {value!r}")


def check_step_groups(groups, where: str) -> tuple[tuple[int, int], ...]:
    """Groups as sorted (first, last) inclusive ranges of steps >= 0 that do not overlap."""
    out = []
    for g in groups:
        if (not isinstance(g, (list, tuple)) or len(g) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in g) or g[1] < g[0]):
            raise ValueError(f"invalid step group {g!r} in {where}: expected [first, last] steps, "
                             "0 <= first <= last")
        out.append((int(g[0]), int(g[1])))
    if not out:
        raise ValueError(f"no step groups in {where}")
    out.sort()
    for (lo0, hi0), (lo1, hi1) in zip(out, out[1:]):
        if lo1 <= hi0:
            raise ValueError(f"step groups {lo0}-{hi0} and {lo1}-{hi1} overlap in {where}")
    return tuple(out)


def format_step_groups(groups) -> str:
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in groups)


def _group_steps(seen: list[int], step_groups) -> tuple[tuple[int, int], ...]:
    if step_groups is None:
        return tuple((s, s) for s in seen)
    if isinstance(step_groups, int) and not isinstance(step_groups, bool):
        span = seen[-1] - seen[0] + 1
        if not 1 <= step_groups <= span:
            raise ValueError(f"invalid step_groups {step_groups}: the calibration saw steps "
                             f"{format_step_groups(_runs(seen))}, so between 1 and {span} groups")
        bounds = [seen[0] + (span * i) // step_groups for i in range(step_groups + 1)]
        groups = tuple((bounds[i], bounds[i + 1] - 1) for i in range(step_groups))
    else:
        groups = parse_step_groups(step_groups)
    outside = [s for s in seen if not any(lo <= s <= hi for lo, hi in groups)]
    if outside:
        raise ValueError(f"step_groups {step_groups!r}: the calibration ran step(s) "
                         f"{format_step_groups(_runs(outside))} that are in no group")
    empty = [(lo, hi) for lo, hi in groups if not any(lo <= s <= hi for s in seen)]
    if empty:
        raise ValueError(f"step_groups {step_groups!r}: the calibration ran no step of group(s) "
                         f"{format_step_groups(empty)} (it saw steps {format_step_groups(_runs(seen))})")
    return groups


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return [(lo, hi) for lo, hi in out]


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
        raise ValueError(f"quantization_config.smoothing_alpha={smoothing_alpha!r} is not combined with per-step "
                         f"activation scales ({scales.where} has step groups "
                         f"{format_step_groups(scales.step_groups)}): the calibration keeps per-channel maxima "
                         "over all steps only. Use one of them, or the calibration's .single() scales")


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
            return _parse(data.get("scales", {}), data.get(CHANNEL_SECTION), "activation_scales",
                          data.get(GROUPS_SECTION), data.get(STEP_SECTION))
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
    return _parse(data["scales"], data.get(CHANNEL_SECTION), repr(path), data.get(GROUPS_SECTION),
                  data.get(STEP_SECTION))


def _parse(scales, channel, where: str, step_groups=None, step_scales=None) -> ActivationScales:
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
    if step_groups is not None and not isinstance(step_groups, (list, tuple)):
        raise ValueError(f"invalid {GROUPS_SECTION!r} section in {where}: expected a list of [first, last] steps")
    if step_scales is not None and not isinstance(step_scales, Mapping):
        raise ValueError(f"invalid {STEP_SECTION!r} section in {where}: expected a mapping "
                         "{layer name: [scale per step group]}")
    return ActivationScales(out, per_channel, where=where, step_groups=step_groups, step_scales=step_scales)


def _step_vector(name, values, n: int, where: str) -> torch.Tensor:
    bad = f"invalid {STEP_SECTION} for {name!r} in {where}"
    if isinstance(values, torch.Tensor):
        t = values.detach().float().cpu().reshape(-1)
    elif isinstance(values, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        t = torch.tensor([float(v) for v in values], dtype=torch.float32)
    else:
        raise ValueError(f"{bad}: expected a list of numbers (a scale per step group)")
    if t.numel() != n:
        raise ValueError(f"{bad}: {t.numel()} scales for {n} step groups")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        i = int(torch.nonzero(~torch.isfinite(t) | (t <= 0))[0])
        raise ValueError(f"{bad}: group {i} has scale {float(t[i])!r}, expected a finite number > 0")
    return t


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
