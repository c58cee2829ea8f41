"""compile_pipeline: FP8 for a whole diffusers pipeline.

    pipe = fx_fp8.compile_pipeline(pipe, "stage.yaml", diffusion_kv_cache_skip_steps="0,1")
    image = pipe(prompt_embeds=..., num_inference_steps=28).images[0]
    fx_fp8.restore_pipeline(pipe)          # the original weights need keep_weights=True (or prepare=False)

Every denoising transformer (`transformer`, and `transformer_2` of two-expert Wan2.2 pipelines) is
optionally prepared (`prepare_model`: FP8 weights, the originals freed) and replaced by
`torch.compile(t, backend="fp8", options={"config": cfg})`; the pipeline publishes its denoising
step (step_publishing.py) so `diffusion_kv_cache_skip_steps` works. A pipeline with no scheduler
`step` to hook is refused at compile time. Inside `callback_on_step_end(pipe, i, t, kwargs)`,
`fx_fp8.current_step()` is already i + 1 (the step about to run). A `quantization` map of
components (fx_fp8/config/components.py) also prepares and compiles the text encoders it names.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8.compile.backend import MODES
from fx_fp8.compile.downstream import check_downstream_takes, check_inductor_options
from fx_fp8.config.components import ComponentConfigs
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.values import short_repr
from fx_fp8.graph.dynamo_internals import is_compiled_module
from fx_fp8.pipeline.apply_options import (apply_pipeline_options, check_pipeline_options, compile_regions,
                                           has_diffusers_hooks)
from fx_fp8.pipeline.offload import check_weights_readable, reapply_group_offload
from fx_fp8.pipeline.options import PipelineOptions
from fx_fp8.pipeline.state import STATE_ATTR, TRANSFORMER_ATTRS, PipelineFP8State
from fx_fp8.pipeline.step_publishing import (call_recorder, check_scheduler, install_scheduler_hook, outside_run,
                                             wrapped_class)
from fx_fp8.compile.stored_config import StoredConfigConflict, settle, stored_config
from fx_fp8.quant.prepare import prepare_model
from fx_fp8.quant.rules import check_not_prepared

BACKENDS = ("fp8", "fp8_npu")


def compile_pipeline(pipe, config=None, *, backend: str = "fp8", prepare: bool = True, keep_weights: bool = False,
                     regional: bool = False, mode: Optional[str] = None,
                     compile_kwargs: Optional[Mapping[str, Any]] = None,
                     inductor_options: Optional[Mapping[str, Any]] = None, parallel_config=None, cache_backend=None,
                     cache_config=None, **overrides):
    """Compile the denoising transformer(s) of a diffusers pipeline with an FP8 backend, in place.

    config: an FP8Config, a mapping, a YAML path (flat or vLLM-Omni stage config) or None
      (both FP8 attention and FP8 linears); `overrides` are config keys applied on top. It
      applies to the denoising transformers; a `quantization` mapping of components
      ({"transformer": "fp8", "text_encoder": {"method": "int8"}, "text_encoder_2": None},
      vLLM-Omni's component map, fx_fp8/config/components.py) scopes the linears by component:
      the other components named (text encoders, ...) get their linears quantized (prepared and
      compiled with the same backend, attention native).
    backend: "fp8" (lowering from the tensors' device) or "fp8_npu".
    prepare: fx_fp8.prepare_model each transformer on its first call, with that call's inputs
      (so the sensitive layers are found by the graph's structure, as the backend finds them;
      by name, up front, where the model carries diffusers hooks or gets a cache or context
      parallelism from compile_pipeline: tracing it would move the hooks' state), so the quantized weights
      replace the original ones in memory. This is destructive: the original weights are
      freed, so restore_pipeline(pipe) refuses (ValueError) and restore_pipeline(pipe,
      linears="quantized") keeps the QuantizedLinear modules, unless keep_weights=True, which
      keeps the original nn.Linear modules on the CPU to put back (the original weights stay
      in host memory). A transformer already prepared by prepare_model is refused: pass
      prepare=False to compile it as it is.
    regional: compile each transformer block by block, as diffusers' compile_repeated_blocks does
      (one compile per block class instead of the whole model: the cold start drops several-fold,
      see README "Compile time"); the transformers stay the pipeline's own modules.
    mode: torch.compile's mode ("default", "reduce-overhead", "max-autotune", ...: Inductor downstream);
      the same as compile_kwargs={"mode": ...}. It travels in the backend options (torch.compile refuses
      mode= together with options=).
    compile_kwargs: extra torch.compile arguments (mode, dynamic, fullgraph, ...).
    inductor_options: Inductor config patches for every compiled graph (e.g. {"cpp_wrapper": True}),
      on top of the mode's; the backend option of the same name (Inductor downstream).
    parallel_config / cache_backend / cache_config: vLLM-Omni's context-parallel degrees
      ({ulysses_degree, ring_degree}) and cache backend (first_block_cache, taylorseer, mag_cache)
      with its JSON-like config, mapped onto diffusers by fx_fp8.pipeline.options; they override the same
      keys of a config YAML / mapping. Under torchrun with ulysses_degree x ring_degree processes.
    Returns `pipe`; fx_fp8.pipeline_state(pipe).calls records each transformer
    call of the last run (step, transformer, step variant).
    """
    if backend not in BACKENDS:
        raise ValueError(f"invalid backend {short_repr(backend)}: expected one of {', '.join(BACKENDS)}")
    if keep_weights and not prepare:
        raise ValueError("keep_weights=True with prepare=False: without prepare the original weights are never "
                         "freed, so there is nothing to keep; drop keep_weights or use prepare=True")
    if getattr(pipe, STATE_ATTR, None) is not None:
        raise ValueError(f"{type(pipe).__name__} is already compiled by fx_fp8.compile_pipeline; "
                         "call fx_fp8.restore_pipeline(pipe) first")
    scoped = ComponentConfigs.split(config, overrides)
    transformers = _find_transformers(pipe)
    configs = {attr: scoped.transformer_config(attr) for attr in transformers}
    others = _other_components(pipe, scoped)   # {name: (module, config)}: text encoders, ...
    cfg = next(iter(configs.values()))
    # pipeline options (context parallelism, cache hooks) read from the same config (options.py)
    popts = PipelineOptions.load(config, parallel_config=parallel_config, cache_backend=cache_backend,
                                 cache_config=cache_config)
    # a transformer quantized at load compiles as it was loaded: its stored config, never prepared again
    loaded = _loaded_configs(transformers, scoped, configs)
    if prepare:
        for attr, module in {**transformers, **{n: m for n, (m, _) in others.items()}}.items():
            if attr in loaded or not {**configs, **{n: c for n, (_, c) in others.items()}}[attr].linear_enabled:
                continue
            try:
                check_not_prepared(module, "compile_pipeline(prepare=True) cannot prepare it again",
                                   "pass prepare=False to compile it as it is")
            except ValueError as e:
                raise ValueError(f"pipe.{attr}: {e}") from None
            check_weights_readable(module, attr)
    if not callable(pipe):
        raise ValueError(f"{type(pipe).__name__} is not callable: compile_pipeline publishes the denoising step "
                         "around the pipeline's __call__")
    scheduler = check_scheduler(pipe)
    if regional:
        _check_regional(transformers, popts)
    options = {"config": cfg}
    if inductor_options is not None:
        options["inductor_options"] = check_inductor_options(inductor_options)
        check_downstream_takes(cfg, options["inductor_options"])
    if mode is not None:  # checked with compile_kwargs' mode below
        if compile_kwargs and "mode" in compile_kwargs and compile_kwargs["mode"] != mode:
            raise ValueError(f"mode={short_repr(mode)} and compile_kwargs['mode']={short_repr(compile_kwargs['mode'])} disagree: give one")
        compile_kwargs = {**(compile_kwargs or {}), "mode": mode}
    compile_kwargs = _check_compile_kwargs(compile_kwargs, options)
    # refuse what would fail (and join the torchrun job), before any change
    check_pipeline_options(popts, list(transformers.values()), compile_kwargs=compile_kwargs)

    # everything is checked: only now change the transformers
    state = PipelineFP8State(config=cfg, backend=backend, originals=dict(transformers), compiled={}, prepared={},
                             kept_linears={}, base_class=type(pipe))
    shared_options = options
    _compile_others(state, others, backend, shared_options, compile_kwargs, prepare, keep_weights)
    for attr, module in transformers.items():
        cfg = configs[attr]
        options = {**shared_options, "config": loaded[attr] if attr in loaded else cfg}
        if regional:
            module.compile_repeated_blocks(backend=backend, options=options, **compile_kwargs)
            compiled = module
        else:
            compiled = torch.compile(module, backend=backend, options=options, **compile_kwargs)

        def setup(example_inputs, attr=attr, module=module, options=options, cfg=cfg):
            """prepare, then cache hooks, then context parallelism, then regions (apply_options.py):
            preparing after the parallel hooks would drop diffusers' gather hook on proj_out."""
            if attr in state.extras:
                return  # already set up
            state.pending_setup.pop(attr, None)
            if prepare and attr not in loaded:
                check_weights_readable(module, attr)
                linears = dict(module.named_modules()) if keep_weights else {}
                with outside_run():  # its trace runs the model's hooks: not a call of the run
                    state.prepared[attr] = prepare_model(module, cfg, example_inputs=example_inputs)
                if keep_weights:
                    state.kept_linears[attr] = {n: linears[n].to("cpu") for n in state.prepared[attr]["quantized"]}
                if state.prepared[attr]["quantized"]:
                    reapply_group_offload(module)
            state.extras[attr] = apply_pipeline_options(module, popts)
            compile_regions(state.extras[attr], module, backend, options, compile_kwargs)

        if prepare and attr not in loaded and cfg.linear_enabled and not has_diffusers_hooks(module) and not popts.enabled:
            # on the first call: prepare_model traces the model on that call's inputs, so it finds the
            # sensitive layers by structure as the backend does (by name otherwise)
            state.pending_setup[attr] = setup
            state.hook_handles.append(compiled.register_forward_pre_hook(_once(setup), with_kwargs=True))
        else:
            setup(None)
        state.hook_handles.append(compiled.register_forward_pre_hook(call_recorder(state, attr)))
        state.compiled[attr] = compiled
    install_scheduler_hook(state, scheduler)
    object.__setattr__(pipe, STATE_ATTR, state)
    for attr, compiled in state.compiled.items():
        setattr(pipe, attr, compiled)
    pipe.__class__ = wrapped_class(state.base_class)
    return pipe


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
            if scoped.specs is not None and (attr in scoped.specs or scoped.default is not None):
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
        raise ValueError(f"{type(pipe).__name__} has no denoising transformer: expected an nn.Module in "
                         f"{' or '.join(TRANSFORMER_ATTRS)}; fx_fp8.compile_pipeline compiles DiT pipelines "
                         "(Flux, Qwen-Image, Wan, Z-Image, SD3); for a bare model use torch.compile(model, backend='fp8')")
    for a, m in found.items():
        if is_compiled_module(m):
            raise ValueError(f"pipe.{a} is already torch.compile'd: pass the uncompiled pipeline to compile_pipeline")
        if not isinstance(m, nn.Module):
            raise ValueError(f"pipe.{a} is a {type(m).__name__}, not a torch.nn.Module")
    return found


def _other_components(pipe, scoped: ComponentConfigs) -> dict:
    """{name: (module, config)} of the components a component map names that are not denoising
    transformers; a ValueError naming an unknown component (and the pipeline's), or one that is
    not a torch module, before anything changes."""
    out = {}
    components = getattr(pipe, "components", None)
    known = list(components) if isinstance(components, dict) else []
    for name in scoped.named:
        if name in TRANSFORMER_ATTRS and getattr(pipe, name, None) is not None:
            continue
        listed = name in known if known else hasattr(pipe, name)  # `components` (diffusers), else attributes
        if not listed:
            raise ValueError(f"quantization names component {name!r}, which {type(pipe).__name__} does not have; its "
                             f"components: {', '.join(known) or '(none listed)'}")
        module = getattr(pipe, name, None)
        if not isinstance(module, nn.Module):
            raise ValueError(f"quantization names component {name!r}, but pipe.{name} is "
                             f"{'None (not loaded)' if module is None else 'a ' + type(module).__name__}, not a "
                             "torch.nn.Module: only model components have linears to quantize")
        if is_compiled_module(module):
            raise ValueError(f"pipe.{name} is already torch.compile'd: pass the uncompiled pipeline to compile_pipeline")
        if scoped.specs[name] is not None:
            out[name] = (module, scoped.component_config(name))
    return out


def _compile_others(state: PipelineFP8State, others: dict, backend: str, options: dict, compile_kwargs: dict,
                    prepare: bool, keep_weights: bool) -> None:
    """Text encoders and the other components a component map names: prepared by name (they run
    once per prompt, outside the denoising loop), then compiled with the pipeline's backend."""
    for name, (module, cfg) in others.items():
        state.originals[name] = module
        if prepare and cfg.linear_enabled:
            linears = dict(module.named_modules()) if keep_weights else {}
            state.prepared[name] = prepare_model(module, cfg)
            if keep_weights:
                state.kept_linears[name] = {n: linears[n].to("cpu") for n in state.prepared[name]["quantized"]}
        state.compiled[name] = torch.compile(module, backend=backend, options={**options, "config": cfg},
                                             **compile_kwargs)


def _check_regional(transformers: dict, popts) -> None:
    """regional=True needs blocks to compile (diffusers' `_repeated_blocks`), and is not combined
    with the cache hooks or context parallelism, which compile regions of their own."""
    for attr, module in transformers.items():
        if not getattr(module, "_repeated_blocks", None):
            raise ValueError(f"regional=True: pipe.{attr} ({type(module).__name__}) declares no _repeated_blocks "
                             "to compile; use regional=False")
    if popts.enabled:
        raise ValueError("regional=True is not combined with cache_backend or parallel_config yet (they compile "
                         "regions of their own); use regional=False")


def _once(setup):
    """A forward pre-hook that runs setup((args, kwargs)) before the first call (setup itself
    returns at once when it has run).

    No lock is held while setup runs user code: prepare_model traces the model, which runs its
    forward pre-hooks again (with regional=True this hook sits on the model itself). That nested
    call, in the thread running setup, passes through; a call from another thread waits until
    setup has ended (and runs it itself if setup raised)."""
    ready = threading.Condition()
    running: list = []  # the thread running setup, while it runs
    done = [False]

    @torch.compiler.disable  # bookkeeping, never traced (prepare_model's trace runs the model's hooks)
    def hook(compiled, args, kwargs):
        if done[0]:
            return None
        me = threading.get_ident()
        with ready:  # held only to read and set `running`
            if running and running[0] == me:
                return None  # setup's own trace of the model
            while running:
                ready.wait()
            if done[0]:
                return None
            running.append(me)
        try:
            setup((args, kwargs))
            done[0] = True
        finally:
            with ready:
                running.clear()
                ready.notify_all()
        return None

    return hook


def _check_compile_kwargs(compile_kwargs, options: dict) -> dict:
    """torch.compile keywords, checked before anything is prepared. `mode` travels in the
    backend options (torch.compile refuses `mode` together with `options`)."""
    kwargs = dict(compile_kwargs or {})
    allowed = set(inspect.signature(torch.compile).parameters) - {"model", "backend", "options", "mode"}
    for key in kwargs:
        if key in ("backend", "options", "model"):
            raise ValueError(f"compile_kwargs may not set {short_repr(key)}: compile_pipeline sets it")
        if key not in allowed and key != "mode":
            raise ValueError(f"unknown torch.compile keyword {short_repr(key)} in compile_kwargs; known: {sorted(allowed | {'mode'})}")
    if "mode" in kwargs:
        mode = kwargs.pop("mode")
        if mode not in MODES:
            raise ValueError(f"invalid mode {short_repr(mode)}: expected one of {', '.join(map(str, MODES[1:]))}")
        options["mode"] = mode
    return kwargs
