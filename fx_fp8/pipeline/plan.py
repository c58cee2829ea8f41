"""What compile_pipeline will do to a pipeline, decided and checked before anything changes.

plan_pipeline runs every check that can fail (the config, the components a component map names,
the transformers quantized at load, prepare, the scheduler, regional, the backend and torch.compile
options, the pipeline options) and returns a PipelinePlan; compile.py's install carries it out.
Nothing here changes the pipeline: a failed plan leaves it as it was.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8.compile.backend import MODES
from fx_fp8.compile.downstream import check_downstream_takes, check_inductor_options
from fx_fp8.compile.stored_config import StoredConfigConflict, settle, stored_config
from fx_fp8.config.components import ComponentConfigs, covers, is_wildcard
from fx_fp8.config.files import read_config
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.values import short_repr
from fx_fp8.graph.dynamo_internals import is_compiled_module
from fx_fp8.pipeline.apply_options import check_pipeline_options
from fx_fp8.pipeline.offload import check_weights_readable
from fx_fp8.pipeline.options import PipelineOptions
from fx_fp8.pipeline.state import STATE_ATTR, TRANSFORMER_ATTRS
from fx_fp8.pipeline.step_publishing import check_scheduler
from fx_fp8.quant.rules import check_not_prepared

BACKENDS = ("fp8", "fp8_npu")


@dataclass(frozen=True)
class PipelinePlan:
    """Everything install needs, checked."""

    transformers: Mapping[str, nn.Module]  # {attr: the denoising transformer}
    configs: Mapping[str, FP8Config]  # {attr: its config from the config / component map}
    loaded: Mapping[str, FP8Config]  # {attr: the config to compile with} of those quantized at load
    others: Mapping[str, tuple]  # {name: (module, config)}: text encoders, ... a map names
    pipeline_options: PipelineOptions
    backend_options: Mapping[str, Any]  # torch.compile's options= (config, inductor_options, mode)
    compile_kwargs: Mapping[str, Any]  # the other torch.compile keywords
    scheduler: Any  # the scheduler whose step is published
    backend: str
    prepare: bool
    keep_weights: bool
    regional: bool

    @property
    def config(self) -> FP8Config:
        """The first transformer's config (the pipeline state's `config`)."""
        return next(iter(self.configs.values()))


def plan_pipeline(
    pipe,
    config=None,
    *,
    backend: str = "fp8",
    prepare: bool = True,
    keep_weights: bool = False,
    regional: bool = False,
    mode: Optional[str] = None,
    compile_kwargs: Optional[Mapping[str, Any]] = None,
    inductor_options: Optional[Mapping[str, Any]] = None,
    parallel_config=None,
    cache_backend=None,
    cache_config=None,
    **overrides,
) -> PipelinePlan:
    """compile_pipeline's checks, in its order, with its arguments (fx_fp8.pipeline.compile_pipeline
    says what they mean). Changes nothing."""
    if backend not in BACKENDS:
        raise ValueError(f"invalid backend {short_repr(backend)}: expected one of {', '.join(BACKENDS)}")
    if keep_weights and not prepare:
        raise ValueError(
            "keep_weights=True with prepare=False: without prepare the original weights are never "
            "freed, so there is nothing to keep; drop keep_weights or use prepare=True"
        )
    if getattr(pipe, STATE_ATTR, None) is not None:
        raise ValueError(
            f"{type(pipe).__name__} is already compiled by fx_fp8.compile_pipeline; "
            "call fx_fp8.restore_pipeline(pipe) first"
        )
    source = read_config(config)  # a YAML path is opened here, once: every reader below takes its keys
    scoped = ComponentConfigs.split(source, overrides)
    transformers = _find_transformers(pipe)
    configs = {attr: scoped.transformer_config(attr) for attr in transformers}
    others = _other_components(pipe, scoped)  # {name: (module, config)}: text encoders, ...
    cfg = next(iter(configs.values()))
    # pipeline options (context parallelism, cache hooks) read from the same config (options.py)
    popts = PipelineOptions.load(
        source, parallel_config=parallel_config, cache_backend=cache_backend, cache_config=cache_config
    )
    # a transformer quantized at load compiles as it was loaded: its stored config, never prepared again
    loaded = _loaded_configs(transformers, scoped, configs)
    if prepare:
        every_config = {**configs, **{n: c for n, (_, c) in others.items()}}
        for attr, module in {**transformers, **{n: m for n, (m, _) in others.items()}}.items():
            if attr in loaded or not every_config[attr].linear_enabled:
                continue
            try:
                check_not_prepared(
                    module,
                    "compile_pipeline(prepare=True) cannot prepare it again",
                    "pass prepare=False to compile it as it is",
                )
            except ValueError as e:
                raise ValueError(f"pipe.{attr}: {e}") from None
            check_weights_readable(module, attr)
    if not callable(pipe):
        raise ValueError(
            f"{type(pipe).__name__} is not callable: compile_pipeline publishes the denoising step "
            "around the pipeline's __call__"
        )
    scheduler = check_scheduler(pipe)
    if regional:
        _check_regional(transformers, popts)
    options = {"config": cfg}
    if inductor_options is not None:
        options["inductor_options"] = check_inductor_options(inductor_options)
        check_downstream_takes(cfg, options["inductor_options"])
    if mode is not None:  # checked with compile_kwargs' mode below
        if compile_kwargs and "mode" in compile_kwargs and compile_kwargs["mode"] != mode:
            raise ValueError(
                f"mode={short_repr(mode)} and compile_kwargs['mode']={short_repr(compile_kwargs['mode'])} disagree: give one"
            )
        compile_kwargs = {**(compile_kwargs or {}), "mode": mode}
    compile_kwargs = _check_compile_kwargs(compile_kwargs, options)
    # refuse what would fail (and join the torchrun job), before any change
    check_pipeline_options(popts, list(transformers.values()), compile_kwargs=compile_kwargs)
    return PipelinePlan(
        transformers=transformers,
        configs=configs,
        loaded=loaded,
        others=others,
        pipeline_options=popts,
        backend_options=options,
        compile_kwargs=compile_kwargs,
        scheduler=scheduler,
        backend=backend,
        prepare=prepare,
        keep_weights=keep_weights,
        regional=regional,
    )


def _loaded_configs(transformers: dict, scoped: ComponentConfigs, configs: dict) -> dict:
    """{attr: the config to compile it with} for the transformers quantized at load (their stored
    config; an option contradicting it raises StoredConfigConflict naming the transformer and both values).
    A component map's spec for the transformer (or its default) counts as an option."""
    out = {}
    for attr, module in transformers.items():
        stored = stored_config(module)
        if stored is None:
            continue
        try:
            if scoped.specs is not None and (scoped.key_for(attr) is not None or scoped.default is not None):
                out[attr] = settle(stored, configs[attr])
            else:
                out[attr] = settle(stored, scoped.base, **scoped.overrides)
        except StoredConfigConflict as e:
            raise StoredConfigConflict(f"pipe.{attr}: {e}") from None
    return out


def _find_transformers(pipe) -> dict:
    found = {a: getattr(pipe, a, None) for a in TRANSFORMER_ATTRS}
    found = {a: m for a, m in found.items() if m is not None}
    if not found:
        raise ValueError(
            f"{type(pipe).__name__} has no denoising transformer: expected an nn.Module in "
            f"{' or '.join(TRANSFORMER_ATTRS)}; fx_fp8.compile_pipeline compiles DiT pipelines "
            "(Flux, Qwen-Image, Wan, Z-Image, SD3); for a bare model use torch.compile(model, backend='fp8')"
        )
    for a, m in found.items():
        if is_compiled_module(m):
            raise ValueError(f"pipe.{a} is already torch.compile'd: pass the uncompiled pipeline to compile_pipeline")
        if not isinstance(m, nn.Module):
            raise ValueError(f"pipe.{a} is a {type(m).__name__}, not a torch.nn.Module")
    return found


def _other_components(pipe, scoped: ComponentConfigs) -> dict:
    """{name: (module, config)} of the components a component map covers that are not denoising
    transformers (a key covers the names it begins, vLLM-Omni's rule: components.py); a ValueError
    naming a key that matches no component (and the pipeline's components), a component named
    exactly that is not a torch module, or one already compiled, before anything changes."""
    components = getattr(pipe, "components", None)
    known = list(components) if isinstance(components, dict) else []
    transformers = [a for a in TRANSFORMER_ATTRS if getattr(pipe, a, None) is not None]
    # the names a key may begin: `components` (diffusers), else the pipeline's attributes
    names = known or [n for n in vars(pipe) if not n.startswith("_")]
    exact = []
    for key in scoped.named:
        if key in transformers:
            continue
        listed = key in known if known else hasattr(pipe, key)
        if listed:
            exact.append(key)
            _check_component(pipe, key, getattr(pipe, key, None), named=True)
            continue
        covered = [n for n in dict.fromkeys([*transformers, *names]) if covers(key, n)]
        if not covered:
            hint = (
                "; a key with * ? [ is a shell pattern matched against the whole component name, a plain key "
                "a name prefix (as vLLM-Omni's ComponentQuantizationConfig)"
                if is_wildcard(key)
                else ""
            )
            raise ValueError(
                f"quantization names component {key!r}, which {type(pipe).__name__} does not have; its "
                f"components: {', '.join(known) or '(none listed)'}{hint}"
            )
        if not any(n in transformers or isinstance(getattr(pipe, n, None), nn.Module) for n in covered):
            raise ValueError(
                f"quantization key {key!r} covers {', '.join(covered)} of {type(pipe).__name__}, none "
                "of them a torch.nn.Module: only model components have linears to quantize"
            )
    out = {}
    for name in dict.fromkeys([*exact, *names]):
        key = scoped.key_for(name)
        if name in transformers or key is None:
            continue
        module = getattr(pipe, name, None)
        if name not in exact:
            if not isinstance(module, nn.Module):
                continue  # covered by a shorter key, nothing to quantize (a tokenizer, a component not loaded)
            _check_component(pipe, name, module, named=False)
        if scoped.specs[key] is not None:
            out[name] = (module, scoped.component_config(name))
    return out


def _check_component(pipe, name: str, module, *, named: bool) -> None:
    if named and not isinstance(module, nn.Module):
        raise ValueError(
            f"quantization names component {name!r}, but pipe.{name} is "
            f"{'None (not loaded)' if module is None else 'a ' + type(module).__name__}, not a "
            "torch.nn.Module: only model components have linears to quantize"
        )
    if is_compiled_module(module):
        raise ValueError(f"pipe.{name} is already torch.compile'd: pass the uncompiled pipeline to compile_pipeline")


def _check_regional(transformers: dict, popts) -> None:
    """regional=True needs blocks to compile (diffusers' `_repeated_blocks`), and is not combined
    with the cache hooks or context parallelism, which compile regions of their own."""
    for attr, module in transformers.items():
        if not getattr(module, "_repeated_blocks", None):
            raise ValueError(
                f"regional=True: pipe.{attr} ({type(module).__name__}) declares no _repeated_blocks "
                "to compile; use regional=False"
            )
    if popts.enabled:
        raise ValueError(
            "regional=True is not combined with cache_backend or parallel_config yet (they compile "
            "regions of their own); use regional=False"
        )


def _check_compile_kwargs(compile_kwargs, options: dict) -> dict:
    """torch.compile keywords, checked before anything is prepared. `mode` travels in the
    backend options (torch.compile refuses `mode` together with `options`)."""
    kwargs = dict(compile_kwargs or {})
    allowed = set(inspect.signature(torch.compile).parameters) - {"model", "backend", "options", "mode"}
    for key in kwargs:
        if key in ("backend", "options", "model"):
            raise ValueError(f"compile_kwargs may not set {short_repr(key)}: compile_pipeline sets it")
        if key not in allowed and key != "mode":
            raise ValueError(
                f"unknown torch.compile keyword {short_repr(key)} in compile_kwargs; known: {sorted(allowed | {'mode'})}"
            )
    if "mode" in kwargs:
        mode = kwargs.pop("mode")
        if mode not in MODES:
            raise ValueError(f"invalid mode {short_repr(mode)}: expected one of {', '.join(map(str, MODES[1:]))}")
        options["mode"] = mode
    return kwargs
