"""A calibration's data: ActivationScales (static scales, per-channel maxima, per-step scales)
and its JSON file, written and read back with every value checked."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping as MappingABC
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from fx_fp8.config.step_groups import check_step_groups, format_step_groups, group_steps

FORMAT = "fx_fp8.quant.activation_scales/1"
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

    def __init__(
        self,
        scales: Mapping[str, float],
        channel_amax: Optional[Mapping[str, torch.Tensor]] = None,
        *,
        where: str = "activation_scales",
        step_groups=None,
        step_scales: Optional[Mapping[str, torch.Tensor]] = None,
    ):
        self._scales = dict(scales)
        self._channel = dict(channel_amax) if channel_amax is not None else None
        self.where = where
        if (step_groups is None) != (step_scales is None):
            raise ValueError(f"per-step activation scales in {where} need both {GROUPS_SECTION!r} and {STEP_SECTION!r}")
        self._groups = check_step_groups(step_groups, where) if step_groups is not None else None
        self._steps = None
        if step_scales is not None:
            self._steps = {str(n): _step_vector(n, v, len(self._groups), where) for n, v in step_scales.items()}
            if set(self._steps) != set(self._scales):
                odd = sorted(set(self._steps) ^ set(self._scales))
                raise ValueError(
                    f"{STEP_SECTION!r} in {where} must name the same linears as its scales; these "
                    f"are in only one of them: {odd[:5]}"
                )

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
            raise ValueError(
                f"regroup needs a calibration with one step per group (calibrate(..., per_step=True) "
                f"without step_groups); {self.where} has "
                + (f"step groups {format_step_groups(self._groups)}" if self._groups else "no per-step scales")
            )
        seen = [lo for lo, _ in self._groups]
        groups = group_steps(seen, step_groups)
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
            return _parse(
                data.get("scales", {}),
                data.get(CHANNEL_SECTION),
                "activation_scales",
                data.get(GROUPS_SECTION),
                data.get(STEP_SECTION),
            )
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
    return _parse(
        data["scales"], data.get(CHANNEL_SECTION), repr(path), data.get(GROUPS_SECTION), data.get(STEP_SECTION)
    )


def _parse(scales, channel, where: str, step_groups=None, step_scales=None) -> ActivationScales:
    if not isinstance(scales, Mapping):
        raise ValueError(f"invalid scales section in {where}: expected a mapping {{layer name: scale}}")
    out = {}
    for name, value in scales.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"invalid activation scale {value!r} for {name!r} in {where}: expected a finite number > 0"
            )
        out[str(name)] = float(value)
    per_channel = None
    if channel is not None:
        if not isinstance(channel, Mapping):
            raise ValueError(
                f"invalid {CHANNEL_SECTION!r} section in {where}: expected a mapping "
                "{layer name: [max |x| per input channel]}"
            )
        per_channel = {str(name): _channel_vector(name, values, where) for name, values in channel.items()}
    if step_groups is not None and not isinstance(step_groups, (list, tuple)):
        raise ValueError(f"invalid {GROUPS_SECTION!r} section in {where}: expected a list of [first, last] steps")
    if step_scales is not None and not isinstance(step_scales, Mapping):
        raise ValueError(
            f"invalid {STEP_SECTION!r} section in {where}: expected a mapping {{layer name: [scale per step group]}}"
        )
    return ActivationScales(out, per_channel, where=where, step_groups=step_groups, step_scales=step_scales)


def _step_vector(name, values, n: int, where: str) -> torch.Tensor:
    bad = f"invalid {STEP_SECTION} for {name!r} in {where}"
    if isinstance(values, torch.Tensor):
        t = values.detach().float().cpu().reshape(-1)
    elif isinstance(values, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
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
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        t = torch.tensor([float(v) for v in values], dtype=torch.float32)
    else:
        raise ValueError(f"{bad}: expected a list of numbers (max |x| per input channel)")
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{bad}: expected a non-empty list of numbers, got shape {list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        i = int(torch.nonzero(~torch.isfinite(t) | (t < 0))[0])
        raise ValueError(f"{bad}: channel {i} is {float(t[i])!r}, expected a finite number >= 0")
    return t
