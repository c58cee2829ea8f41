"""cache-dit (DBCache, TaylorSeer calibrator, SCM step masks) next to FP8, in vLLM-Omni's words.

    compile_pipeline(pipe, cfg, cache_backend="cache_dit",
                     cache_config={"Fn_compute_blocks": 1, "residual_diff_threshold": 0.24, ...})

`cache_config` takes vLLM-Omni's keys (CACHE_DIT_KEYS) and becomes cache-dit's `DBCacheConfig` and,
with `enable_taylorseer`, a `TaylorSeerCalibratorConfig`; cache-dit is enabled on each transformer
with its registered block adapter (`cache_dit.enable_cache(BlockAdapter)`, transformer level, as
vLLM-Omni does), so every diffusers family cache-dit knows works, whatever the pipeline class.

How FP8 survives cache-dit's wrapping (`compile_regions`):
* cache-dit replaces the transformer's block lists by a `CachedBlocks` module for the duration of
  each forward (unittest.mock.patch), and that module holds the transformer as a submodule: the
  model's module tree is then cyclic and names the blocks `transformer_blocks.0.transformer_blocks.2`.
  The `transformer` link is made a plain attribute (no cycle), and each real block runs with the
  transformer's own block lists put back, so the FP8 backend sees the model's real names and layers.
* `CachedBlocks.forward` decides on tensor values in Python: it runs eagerly and each real block is
  compiled as its own region (its own code object: blocks of one class keep their own decisions).
* cache-dit keeps its step count in a persistent context at transformer level: `reset` starts a
  fresh context at each pipeline run (compile_pipeline calls it), so every run caches alike.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.pipeline.cache_dit_config import CacheDitConfig, import_cache_dit


# -- enabling it on a transformer -----------------------------------------------------------------
def is_cache_dit_enabled(model: nn.Module) -> bool:
    return bool(getattr(unwrap_compiled(model), "_is_cached", False)) and hasattr(
        unwrap_compiled(model), "_context_manager"
    )


@dataclass
class CacheDitState:
    """cache-dit on one transformer, as fx_fp8 enabled it (kept in TransformerExtras.cache)."""

    config: CacheDitConfig
    adapter: Any  # the normalized cache_dit.BlockAdapter
    lists: dict  # attribute -> the transformer's own block list
    cached_blocks: list = field(default_factory=list)  # cache-dit's CachedBlocks modules
    regions: list = field(default_factory=list)  # (block, its instance forward before or None)

    def reset(self) -> None:
        """A fresh cache context (step count, buffers) for the next pipeline run."""
        import cache_dit

        for transformer in self.adapter.transformer:
            with _quiet():
                cache_dit.refresh_context(transformer)


@contextlib.contextmanager
def _quiet():
    """cache-dit logs every context it (re)creates at INFO: keep a run's output readable."""
    import logging

    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("cache_dit")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def block_adapter(model: nn.Module):
    """cache-dit's registered BlockAdapter for this transformer's class; a ValueError naming the
    class when cache-dit has none."""
    from cache_dit import BlockAdapterRegister

    if not BlockAdapterRegister.is_supported(model):
        raise ValueError(
            f"cache-dit has no block adapter for {type(model).__name__} (cache_backend 'cache_dit'); "
            f"its adapters cover {len(BlockAdapterRegister.supported_pipelines()[1])} diffusers families"
        )
    return BlockAdapterRegister.get_adapter(model)


def enable(model: nn.Module, config: CacheDitConfig) -> CacheDitState:
    """cache_dit.enable_cache on a prepared, not yet compiled transformer (its registered adapter)."""
    cache_dit = import_cache_dit()
    from fx_fp8.pipeline.attention_backend import current_attention_backend

    model = unwrap_compiled(model)
    if is_cache_dit_enabled(model):
        raise ValueError(
            f"{type(model).__name__} already has cache-dit enabled; pass cache_backend 'cache_dit' to "
            "fx_fp8 only, or enable it yourself and pass none"
        )
    adapter = block_adapter(model)
    lists = {}
    for name in list(_names(adapter.blocks_name)) + list(_names(adapter.dummy_blocks_names)):
        if name not in model._modules:
            raise ValueError(
                f"cache-dit's adapter for {type(model).__name__} names block list {name!r}, which the "
                "model does not have"
            )
        lists[name] = model._modules[name]
    # keep the model's attention backend: cache-dit would pick its own on some devices (NPU), which
    # the FP8 attention pass could not rewrite
    backend = current_attention_backend(model)
    cache_config = _fit_blocks(model, config, sum(len(model._modules[n]) for n in _names(adapter.blocks_name)))
    with _quiet():
        adapter = cache_dit.enable_cache(
            adapter,
            cache_config=cache_config,
            calibrator_config=copy.deepcopy(config.calibrator_config),
            attention_backend=backend,
        )
    state = CacheDitState(config=config, adapter=adapter, lists=lists)
    state.cached_blocks = _find_cached_blocks(model)
    if not state.cached_blocks:
        disable(model, state)
        raise ValueError(f"cache-dit wrapped no block list of {type(model).__name__}")
    for cb in state.cached_blocks:  # the transformer as a plain attribute: no cycle in named_modules()
        transformer = cb._modules.pop("transformer", None)
        if transformer is not None:
            object.__setattr__(cb, "transformer", transformer)
    return state


def _fit_blocks(model: nn.Module, config: CacheDitConfig, blocks: int):
    """cache-dit asserts Fn/Bn_compute_blocks <= the model's blocks: a value the user set that
    does not fit is an error naming it; cache-dit's default is lowered to fit, with a warning."""
    cache_config = copy.deepcopy(config.cache_config)
    for key in ("Fn_compute_blocks", "Bn_compute_blocks"):
        value = getattr(cache_config, key, None)
        if value is None or value <= blocks:
            continue
        if key in config.mapping:
            raise ValueError(f"cache_config {key}={value} exceeds the {blocks} blocks of {type(model).__name__}")
        warnings.warn(
            f"fx_fp8: cache-dit's default {key}={value} exceeds the {blocks} blocks of "
            f"{type(model).__name__}; using {blocks}",
            stacklevel=3,
        )
        setattr(cache_config, key, blocks)
    return cache_config


def _names(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _names(v)


def _find_cached_blocks(model: nn.Module) -> list:
    """cache-dit's CachedBlocks modules, found through the transformer's forward wrapper (cache-dit
    keeps them in its closure and installs them only while the forward runs)."""
    from cache_dit.caching.cache_blocks.pattern_base import CachedBlocks_Pattern_Base

    found, seen, todo = [], set(), [vars(model).get("forward")]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, CachedBlocks_Pattern_Base):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args]
        elif isinstance(obj, types.FunctionType):
            todo += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (nn.ModuleList, list, tuple)):
            todo += list(obj)
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _own_lists(model: nn.Module, lists: dict):
    """The transformer's own block lists in place of cache-dit's stand-ins, for one block call."""
    mods = model._modules
    current = {name: mods[name] for name in lists}
    mods.update(lists)
    try:
        yield
    finally:
        mods.update(current)


def compile_regions(model: nn.Module, state: CacheDitState, compile_fn) -> list:
    """CachedBlocks' decisions run eagerly; each real block's forward becomes compile_fn(its own copy),
    called with the transformer's own block lists in place (real names and layers). Returns the
    names of the blocks compiled."""
    from fx_fp8.graph.dynamo_internals import method_copy

    model = unwrap_compiled(model)
    names = {id(m): n for n, m in model.named_modules()}
    done = []
    for cb in state.cached_blocks:
        if "forward" not in vars(cb):
            cb.forward = torch.compiler.disable(cb.forward)
            state.regions.append((cb, None))
        for block in cb.transformer_blocks:
            if getattr(block, "_fx_fp8_region", False):
                continue
            own = vars(block).get("forward")
            compiled = compile_fn(method_copy(block.forward))

            def forward(*args, _compiled=compiled, **kwargs):
                with _own_lists(model, state.lists):
                    return _compiled(*args, **kwargs)

            block.forward = forward
            block._fx_fp8_region = True
            state.regions.append((block, own))
            done.append(names.get(id(block), type(block).__name__))
    return done


def undo_regions(state: CacheDitState) -> None:
    for module, own in reversed(state.regions):
        vars(module).pop("forward", None)
        vars(module).pop("_fx_fp8_region", None)
        if own is not None:
            module.forward = own
    state.regions.clear()


def disable(model: nn.Module, state: Optional[CacheDitState]) -> None:
    """cache_dit.disable_cache on the transformer, regions removed first."""
    import cache_dit

    model = unwrap_compiled(model)
    if state is not None:
        undo_regions(state)
        for cb in state.cached_blocks:
            transformer = vars(cb).pop("transformer", None)
            if transformer is not None:
                cb._modules["transformer"] = transformer
    with _quiet():
        cache_dit.disable_cache(model)


def block_runs(model: nn.Module) -> dict:
    """{cache context: (transformer calls computed, transformer calls cached)} since the last reset, from
    cache-dit's own counters."""
    model = unwrap_compiled(model)
    manager = getattr(model, "_context_manager", None)
    out = {}
    for name in getattr(model, "_context_names", []) or []:
        ctx = manager.get_context(name)
        cached = len(ctx.get_cached_steps()) + len(ctx.get_cfg_cached_steps())
        out[name] = (int(ctx.get_accumulated_transformer_executed_steps()) - cached, cached)
    return out
