"""The one table of tiny models, looked up by name or family alias, and what is built from it."""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from fx_fp8.tools.model_zoo.audio import AUDIO_MODELS
from fx_fp8.tools.model_zoo.entry import KINDS, TinyModel
from fx_fp8.tools.model_zoo.families import FAMILY_ENTRIES
from fx_fp8.tools.model_zoo.image import IMAGE
from fx_fp8.tools.model_zoo.inputs import VARIANTS, pick
from fx_fp8.tools.model_zoo.instantiate import config_with_layers, instantiate
from fx_fp8.tools.model_zoo.not_in_zoo import NOT_IN_ZOO, diffusers_transformer_classes  # noqa: F401  (re-exported)
from fx_fp8.tools.model_zoo.video import VIDEO


def _table(entries: list[TinyModel]) -> dict[str, TinyModel]:
    table: dict[str, TinyModel] = {}
    classes: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: (KINDS.index(e.kind), e.name)):
        if e.name in table:
            raise ValueError(f"tiny model {e.name!r} is declared twice")
        if e.class_name in classes:
            raise ValueError(f"{e.class_name} is declared twice: {classes[e.class_name]!r} and {e.name!r}")
        table[e.name], classes[e.class_name] = e, e.name
    return table


#: every tiny model by name: image, then video, then audio, by name within a kind
MODELS: Mapping[str, TinyModel] = MappingProxyType(_table(IMAGE + VIDEO + AUDIO_MODELS + FAMILY_ENTRIES))
#: the named families, in their documented order
FAMILIES: tuple[str, ...] = tuple(e.name for e in FAMILY_ENTRIES)
#: the one alias table for family names (the tiny pipelines, the CLI and the zoo use it)
ALIASES: Mapping[str, str] = MappingProxyType({a: e.name for e in FAMILY_ENTRIES for a in e.family.aliases})
#: pipelines the families can build, by name (a family name means its first one)
TINY_PIPELINES: tuple[str, ...] = tuple(p for e in FAMILY_ENTRIES for p in e.family.pipelines)


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def canonical_family(name: str) -> str:
    key = normalize_name(name)
    key = ALIASES.get(key, key)
    if key not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected one of {', '.join(FAMILIES)}")
    return key


def lookup(name: str) -> TinyModel:
    """The entry `name` names (a zoo name or a family alias)."""
    key = normalize_name(name)
    key = ALIASES.get(key, key)
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}: expected one of {', '.join(MODELS)}") from None


def names(kind: Optional[str] = None) -> list[str]:
    """Entry names, optionally only those of one kind ("image", "video", "audio")."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS)}")
    return [n for n, e in MODELS.items() if kind is None or e.kind == kind]


def config(name: str, *, layers: Optional[int] = None) -> dict:
    """The tiny config of `name`; for a family, `layers` sets its layer counts (default: the entry's)."""
    entry = lookup(name)
    if layers is not None and entry.family is None:
        raise ValueError(
            f"layers={layers!r} for {name!r}: only a family ({', '.join(FAMILIES)}) has a layer count to set"
        )
    return config_with_layers(entry, layers)


# --- the zoo: every entry, zero-initialised layers made random ---------------------------------


def _to_dtype(model: torch.nn.Module, dtype) -> torch.nn.Module:
    """model.to(dtype), keeping the class's `_keep_in_fp32_modules` in float32 as from_pretrained does."""
    model = model.to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for pname, param in list(model.named_parameters()) + list(model.named_buffers()):
        if param.is_floating_point() and any(k in pname.split(".") for k in keep):
            param.data = param.data.float()
    return model


def reinit_zero_layers(model: torch.nn.Module) -> None:
    """Diffusers zero-initialises output layers (adaLN-zero modulation, final projections): with
    random weights elsewhere the model's output then ignores them, or is 0, and hides any error
    made there. Such layers get their default random initialisation instead."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))
            and weight is not None
            and weight.numel() > 1
            and not weight.detach().any()
        ):
            module.reset_parameters()


def build(name: str, *, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    """The tiny random model `name`, seeded by `seed`, in eval mode. Zero-initialised linear and
    convolution layers are re-initialised at random so that every layer affects the output.
    The global RNG is left as it was.

    With a `dtype` other than float32 the model is cast like `from_pretrained(torch_dtype=dtype)`
    does: the modules in the class's `_keep_in_fp32_modules` stay float32.
    """
    entry = lookup(name)
    from diffusers.utils import logging as dlogging

    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # silence "modules that should be kept in float32" on .to(dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = instantiate(entry, dict(entry.config))
                reinit_zero_layers(model)
                for pname in entry.uninitialised:
                    torch.nn.init.normal_(model.get_parameter(pname), std=0.02)
            if dtype != torch.float32:
                model = _to_dtype(model, dtype)
    finally:
        dlogging.set_verbosity(verbosity)
    return model.eval()


_KEEP_FLOAT32 = ("ids", "indices", "rope", "rotary", "coords", "size")  # keyword parts left in float32


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def make_inputs(name: str, model, *, seed: int = 0, variant: int = 0, dtype=torch.float32) -> dict:
    """Forward kwargs for `model` (built by build(name)) at size `variant` (0..3, 0 the fewest tokens).

    Random tensors come from a torch.Generator seeded by `seed` only. Floating tensors are cast to
    `dtype`, except position ids, rotary tables, sizes and coordinates, which stay float32.
    """
    entry = lookup(name)
    pick(range(VARIANTS), variant)  # a bad variant is named before any work
    gen = torch.Generator().manual_seed(seed)
    kwargs = entry.inputs(model, gen, variant)
    if dtype != torch.float32:
        kwargs = {k: v if any(p in k for p in _KEEP_FLOAT32) else _cast(v, dtype) for k, v in kwargs.items()}
    return kwargs


# --- the families: layer counts to choose, weights as diffusers initialises them ---------------


def build_tiny_transformer(family: str, *, layers: int = 2, seed: int = 0, dtype=torch.float32):
    """A randomly initialised tiny transformer of `family` (seeded through torch.manual_seed), in eval mode."""
    entry = MODELS[canonical_family(family)]
    cfg = config(entry.name, layers=layers)
    torch.manual_seed(seed)
    model = instantiate(entry, cfg)
    # diffusers logs a note on every .to(dtype) call: none when the model already is float32
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def example_inputs(family: str, model, *, batch: int = 1, seed: int = 0, dtype=torch.float32) -> dict:
    """Keyword arguments for one forward call of build_tiny_transformer(family), shaped from model.config."""
    entry = MODELS[canonical_family(family)]
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    gen = torch.Generator().manual_seed(seed)
    return entry.family.inputs(model.config, batch, gen, dtype)


def build_tiny_pipeline(name: str, **kwargs):
    """``(pipe, call_kwargs)`` for one of :data:`TINY_PIPELINES`, or a family name or alias
    (``wan`` is Wan2.1; ``wan2.2`` the two-expert pipeline)."""
    key = normalize_name(name)
    from fx_fp8.tools.model_zoo import pipelines

    builders = {p: getattr(pipelines, b) for e in FAMILY_ENTRIES for p, b in e.family.pipelines.items()}
    if key not in builders:
        try:
            key = next(iter(MODELS[canonical_family(key)].family.pipelines))
        except ValueError:
            raise ValueError(f"unknown tiny pipeline {name!r}: expected one of {', '.join(TINY_PIPELINES)}") from None
    pipe, call_kwargs = builders[key](**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs


def output_tensor(out) -> torch.Tensor:
    """The sample tensor of a diffusers transformer output (dataclass, tuple or list of tensors)."""
    if hasattr(out, "sample"):
        out = out.sample
    elif isinstance(out, tuple):
        out = out[0]
    if isinstance(out, (list, tuple)):
        return torch.stack([o.float() for o in out])
    return out
