"""What a compile does to one instance's own weights, as data: the linear pass emits these
actions and the graph plan (fx_fp8/compile/graph_plan.py) applies them, through `apply`, for
every instance it plans: the instance whose passes ran and each instance that reuses its
decisions alike. The pass never writes a weight's state itself.

* WeightAction: quantize a linear's weight into the copy its module owns
  (fx_fp8/quant/weight_state.py) and, with static scales, attach its calibrated scale.
* SmoothingAction: one activation-quantization group's SmoothQuant vector s, from the members'
  calibrated channel maxima and their own weights; each member's W * s quantized, and with
  static scales the smoothed activation's scale attached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fx_fp8.quant.linear_scales import method_scale, smoothed_static_scale, step_scale_table
from fx_fp8.quant.recipe import WeightRecipe, group_smoothing


@dataclass(frozen=True)
class WeightAction:
    """Quantize the weight at graph input `slot` (read by linear `node`) as `recipe`, and attach
    its calibrated static scale when `static`."""

    slot: int
    node: str
    recipe: WeightRecipe
    static: bool


@dataclass(frozen=True)
class SmoothingAction:
    """One group's smoothing: `members` ((slot, node) each) read one smoothed activation."""

    members: tuple
    alpha: float
    recipe: WeightRecipe
    static: bool


def attach_static_scale(st, value: float, steps, device) -> None:
    """A linear's calibrated activation scale (and its per-step scales: (flat step groups,
    [scale per group]), linear_scales.step_scale_table) on its weight's state."""
    st.input_scale = torch.tensor(value, dtype=torch.float32, device=device)
    st.input_step_scales = (
        None if steps is None else (tuple(steps[0]), torch.tensor(steps[1], dtype=torch.float32, device=device))
    )
    st.generation += 1  # new tensors: feeders look them up again


def apply(action, inputs: list, module_of: Callable[[str], str], resolver, calibration) -> dict:
    """Do `action` to the weights in `inputs` (the instance's graph inputs); `module_of` names a
    node's linear in this instance, `calibration` (fx_fp8.quant.linear_plan.Calibration) gives its
    scales and channel maxima. Returns {slot: quantized copy}, and "smoothing" for a group."""
    if isinstance(action, WeightAction):
        weight, module = inputs[action.slot], module_of(action.node)
        st = resolver.state(action.slot, weight, module)
        copy = st.copy(weight, action.recipe, check_bytes=True)
        if action.static:
            method = action.recipe.method
            scales = calibration.scales
            attach_static_scale(
                st,
                method_scale(scales[module], method),
                step_scale_table(scales, module, lambda v: method_scale(v, method)),
                weight.device,
            )
        return {action.slot: copy}
    if not isinstance(action, SmoothingAction):
        raise TypeError(f"unknown weight action {action!r}")
    members = [(slot, inputs[slot], module_of(node)) for slot, node in action.members]
    amax = {module: calibration.channel[module] for _, _, module in members}
    sm = group_smoothing([(amax[module], weight) for _, weight, module in members], action.alpha)
    out = {"smoothing": sm}
    for slot, weight, module in members:
        st = resolver.state(slot, weight, module)
        st.smoothing[sm.alpha] = sm
        st.generation += 1
        out[slot] = st.copy(weight, action.recipe, sm, check_bytes=True)
        if action.static:
            attach_static_scale(
                st, smoothed_static_scale(amax[module], sm.inverse, action.recipe.method), None, weight.device
            )
    return out
