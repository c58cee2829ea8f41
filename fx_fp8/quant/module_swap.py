"""Putting a quantized layer in a linear's place: the one way prepare_model, load_quantized,
adopt_prequantized and load-time quantization change a model's module tree."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

#: the forward hooks a replaced module passes on to its replacement
FORWARD_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def replace_module(model: nn.Module, name: str, new: nn.Module, old: Optional[nn.Module] = None) -> None:
    """`new` in the place of `model`'s submodule `name`; with `old` (the module replaced), its forward
    (pre-)hooks keep running on `new` (copied: removing an old handle no longer removes them)."""
    if old is not None:
        for attr in FORWARD_HOOKS:
            getattr(new, attr).update(getattr(old, attr))
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
