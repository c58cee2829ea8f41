"""The pipeline options applied to one transformer around compile_pipeline, and undone by restore_pipeline.

Order (compile_pipeline's setup): prepare (FP8 weights), then the cache hooks (so that, under context
parallelism, they see each rank's shard), then context parallelism, then torch.compile, then the
cache hooks' wrapped modules compiled as regions (cache_hooks.py, cache_dit.py). Hooks applied in
this order sit on the prepared modules. A transformer that carries diffusers hooks already (the
user's cache, or `fx-fp8 compare`'s context parallelism of the native run, which diffusers cannot
undo) keeps them: prepare_model leaves a hooked linear unreplaced and the backend quantizes it at
compile time (prepare.hooks_lost_by_replacing). What would fail is refused first (check_pipeline_options).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.pipeline import cache_dit as _cache_dit
from fx_fp8.pipeline.cache_hooks import (
    CacheRegions,
    compile_cache_regions,
    enable_cache,
    sync_first_block_cache,
    unsync_first_block_cache,
)
from fx_fp8.pipeline.context_parallel import check_parallel_target, enable_context_parallel
from fx_fp8.pipeline.launch import check_accelerator, init_distributed
from fx_fp8.pipeline.options import CACHE_BACKENDS, PipelineOptions


@dataclass
class TransformerExtras:
    """What apply_pipeline_options did to one transformer (kept in PipelineFP8State.extras)."""

    parallel: Optional[dict] = None  # enable_context_parallel's result
    cache: Any = None  # the diffusers cache config fx_fp8 enabled (None: none, or the user's)
    regions: CacheRegions = field(default_factory=CacheRegions)
    fbc_synced: int = 0
    compile_fn: Any = None  # how cache regions are compiled (torch.compile with the pipeline's backend)
    warned_unknown: bool = False


def check_pipeline_options(opts: PipelineOptions, models: list, *, compile_kwargs: Mapping) -> None:
    """Everything compile_pipeline can find wrong with the pipeline options before it changes anything;
    with context parallelism it also joins the torchrun job (torch.distributed.init_process_group)."""
    for model in models:
        model = unwrap_compiled(model)
        cached = opts.cache_backend is not None or getattr(model, "_cache_config", None) is not None
        if cached and compile_kwargs.get("fullgraph"):
            raise ValueError(
                "fullgraph=True cannot be combined with a cache backend: diffusers' cache hooks decide on "
                "tensor values in Python (torch.compiler.disable), so the transformer cannot be one "
                "graph; fx_fp8 compiles each cached block or attention module as its own graph instead"
            )
        if _cache_dit.is_cache_dit_enabled(model):
            raise ValueError(
                f"{type(model).__name__} already has cache-dit enabled (cache_dit.enable_cache): pass "
                "cache_backend='cache_dit' with its cache_config to compile_pipeline instead, so that "
                "fx_fp8 compiles cache-dit's blocks with their real names"
            )
        if opts.cache_backend == "cache_dit":
            _cache_dit.block_adapter(model)  # a ValueError naming the class cache-dit has no adapter for
            if opts.parallel.enabled:
                raise ValueError(
                    "cache_backend 'cache_dit' with parallel_config is not supported: cache-dit's block "
                    "wrapper under diffusers' context parallelism is untested with fx_fp8 (use "
                    "first_block_cache, taylorseer or mag_cache with ulysses_degree / ring_degree)"
                )
        if opts.cache_backend is not None and getattr(model, "_cache_config", None) is not None:
            raise ValueError(
                f"{type(model).__name__} already has a cache enabled ({type(model._cache_config).__name__}) "
                f"and cache_backend {opts.cache_backend!r} was given: pass one of them"
            )
        if opts.parallel.enabled:
            check_parallel_target(model, opts.parallel)
    if opts.parallel.enabled:
        init_distributed(opts.parallel)
        check_accelerator()


def apply_pipeline_options(model: nn.Module, opts: PipelineOptions, *, warn=None) -> TransformerExtras:
    """Cache hooks first (so that, under context parallelism, they see each rank's shard), then
    context parallelism; the model must already be prepared (FP8 weights) and not yet compiled."""
    extras = TransformerExtras()
    extras.cache = enable_cache(model, opts.cache_backend, opts.cache_config) if opts.cache_backend else None
    try:
        extras.parallel = enable_context_parallel(model, opts.parallel, warn=warn)
    except BaseException:
        if extras.cache is not None:
            undo_pipeline_options(model, extras)
        raise
    if extras.parallel is not None:
        extras.fbc_synced = sync_first_block_cache(model, extras.parallel["mesh"].get_group())
    return extras


def compile_regions(
    extras: TransformerExtras, model: nn.Module, backend: str, options: dict, compile_kwargs: Mapping
) -> None:
    """After torch.compile(model): compile the cache hooks' wrapped modules as regions (see
    compile_cache_regions) with the same backend and options; kept for caches enabled later."""
    kwargs = dict(compile_kwargs)
    extras.compile_fn = lambda fn: torch.compile(fn, backend=backend, options=options, **kwargs)
    _update_regions(extras, model)


def _update_regions(extras: TransformerExtras, model: nn.Module) -> None:
    if isinstance(extras.cache, _cache_dit.CacheDitState):
        extras.regions.modules += _cache_dit.compile_regions(model, extras.cache, extras.compile_fn)
        return
    new = compile_cache_regions(model, extras.compile_fn)
    extras.regions.hooks += new.hooks
    extras.regions.modules += new.modules
    if new.hooks and extras.parallel is not None:
        extras.fbc_synced += sync_first_block_cache(model, extras.parallel["mesh"].get_group())
    unknown = getattr(unwrap_compiled(model), "_cache_config", None)
    if unknown is not None and type(unknown).__name__ not in CACHE_BACKENDS.values() and not extras.warned_unknown:
        extras.warned_unknown = True
        warnings.warn(
            f"fx_fp8: {type(unknown).__name__} has not been tested with fx_fp8; its hooks are traced by "
            "torch.compile as they are (tested: " + ", ".join(CACHE_BACKENDS.values()) + ")",
            stacklevel=4,
        )


def has_diffusers_hooks(module: nn.Module) -> bool:
    """Does the model carry diffusers hooks already (a cache the user enabled)? Then tracing it
    once more on real inputs would move the hooks' state; it is prepared by names, up front."""
    return any(getattr(m, "_diffusers_hook", None) is not None for m in module.modules())


def on_pipeline_run(state) -> None:
    """At each compile_pipeline'd run: cache hooks enabled on the transformers since compile_pipeline
    get the same treatment as those enabled through it (a transformer still waiting for its first
    call is set up now, by names; cache regions are compiled for hooks added since)."""
    for attr, setup in list(state.pending_setup.items()):
        if has_diffusers_hooks(state.originals[attr]):
            setup(None)
    for attr, extras in state.extras.items():
        if extras is not None and isinstance(extras.cache, _cache_dit.CacheDitState):
            extras.cache.reset()  # cache-dit's context persists across calls: each run starts afresh
            continue
        if extras is None or extras.compile_fn is None:
            continue
        model = state.originals.get(attr)
        if model is not None and getattr(model, "_cache_config", None) is not None:
            _update_regions(extras, model)


def undo_pipeline_options(model: nn.Module, extras: Optional[TransformerExtras]) -> None:
    """restore_pipeline: the compiled regions go, a cache fx_fp8 enabled is disabled. Context
    parallelism stays (diffusers cannot undo enable_parallelism)."""
    if extras is None:
        return
    extras.regions.undo()
    model = unwrap_compiled(model)
    if isinstance(extras.cache, _cache_dit.CacheDitState):
        _cache_dit.disable(model, extras.cache)
        return
    if extras.fbc_synced:
        unsync_first_block_cache(model)
    if extras.cache is not None and getattr(model, "_cache_config", None) is not None:
        model.disable_cache()
    handle = vars(model).pop("_fx_fp8_default_context", None)
    if handle is not None:
        handle.remove()


def hand_over_cache(applied: list, opts: PipelineOptions) -> dict:
    """A native run had `opts` applied to its transformers ([(model, extras)], from
    apply_pipeline_options); compile_pipeline is next. Diffusers' cache hooks stay (compile_pipeline
    compiles them as they are); cache-dit is disabled and handed over as compile_pipeline keywords,
    since compile_pipeline must enable it itself to compile cache-dit's blocks with their real names."""
    if opts.cache_backend != "cache_dit":
        return {}
    for model, extras in applied:
        undo_pipeline_options(model, extras)
    return {"cache_backend": opts.cache_backend, "cache_config": opts.cache_config}
