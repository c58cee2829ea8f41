"""Calibration: static activation scales and per-channel activation statistics.

`calibrate` runs the model on real inputs and records, per linear that prepare_model and
the backend quantize (fx_fp8.quant.rules.is_plain_linear), the
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

This module collects the statistics (calibrate); the result and its file are in
activation_scales, the step groups in step_groups, and what the linear pass and
prepare_model take from a calibration in linear_scales.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from fx_fp8.config.step_groups import group_steps, parse_step_groups
from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.ops.formats import FP8_MAX
from fx_fp8.quant.activation_scales import ActivationScales
from fx_fp8.quant.rules import check_not_prepared, is_plain_linear
from fx_fp8.steps import current_step


def calibrate(
    model: nn.Module,
    run: Callable[[nn.Module], object] | Iterable,
    *,
    progress: bool = False,
    per_step: bool = False,
    step_groups=None,
) -> ActivationScales:
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
                    raise ValueError(
                        "calibrate(per_step=True): the model was called with no denoising step "
                        "published; run the pipeline inside `with fx_fp8.publish_steps(pipe):`, "
                        "or publish it with fx_fp8.set_step / fx_fp8.denoising_step"
                    )
                steps = by_step.setdefault(name, {})
                steps[step] = max(steps.get(step, 0.0), top)

        return hook

    model = unwrap_compiled(model)  # a torch.compile'd module: the names of the model it wraps
    check_not_prepared(
        model,
        "it cannot be calibrated (its linears no longer see their original weights)",
        "calibrate the original model, then prepare it with that calibration",
    )
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
        raise ValueError(
            "calibration saw no nn.Linear inputs (linears as fx_fp8.quant.rules.is_plain_linear "
            "defines them): did `run` call the model?"
        )
    scales = {name: max(v, 1e-12) / FP8_MAX for name, v in amax.items()}
    groups = per_layer = None
    if per_step:
        groups = group_steps(sorted({s for steps in by_step.values() for s in steps}), step_groups)
        per_layer = {}
        for name, steps in by_step.items():
            # a group in which this layer ran on no step (a layer some steps skip): its all-steps maximum
            per_layer[name] = torch.tensor(
                [
                    max(max((v for s, v in steps.items() if lo <= s <= hi), default=amax[name]), 1e-12) / FP8_MAX
                    for lo, hi in groups
                ],
                dtype=torch.float32,
            )
    return ActivationScales(
        scales,
        {name: t.cpu() for name, t in channel.items()},
        where="fx_fp8.calibrate",
        step_groups=groups,
        step_scales=per_layer,
    )
