"""diffusers' cache hooks (FirstBlockCache, TaylorSeer, MagCache) under FP8: enabled, compiled as regions.

Cache hooks decide in Python, on tensor values, whether a block runs (diffusers marks those
decisions torch.compiler.disable; MagCache marks whole blocks so). compile_pipeline therefore runs
each cache hook's decision eagerly and compiles what the hook wraps (a block, or an attention module
for TaylorSeer) with the FP8 backend, one compiled region per module: blocks are still skipped,
layer selectors see each block's real name, and a second run compiles nothing.

First-block cache under context parallelism: each rank sees only its shard of the first block's
residual, so ranks could disagree on skipping and then deadlock in the next all-to-all. fx_fp8
all-reduces the residual statistics over the context-parallel group, so every rank takes the
single-process decision.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import method_copy, unwrap_compiled
from fx_fp8.pipeline import cache_dit as _cache_dit
from fx_fp8.pipeline.options import canonical_cache_backend, diffusers_cache_config


def _cache_hook_names() -> dict:
    """diffusers' cache hook names -> the cache they belong to (the three fx_fp8 compiles regionally)."""
    from diffusers.hooks import first_block_cache, mag_cache, taylorseer_cache

    return {
        first_block_cache._FBC_LEADER_BLOCK_HOOK: "first_block_cache",
        first_block_cache._FBC_BLOCK_HOOK: "first_block_cache",
        mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK: "mag_cache",
        mag_cache._MAG_CACHE_BLOCK_HOOK: "mag_cache",
        taylorseer_cache._TAYLORSEER_CACHE_HOOK: "taylorseer",
    }


def cache_hooks(model: nn.Module) -> list[tuple[str, str, Any]]:
    """[(module name, hook name, hook)] of diffusers' cache hooks on `model` that replace a forward."""
    names = _cache_hook_names()
    out = []
    for mod_name, m in unwrap_compiled(model).named_modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook_name in registry._hook_order:
            hook = registry.hooks[hook_name]
            if hook_name in names and hasattr(hook, "new_forward"):
                out.append((mod_name, hook_name, hook))
    return out


def enable_cache(model: nn.Module, backend, cache_config=None) -> Optional[Any]:
    """transformer.enable_cache(<diffusers config for backend>); returns the config (None: no cache)."""
    backend = canonical_cache_backend(backend)
    cfg = diffusers_cache_config(backend, cache_config)
    if cfg is None:
        return None
    model = unwrap_compiled(model)
    if _cache_dit.is_cache_dit_enabled(model):
        raise ValueError(f"{type(model).__name__} already has cache-dit enabled; pass cache_backend to fx_fp8 only")
    if backend == "cache_dit":
        if getattr(model, "_cache_config", None) is not None:
            raise ValueError(
                f"{type(model).__name__} already has a diffusers cache enabled "
                f"({type(model._cache_config).__name__}); cache-dit cannot be added on top of it"
            )
        return _cache_dit.enable(model, cfg)
    if getattr(model, "_cache_config", None) is not None:
        raise ValueError(
            f"{type(model).__name__} already has a cache enabled ({type(model._cache_config).__name__}); "
            "pass cache_backend to fx_fp8 only, or enable it yourself and pass none"
        )
    try:
        model.enable_cache(cfg)
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"diffusers could not apply {type(cfg).__name__} to {type(model).__name__}: {e}") from None
    if not cache_hooks(model):  # e.g. TaylorSeer's default patterns (`...attn`) miss Wan's attn1 / attn2
        model.disable_cache()
        raise ValueError(
            f"cache_backend {backend!r} hooked no module of {type(model).__name__} (diffusers' "
            f"{type(cfg).__name__} found nothing to cache with these settings)"
            + (
                "; name the modules with cache_config.cache_identifiers, e.g. [\"^blocks\\\\.\\\\d+\\\\.attn1$\"]"
                if backend == "taylorseer"
                else ""
            )
        )
    model._fx_fp8_default_context = model.register_forward_pre_hook(_default_cache_context)
    return cfg


@torch.compiler.disable
def _default_cache_context(module, args):
    """diffusers' pipelines wrap each denoiser call in `transformer.cache_context("cond")`; a pipeline
    that does not (fx_fp8's tiny model, custom loops) would make the cache hooks raise "No cache
    context is set". For those calls, one default context: every call shares one cache state."""
    from diffusers.hooks.hooks import CacheContext, StateManager, _set_cache_context

    for _, _, hook in cache_hooks(module):
        for attr in vars(hook).values():
            if isinstance(attr, StateManager) and attr._context is None:
                _set_cache_context(module, CacheContext("fx_fp8_default"))
                return None
    return None


@dataclass
class CacheRegions:
    """What compile_cache_regions changed, to undo it."""

    hooks: list = field(default_factory=list)  # (hook, its registry fn_ref, the fn_ref.forward before)
    modules: list = field(default_factory=list)  # module names compiled as regions

    def undo(self) -> None:
        for hook, fn_ref, forward in self.hooks:
            hook.fn_ref = fn_ref
            fn_ref.forward = forward
            vars(hook).pop("_fx_fp8_region", None)
        self.hooks.clear()
        self.modules.clear()


def compile_cache_regions(model: nn.Module, compile_fn) -> CacheRegions:
    """Run each diffusers cache hook's decision eagerly and compile what it wraps with `compile_fn`.

    For every cache hook (FirstBlockCache / MagCache on blocks, TaylorSeer on attention modules):
    the hook's forward (its Python decision: compute, or reuse / predict) is marked
    torch.compiler.disable, and the original forward it calls is replaced, for this hook only, by
    `compile_fn(copy of the original forward)`, one compiled region per module. diffusers' own
    registry keeps the true original, so disable_cache() still restores the plain module.
    """
    regions = CacheRegions()
    for mod_name, _hook_name, hook in cache_hooks(model):
        fn_ref = hook.fn_ref
        if getattr(hook, "_fx_fp8_region", False):
            continue
        proxy = copy.copy(fn_ref)
        proxy.original_forward = compile_fn(method_copy(fn_ref.original_forward))
        previous = fn_ref.forward
        fn_ref.forward = torch.compiler.disable(previous)
        hook.fn_ref = proxy
        hook._fx_fp8_region = True
        regions.hooks.append((hook, fn_ref, previous))
        regions.modules.append(mod_name)
    return regions


def sync_first_block_cache(model: nn.Module, group) -> int:
    """Make FirstBlockCache decide on the whole sequence under context parallelism: the head
    block's residual statistics (mean |r - r_prev| and mean |r_prev| over this rank's shard) are
    summed over `group` before the threshold test, so every rank takes the single-process
    decision and the ranks never disagree on skipping (which would deadlock the next all-to-all).
    Returns the number of hooks changed."""
    import torch.distributed as dist
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    changed = 0
    for _, _, hook in cache_hooks(model):
        if not isinstance(hook, FBCHeadBlockHook):
            continue

        @torch.compiler.disable
        def should_compute(hidden_states_residual, _hook=hook):
            state = _hook.state_manager.get_state()
            if state.head_block_residual is None:
                return True
            prev = state.head_block_residual
            stats = torch.stack([(hidden_states_residual - prev).abs().mean(), prev.abs().mean()]).float()
            dist.all_reduce(stats, group=group)  # equal shards: the sum of means is the whole mean x ranks
            return (stats[0] / stats[1]).item() > _hook.threshold

        hook._should_compute_remaining_blocks = should_compute
        changed += 1
    return changed


def unsync_first_block_cache(model: nn.Module) -> None:
    for _, _, hook in cache_hooks(model):
        vars(hook).pop("_should_compute_remaining_blocks", None)
