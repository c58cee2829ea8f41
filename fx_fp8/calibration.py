"""Static activation scales for FP8 linears: calibrate on real inputs, save, load."""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from fx_fp8.ops.quant import FP8_MAX

FORMAT = "fx_fp8.activation_scales/1"


def calibrate(model: nn.Module, run: Callable[[nn.Module], object] | Iterable, *, progress: bool = False) -> dict[str, float]:
    """Run the (uncompiled) model on a few real inputs and return per-linear scales
    (max |input| / 448) keyed by module name.

    `run` is either a callable `run(model)` that does the forward passes, or an
    iterable of kwargs dicts / argument tuples fed to `model`.
    """
    amax: dict[str, float] = {}
    hooks = []

    def hook_for(name):
        def hook(_mod, args):
            x = args[0]
            amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().max()))
        return hook

    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the names of the model it wraps
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
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
        raise ValueError("calibration saw no nn.Linear inputs: did `run` call the model?")
    return {name: max(v, 1e-12) / FP8_MAX for name, v in amax.items()}


def save_activation_scales(scales: Mapping[str, float], path) -> None:
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "scales": dict(scales)}, f, indent=1, sort_keys=True)


def load_activation_scales(source) -> dict[str, float]:
    """A mapping or a JSON file written by save_activation_scales -> {module name: scale}.
    Every scale must be a finite number > 0; the error names the first that is not."""
    if source is None:
        raise ValueError("no activation_scales given for activation_scheme 'static'")
    if isinstance(source, Mapping):
        data = dict(source)
        scales = data.get("scales", data) if "format" in data else data
        where = "activation_scales"
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"activation_scales file not found: {path!r}")
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("scales"), Mapping):
            raise ValueError(f"{path!r} is not an fx_fp8 activation-scales file (format {FORMAT!r})")
        scales, where = data["scales"], path
    out = {}
    for name, value in scales.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"invalid activation scale {value!r} for {name!r} in {where}: expected a finite number > 0")
        out[str(name)] = float(value)
    return out


def check_scales_match(scales: Mapping[str, float], linear_names) -> None:
    """Static scales keyed by names that match no linear of the model are an error, not a
    silent all-native run (e.g. scales calibrated on another model, or with `_orig_mod.` prefixes)."""
    names = set(linear_names)
    unknown = sorted(k for k in scales if k not in names)
    if unknown and len(unknown) == len(scales):
        raise ValueError(f"none of the {len(scales)} static activation scales names a linear of this model "
                         f"(first: {unknown[:3]}; model linears look like {sorted(names)[:3]}): "
                         "calibrate this model with fx_fp8.calibrate")
    if unknown:
        raise ValueError(f"{len(unknown)} static activation scale(s) name no linear of this model: {unknown[:5]}")
