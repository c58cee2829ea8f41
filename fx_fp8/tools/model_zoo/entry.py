"""What one registry entry declares: a tiny model once, with everything built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch

KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class Family:
    """What a named family adds to its entry (fx_fp8.tools.model_zoo.registry.FAMILIES, the CLI's `--model`, the tiny
    pipelines). Its transformer is its entry's config; `layers` sets `layer_keys`."""

    aliases: tuple[str, ...]
    #: config keys `build_tiny_transformer(layers=...)` sets (the entry's config holds the default)
    layer_keys: tuple[str, ...]
    #: forward kwargs from a config: (config, batch, gen, dtype, **size); its size defaults are
    #: example_inputs' sizes, folders loaded by model_source use it with their own config
    inputs: Callable[..., dict]
    #: the zoo's size variants 0..3: keyword sizes for `inputs`
    variants: tuple[Mapping, ...]
    #: pipeline name -> the name of its builder in model_zoo/pipelines.py; the first is what the family name means
    pipelines: Mapping[str, str]
    #: the VAE of its tiny pipelines as a config with "_class_name" (sizes are known without building)
    vae: Mapping = field(default_factory=dict)


@dataclass(frozen=True)
class TinyModel:
    """One tiny random diffusers transformer: class, config, forward kwargs at 4 size variants."""

    name: str  # short id, e.g. "cogvideox"
    class_name: str  # diffusers class, e.g. "CogVideoXTransformer3DModel"
    kind: str  # "image" | "video" | "audio"
    config: Mapping  # keyword arguments of the class: the tiny config
    inputs: Callable[[torch.nn.Module, torch.Generator, int], dict]  # forward kwargs at variant 0..3
    notes: str = ""  # measured facts, see fx_fp8.tools.model_zoo
    family: Optional[Family] = None
    #: parameters the class leaves as torch.empty (from_pretrained fills them): build() draws them from its seed
    uninitialised: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tiny model {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        # read-only: every user shares this one config
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
