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
import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8.config.values import check_known_key
from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.install_hint import install_hint

#: the tested cache-dit range (pyproject's `cache-dit` extra)
CACHE_DIT_REQUIREMENT = "cache-dit>=1.5.3,<1.6"
MISSING = (f"cache_backend 'cache_dit' needs the cache-dit package: {install_hint('cache-dit')} "
           f"(or pip install '{CACHE_DIT_REQUIREMENT}')")


#: vLLM-Omni's cache_config keys -> (cache-dit config, its field). "scm_*" and "enable_taylorseer" /
#: "taylorseer_order" are vLLM-Omni's spellings of the step mask and the TaylorSeer calibrator.
CACHE_DIT_KEYS: dict[str, tuple[str, str]] = {
    "Fn_compute_blocks": ("db", "Fn_compute_blocks"),
    "Bn_compute_blocks": ("db", "Bn_compute_blocks"),
    "max_warmup_steps": ("db", "max_warmup_steps"),
    "warmup_interval": ("db", "warmup_interval"),
    "max_cached_steps": ("db", "max_cached_steps"),
    "max_continuous_cached_steps": ("db", "max_continuous_cached_steps"),
    "residual_diff_threshold": ("db", "residual_diff_threshold"),
    "max_accumulated_residual_diff_threshold": ("db", "max_accumulated_residual_diff_threshold"),
    "enable_separate_cfg": ("db", "enable_separate_cfg"),
    "cfg_compute_first": ("db", "cfg_compute_first"),
    "cfg_diff_compute_separate": ("db", "cfg_diff_compute_separate"),
    "num_inference_steps": ("db", "num_inference_steps"),
    "force_refresh_step_hint": ("db", "force_refresh_step_hint"),
    "force_refresh_step_policy": ("db", "force_refresh_step_policy"),
    "steps_computation_mask": ("db", "steps_computation_mask"),
    "scm_steps_mask_policy": ("scm", "mask_policy"),
    "scm_steps_policy": ("db", "steps_computation_policy"),
    "enable_taylorseer": ("calibrator", "enable_calibrator"),
    "enable_encoder_taylorseer": ("calibrator", "enable_encoder_calibrator"),
    "taylorseer_order": ("calibrator", "taylorseer_order"),
}
_INT_MIN = {"Fn_compute_blocks": 0, "Bn_compute_blocks": 0, "max_warmup_steps": 0, "warmup_interval": 1,
            "max_cached_steps": -1, "max_continuous_cached_steps": -1, "num_inference_steps": 1,
            "force_refresh_step_hint": 1, "taylorseer_order": 1}
_BOOLS = ("enable_separate_cfg", "cfg_compute_first", "cfg_diff_compute_separate", "enable_taylorseer",
          "enable_encoder_taylorseer")
_CHOICES = {"force_refresh_step_policy": ("once", "repeat"), "scm_steps_policy": ("dynamic", "static"),
            "scm_steps_mask_policy": ("slow", "medium", "fast", "ultra")}
_NULLABLE = ("max_accumulated_residual_diff_threshold", "enable_separate_cfg", "num_inference_steps",
             "force_refresh_step_hint", "steps_computation_mask", "scm_steps_mask_policy")


def _check(key: str, value) -> Any:
    where = f"cache_config.{key} for cache_backend 'cache_dit'"
    if value is None and key in _NULLABLE:
        return None
    if key in _INT_MIN:
        if isinstance(value, bool) or not isinstance(value, int) or value < _INT_MIN[key]:
            raise ValueError(f"invalid {where}: {value!r} (expected an integer >= {_INT_MIN[key]})")
        return value
    if key in ("residual_diff_threshold", "max_accumulated_residual_diff_threshold"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid {where}: {value!r} (expected a finite number >= 0)")
        return float(value)
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"invalid {where}: {value!r} (expected true or false)")
        return value
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise ValueError(f"invalid {where}: {value!r} (expected one of {list(_CHOICES[key])})")
        return value
    if key == "steps_computation_mask":
        if not isinstance(value, (list, tuple)) or not value or any(v not in (0, 1) or isinstance(v, bool)
                                                                      for v in value):
            raise ValueError(f"invalid {where}: {value!r} (expected a list of 0 / 1, one per step)")
        return [int(v) for v in value]
    return value


@dataclass
class CacheDitConfig:
    """The validated cache_config of cache_backend 'cache_dit' and cache-dit's config objects for it."""

    mapping: dict                        # the keys as given (vLLM-Omni spellings)
    cache_config: Any                    # cache_dit.DBCacheConfig
    calibrator_config: Any = None        # cache_dit.TaylorSeerCalibratorConfig or None

    def describe(self) -> str:
        text = self.cache_config.strify()
        return text + (", TaylorSeer order " + str(self.calibrator_config.taylorseer_order)
                       if self.calibrator_config is not None else "")


def check_keys(mapping: Mapping) -> dict:
    """The cache-dit fields cache_config sets, by config ('db' / 'calibrator' / 'scm'); every key and
    value checked (no cache-dit import needed), the first bad one named in a ValueError."""
    out: dict = {"db": {}, "calibrator": {}, "scm": {}}
    for key, value in mapping.items():
        check_known_key(key, CACHE_DIT_KEYS, "cache_config", " for cache_backend 'cache_dit'")
        target, name = CACHE_DIT_KEYS[key]
        out[target][name] = _check(key, value)
    db, cal, scm = out["db"], out["calibrator"], out["scm"]
    # settings that would otherwise be dropped without a word
    if not cal.get("enable_calibrator"):
        for key, name, default in (("taylorseer_order", "taylorseer_order", 1),
                                   ("enable_encoder_taylorseer", "enable_encoder_calibrator", False)):
            if cal.get(name, default) != default:
                raise ValueError(f"cache_config.{key} {cal[name]!r} needs enable_taylorseer: true (cache_backend "
                                 "'cache_dit' runs the TaylorSeer calibrator only when it is enabled)")
    if scm.get("mask_policy") is None and db.get("steps_computation_policy", "dynamic") != "dynamic":
        raise ValueError(f"cache_config.scm_steps_policy {db['steps_computation_policy']!r} needs "
                         "scm_steps_mask_policy (or steps_computation_mask): without a step mask there is "
                         "nothing for it to apply to")
    if scm.get("mask_policy") is not None:
        if db.get("steps_computation_mask") is not None:
            raise ValueError("cache_config sets both scm_steps_mask_policy and steps_computation_mask: give one")
        steps = db.get("num_inference_steps")
        if steps is None or not (steps >= 8 or steps in (4, 6)):
            raise ValueError(f"cache_config.scm_steps_mask_policy {scm['mask_policy']!r} needs "
                             f"cache_config.num_inference_steps (4, 6 or >= 8; got {steps!r}): cache-dit's "
                             "predefined masks are laid out for the run's step count (the command line fills "
                             "it in from --num-inference-steps / --steps)")
    steps, mask = db.get("num_inference_steps"), db.get("steps_computation_mask")
    if mask is not None and steps is not None and len(mask) != steps:
        raise ValueError(f"cache_config.steps_computation_mask has {len(mask)} entries for num_inference_steps "
                         f"{steps}")
    return out


def _import():
    try:
        import cache_dit
    except ImportError:
        raise ValueError(MISSING) from None
    _warnings_only()
    return cache_dit


def _warnings_only() -> None:
    """cache-dit logs each patch and context on stdout (one handler shared by its loggers),
    which would break the command line's JSON output: that handler writes to stderr, and passes
    warnings only unless the user chose a level (CACHE_DIT_LOG_LEVEL)."""
    import importlib
    import logging
    import os
    import sys

    handler = getattr(importlib.import_module("cache_dit.logger"), "_default_handler", None)
    if not isinstance(handler, logging.StreamHandler):
        return
    if handler.stream is sys.stdout or handler.stream is sys.__stdout__:
        handler.setStream(sys.stderr)
    if "CACHE_DIT_LOG_LEVEL" not in os.environ and handler.level < logging.WARNING:
        handler.setLevel(logging.WARNING)


def cache_dit_config(cache_config=None) -> CacheDitConfig:
    """cache_config (vLLM-Omni's keys) -> CacheDitConfig; unset keys take cache-dit's defaults."""
    mapping = dict(cache_config or {})
    fields = check_keys(mapping)
    cache_dit = _import()
    db = dict(fields["db"])
    policy = fields["scm"].get("mask_policy")
    if policy is not None:
        db["steps_computation_mask"] = cache_dit.steps_mask(mask_policy=policy,
                                                            total_steps=db["num_inference_steps"])
    try:
        config = cache_dit.DBCacheConfig(**db)
        calibrator = (cache_dit.TaylorSeerCalibratorConfig(**fields["calibrator"])
                      if fields["calibrator"].get("enable_calibrator") else None)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"cache-dit rejected cache_config {mapping!r}: {e}") from None
    return CacheDitConfig(mapping=mapping, cache_config=config, calibrator_config=calibrator)


# -- enabling it on a transformer -----------------------------------------------------------------
def is_cache_dit_enabled(model: nn.Module) -> bool:
    return bool(getattr(unwrap_compiled(model), "_is_cached", False)) \
        and hasattr(unwrap_compiled(model), "_context_manager")


@dataclass
class CacheDitState:
    """cache-dit on one transformer, as fx_fp8 enabled it (kept in TransformerExtras.cache)."""

    config: CacheDitConfig
    adapter: Any                                   # the normalized cache_dit.BlockAdapter
    lists: dict                                    # attribute -> the transformer's own block list
    cached_blocks: list = field(default_factory=list)  # cache-dit's CachedBlocks modules
    regions: list = field(default_factory=list)    # (block, its instance forward before or None)

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
        raise ValueError(f"cache-dit has no block adapter for {type(model).__name__} (cache_backend 'cache_dit'); "
                         f"its adapters cover {len(BlockAdapterRegister.supported_pipelines()[1])} diffusers families")
    return BlockAdapterRegister.get_adapter(model)


def enable(model: nn.Module, config: CacheDitConfig) -> CacheDitState:
    """cache_dit.enable_cache on a prepared, not yet compiled transformer (its registered adapter)."""
    cache_dit = _import()
    from fx_fp8.pipeline.attention_backend import current_attention_backend

    model = unwrap_compiled(model)
    if is_cache_dit_enabled(model):
        raise ValueError(f"{type(model).__name__} already has cache-dit enabled; pass cache_backend 'cache_dit' to "
                         "fx_fp8 only, or enable it yourself and pass none")
    adapter = block_adapter(model)
    lists = {}
    for name in list(_names(adapter.blocks_name)) + list(_names(adapter.dummy_blocks_names)):
        if name not in model._modules:
            raise ValueError(f"cache-dit's adapter for {type(model).__name__} names block list {name!r}, which the "
                             "model does not have")
        lists[name] = model._modules[name]
    # keep the model's attention backend: cache-dit would pick its own on some devices (NPU), which
    # the FP8 attention pass could not rewrite
    backend = current_attention_backend(model)
    cache_config = _fit_blocks(model, config, sum(len(model._modules[n]) for n in _names(adapter.blocks_name)))
    with _quiet():
        adapter = cache_dit.enable_cache(adapter, cache_config=cache_config,
                                         calibrator_config=copy.deepcopy(config.calibrator_config),
                                         attention_backend=backend)
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
        warnings.warn(f"fx_fp8: cache-dit's default {key}={value} exceeds the {blocks} blocks of "
                      f"{type(model).__name__}; using {blocks}", stacklevel=3)
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
