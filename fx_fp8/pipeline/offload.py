"""Offloading next to compile_pipeline: diffusers' group offload and accelerate's hooks."""

from __future__ import annotations

import torch.nn as nn


def reapply_group_offload(module: nn.Module) -> None:
    """Group offloading holds the modules and tensors it found when it was enabled: after
    linears are replaced (prepare, restore) its groups are rebuilt, so the new modules move with
    their group and the replaced ones are not kept alive by a stale group."""
    try:
        from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading
    except ImportError:  # no diffusers: nothing can have enabled it
        return
    _maybe_remove_and_reapply_group_offloading(module)


def check_weights_readable(module: nn.Module, attr: str) -> None:
    """prepare reads every weight: weights offloaded to the meta device (accelerate's sequential
    CPU offload keeps them in its hooks) would be quantized as garbage, and the hooks would then
    write the original weights into the quantized slots."""
    on_meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    if on_meta:
        raise ValueError(
            f"pipe.{attr} has {len(on_meta)} weights on the meta device (first: {on_meta[:3]}): "
            "offloaded by accelerate (pipe.enable_sequential_cpu_offload()) or not loaded, so "
            "compile_pipeline(prepare=True) cannot quantize them. Call compile_pipeline and run the "
            "pipeline once before enabling sequential offload, or pass prepare=False"
        )
