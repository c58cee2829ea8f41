"""Building a registry entry's model: its diffusers class, its config with a layer count set."""

from __future__ import annotations

from typing import Optional

import torch

from fx_fp8.tools.model_zoo.entry import TinyModel


def diffusers_class(name: str):
    import diffusers

    try:
        return getattr(diffusers, name)
    except AttributeError:
        raise ImportError(f"diffusers {diffusers.__version__} has no {name} (the zoo targets 0.42)") from None


def config_with_layers(entry: TinyModel, layers: Optional[int] = None) -> dict:
    """The entry's tiny config; for a family, `layers` sets its layer counts (default: the entry's)."""
    cfg = dict(entry.config)
    if layers is not None:
        if entry.family is None:
            raise ValueError(f"layers={layers!r} for {entry.name!r}: only a family has a layer count to set")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"layers must be an int >= 1, got {layers!r}")
        cfg.update({k: layers for k in entry.family.layer_keys})
    return cfg


def instantiate(entry: TinyModel, cfg: dict) -> torch.nn.Module:
    return diffusers_class(entry.class_name)(**cfg)
