"""compile_pipeline / restore_pipeline: FP8 for a whole diffusers pipeline.

    pipe = fx_fp8.compile_pipeline(pipe, "stage.yaml", diffusion_kv_cache_skip_steps="0,1")
    image = pipe(prompt_embeds=..., num_inference_steps=28).images[0]
    fx_fp8.restore_pipeline(pipe)          # the original weights need keep_weights=True (or prepare=False)

What it does:
  * every denoising transformer (`transformer`, and `transformer_2` of two-expert
    Wan2.2 pipelines) is optionally prepared (`prepare_model`: FP8 weights, the
    originals freed) and replaced by `torch.compile(t, backend="fp8", options={"config": cfg})`;
  * the pipeline publishes its denoising step so `diffusion_kv_cache_skip_steps`
    works: the pipeline's `__call__` starts the count at 0 (and clears it when it
    returns or raises), and each `scheduler.step` call, which diffusers makes once
    per denoising step after that step's transformer calls, advances it by one.
    Both calls of a classifier-free-guidance step therefore see the same step, and
    the count does not restart when Wan2.2 switches expert (one shared scheduler).
    A pipeline with no scheduler `step` to hook is refused at compile time.

The step and the record of a run live in context variables (fx_fp8.steps):
several compiled pipelines may run at once in different threads or asyncio
tasks, each seeing its own steps. Inside `callback_on_step_end(pipe, i, t,
kwargs)`, `fx_fp8.current_step()` is already i + 1 (the step about to run).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8 import parallel as _parallel
from fx_fp8 import steps as _steps
from fx_fp8.backend import MODES
from fx_fp8.config import FP8Config
from fx_fp8.report import get_reports
from fx_fp8.prepare import prepare_model
from fx_fp8.rules import check_not_prepared
from fx_fp8.weights import QuantizedLinear, release_quantized_copies, watch_weights

#: pipeline attributes holding a denoising transformer, in the order they run
TRANSFORMER_ATTRS = ("transformer", "transformer_2")
BACKENDS = ("fp8", "fp8_npu")
_STATE_ATTR = "_fx_fp8"


@dataclass
class TransformerCall:
    """One call of a compiled transformer during a pipeline run."""

    step: Optional[int]        # the published denoising step
    transformer: str           # "transformer" or "transformer_2"
    variants: list = field(default_factory=list)  # one entry per compiled graph run: "fp8" | "native"

    @property
    def variant(self) -> Optional[str]:
        """The step variant that ran; None for a config without step skips (one graph, no choice);
        "mixed" would mean the graphs of one call disagreed (a bug)."""
        kinds = set(self.variants)
        if not kinds:
            return None
        return kinds.pop() if len(kinds) == 1 else "mixed"


@dataclass
class PipelineFP8State:
    """What compile_pipeline changed on a pipeline, and a record of its last run (`calls`)."""

    config: FP8Config
    backend: str
    originals: dict                     # attr -> the transformer before compilation
    compiled: dict                      # attr -> the torch.compile'd module put on the pipeline
    prepared: dict                      # attr -> prepare_model's result (or None)
    kept_linears: dict                  # attr -> {linear name: original nn.Linear} (keep_weights=True)
    base_class: type
    scheduler: Any = None
    scheduler_had_own_step: bool = False
    scheduler_own_step: Any = None
    hook_handles: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)   # attr -> fx_fp8.parallel.TransformerExtras (issue 12)
    pending_setup: dict = field(default_factory=dict)  # attr -> setup() still to run at the first call
    scheduler_steps: int = 0            # scheduler.step calls of the last finished run
    calls: list = field(default_factory=list)  # TransformerCall per transformer call of the last finished run
    running: int = 0                    # runs in progress (in any thread)

    def reports(self) -> dict:
        """{attr: [CompileReport, ...]} of each compiled transformer."""
        return {attr: get_reports(compiled) for attr, compiled in self.compiled.items()}

    def step_variants(self) -> list:
        """[[variant of each transformer call] for each step] of the last run."""
        out: list = []
        for c in self.calls:
            while len(out) <= (c.step or 0):
                out.append([])
            out[c.step or 0].append(c.variant)
        return out


def pipeline_state(pipe) -> PipelineFP8State:
    """The PipelineFP8State of a pipeline prepared by compile_pipeline (its `calls` record the last run)."""
    state = getattr(pipe, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(pipe).__name__} was not compiled with fx_fp8.compile_pipeline")
    return state


# -- the run record: which variant each call ran -------------------------------------------
@dataclass
class _Run:
    """One pipeline call in progress, in the context (thread / task) that runs it."""

    state: PipelineFP8State
    step: int = 0
    scheduler_steps: int = 0
    calls: list = field(default_factory=list)

    def on_variant(self, variant: str) -> None:
        if self.calls:
            self.calls[-1].variants.append(variant)


#: the pipeline run in progress in this thread / task (nested pipeline calls stack by token)
_RUN: contextvars.ContextVar[Optional[_Run]] = contextvars.ContextVar("fx_fp8_pipeline_run", default=None)


def _current_run(state: PipelineFP8State) -> Optional[_Run]:
    run = _RUN.get()
    return run if run is not None and run.state is state else None


def _pre_hook(state: PipelineFP8State, attr: str):
    def hook(module, args):
        run = _current_run(state)
        if run is not None:
            run.calls.append(TransformerCall(step=_steps.current_step(), transformer=attr))
    return hook


# -- compile / restore ---------------------------------------------------------------------
def _find_transformers(pipe) -> dict:
    found = {a: getattr(pipe, a, None) for a in TRANSFORMER_ATTRS}
    found = {a: m for a, m in found.items() if m is not None}
    if not found:
        raise ValueError(f"{type(pipe).__name__} has no denoising transformer: expected an nn.Module in "
                         f"{' or '.join(TRANSFORMER_ATTRS)}; fx_fp8.compile_pipeline compiles DiT pipelines "
                         "(Flux, Qwen-Image, Wan, Z-Image, SD3); for a bare model use torch.compile(model, backend='fp8')")
    for a, m in found.items():
        if isinstance(m, torch._dynamo.eval_frame.OptimizedModule):
            raise ValueError(f"pipe.{a} is already torch.compile'd: pass the uncompiled pipeline to compile_pipeline")
        if not isinstance(m, nn.Module):
            raise ValueError(f"pipe.{a} is a {type(m).__name__}, not a torch.nn.Module")
    return found


def _check_scheduler(pipe):
    scheduler = getattr(pipe, "scheduler", None)
    step = getattr(scheduler, "step", None) if scheduler is not None else None
    if step is None or not callable(step):
        what = "no scheduler" if scheduler is None else f"a scheduler ({type(scheduler).__name__}) without a callable step()"
        raise ValueError(f"{type(pipe).__name__} has {what}: fx_fp8.compile_pipeline publishes the denoising step by "
                         "hooking pipe.scheduler.step, so diffusion_kv_cache_skip_steps could not work. Compile the "
                         "transformer yourself and call fx_fp8.set_step(i) (or `with fx_fp8.denoising_step(i):`) "
                         "around each step's transformer calls")
    return scheduler


def _install_scheduler_hook(state: PipelineFP8State, scheduler) -> None:
    original = scheduler.step
    state.scheduler = scheduler
    state.scheduler_had_own_step = "step" in vars(scheduler)
    state.scheduler_own_step = vars(scheduler).get("step")

    @functools.wraps(original)
    def step_and_advance(*args, **kwargs):
        out = original(*args, **kwargs)
        run = _current_run(state)
        if run is not None:  # a scheduler used outside a pipeline call publishes nothing
            run.scheduler_steps += 1
            run.step += 1
            _steps.set_step(run.step)
        return out

    step_and_advance._fx_fp8_state = state  # type: ignore[attr-defined]
    scheduler.step = step_and_advance


def _hooked(scheduler, state: PipelineFP8State) -> bool:
    """Is our wrapper in scheduler.step's chain of wrappers (functools.wraps sets __wrapped__)?"""
    fn = vars(scheduler).get("step")
    while fn is not None:
        if getattr(fn, "_fx_fp8_state", None) is state:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _remove_scheduler_hook(state: PipelineFP8State) -> None:
    scheduler = state.scheduler
    if scheduler is None:
        return
    if state.scheduler_had_own_step:
        scheduler.step = state.scheduler_own_step
    else:
        vars(scheduler).pop("step", None)
    state.scheduler = None


@functools.lru_cache(maxsize=None)
def _wrapped_class(cls: type) -> type:
    """A subclass of the pipeline's class whose __call__ publishes the step (Python looks
    __call__ up on the type, so an instance attribute would not do). Made once per class."""

    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        state = getattr(self, _STATE_ATTR, None)
        if state is None:
            return cls.__call__(self, *args, **kwargs)
        with _run(self, state):
            return cls.__call__(self, *args, **kwargs)

    # same name and module: diffusers writes the class name into model_index.json
    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "_fx_fp8_base_class": cls})


@contextlib.contextmanager
def _run(pipe, state: PipelineFP8State):
    for attr, compiled in state.compiled.items():
        if getattr(pipe, attr, None) is not compiled:
            raise RuntimeError(f"pipe.{attr} was replaced after fx_fp8.compile_pipeline; call "
                               "fx_fp8.restore_pipeline(pipe) first, then compile the new pipeline")
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not state.scheduler or not _hooked(scheduler, state):
        # the user swapped schedulers, or another pipeline sharing this scheduler was restored
        _remove_scheduler_hook(state)
        _install_scheduler_hook(state, _check_scheduler(pipe))
    for attr, setup in list(state.pending_setup.items()):
        if _has_hooks(state.originals[attr]):  # a cache enabled since compile_pipeline: set up now, by names
            setup(None)
    if state.extras:  # issue 12: compile cache hooks enabled after compile_pipeline like the others
        _parallel.on_pipeline_run(state)
    run = _Run(state)
    run_token = _RUN.set(run)
    state.running += 1
    try:
        with _steps.denoising_step(0), _steps.variant_listener(run.on_variant):
            yield
    finally:
        state.running -= 1
        _RUN.reset(run_token)
        state.calls, state.scheduler_steps = run.calls, run.scheduler_steps
    if run.calls and run.scheduler_steps == 0 and state.config.has_step_skips:
        # Never a silent no-op: every call ran as step 0.
        warnings.warn(f"fx_fp8: {type(pipe).__name__} called its transformer {len(run.calls)} times but never "
                      "pipe.scheduler.step, so every call ran as denoising step 0 and "
                      "diffusion_kv_cache_skip_steps did not select steps", RuntimeWarning, stacklevel=3)


def compile_pipeline(pipe, config=None, *, backend: str = "fp8", prepare: bool = True, keep_weights: bool = False,
                     regional: bool = False,
                     compile_kwargs: Optional[Mapping[str, Any]] = None, parallel_config=None, cache_backend=None,
                     cache_config=None, **overrides):
    """Compile the denoising transformer(s) of a diffusers pipeline with an FP8 backend, in place.

    config: an FP8Config, a mapping, a YAML path (flat or vLLM-Omni stage config) or None
      (both FP8 attention and FP8 linears); `overrides` are config keys applied on top.
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
    compile_kwargs: extra torch.compile arguments (mode, dynamic, fullgraph, ...).
    parallel_config / cache_backend / cache_config: vLLM-Omni's context-parallel degrees
      ({ulysses_degree, ring_degree}) and cache backend (first_block_cache, taylorseer, mag_cache)
      with its JSON-like config, mapped onto diffusers by fx_fp8.parallel; they override the same
      keys of a config YAML / mapping. Under torchrun with ulysses_degree x ring_degree processes.
    Returns `pipe`; fx_fp8.pipelines.pipeline_state(pipe).calls records each transformer
    call of the last run (step, transformer, step variant).
    """
    if backend not in BACKENDS:
        raise ValueError(f"invalid backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if keep_weights and not prepare:
        raise ValueError("keep_weights=True with prepare=False: without prepare the original weights are never "
                         "freed, so there is nothing to keep; drop keep_weights or use prepare=True")
    if getattr(pipe, _STATE_ATTR, None) is not None:
        raise ValueError(f"{type(pipe).__name__} is already compiled by fx_fp8.compile_pipeline; "
                         "call fx_fp8.restore_pipeline(pipe) first")
    cfg = FP8Config.load(config, **overrides)
    # pipeline options (context parallelism, cache hooks) read from the same config: fx_fp8/parallel.py
    popts = _parallel.PipelineOptions.load(config, parallel_config=parallel_config, cache_backend=cache_backend,
                                           cache_config=cache_config)
    transformers = _find_transformers(pipe)
    if prepare and cfg.linear_enabled:
        for attr, module in transformers.items():
            try:
                check_not_prepared(module, "compile_pipeline(prepare=True) cannot prepare it again",
                                   "pass prepare=False to compile it as it is")
            except ValueError as e:
                raise ValueError(f"pipe.{attr}: {e}") from None
            _check_weights_readable(module, attr)
    if not callable(pipe):
        raise ValueError(f"{type(pipe).__name__} is not callable: compile_pipeline publishes the denoising step "
                         "around the pipeline's __call__")
    scheduler = _check_scheduler(pipe)
    if regional:
        _check_regional(transformers, popts)
    options = {"config": cfg}
    compile_kwargs = _check_compile_kwargs(compile_kwargs, options)
    # refuse what would fail or lose hooks (and join the torchrun job), before any change
    _parallel.check_pipeline_options(popts, list(transformers.values()), cfg, prepare=prepare,
                                     compile_kwargs=compile_kwargs)

    # everything is checked: only now change the transformers
    state = PipelineFP8State(config=cfg, backend=backend, originals=dict(transformers), compiled={}, prepared={},
                             kept_linears={}, base_class=type(pipe))
    for attr, module in transformers.items():
        if cfg.linear_enabled:  # before the first trace: two experts of one class then share one graph
            watch_weights(module)
        if regional:
            module.compile_repeated_blocks(backend=backend, options=options, **compile_kwargs)
            compiled = module
        else:
            compiled = torch.compile(module, backend=backend, options=options, **compile_kwargs)

        def setup(example_inputs, attr=attr, module=module):
            """prepare, then cache hooks, then context parallelism, then regions (fx_fp8/parallel.py):
            preparing after the parallel hooks would drop diffusers' gather hook on proj_out."""
            if attr in state.extras:
                return  # already set up
            state.pending_setup.pop(attr, None)
            if prepare:
                _check_weights_readable(module, attr)
                linears = dict(module.named_modules()) if keep_weights else {}
                state.prepared[attr] = prepare_model(module, cfg, example_inputs=example_inputs)
                if keep_weights:
                    state.kept_linears[attr] = {n: linears[n].to("cpu") for n in state.prepared[attr]["quantized"]}
                if state.prepared[attr]["quantized"]:
                    _reapply_group_offload(module)
            state.extras[attr] = _parallel.apply_pipeline_options(module, popts)
            _parallel.compile_regions(state.extras[attr], module, backend, options, compile_kwargs)

        if prepare and cfg.linear_enabled and not _has_hooks(module) and not popts.enabled:
            # on the first call: prepare_model traces the model on that call's inputs, so it finds the
            # sensitive layers by structure as the backend does (by name otherwise)
            state.pending_setup[attr] = setup
            state.hook_handles.append(compiled.register_forward_pre_hook(_once(setup), with_kwargs=True))
        else:
            setup(None)
        state.hook_handles.append(compiled.register_forward_pre_hook(_pre_hook(state, attr)))
        state.compiled[attr] = compiled
    _install_scheduler_hook(state, scheduler)
    object.__setattr__(pipe, _STATE_ATTR, state)
    for attr, compiled in state.compiled.items():
        setattr(pipe, attr, compiled)
    pipe.__class__ = _wrapped_class(state.base_class)
    return pipe


@contextlib.contextmanager
def publish_steps(pipe):
    """Publish the denoising step during pipeline calls made inside the block, for a pipeline
    whose transformer was compiled without compile_pipeline: step 0 when a call starts, +1
    after each scheduler.step, exactly as compile_pipeline does (the same mechanism)."""
    state = getattr(pipe, _STATE_ATTR, None)
    if state is not None:  # compile_pipeline already publishes for this pipeline
        yield state
        return
    state = PipelineFP8State(config=FP8Config(), backend="", originals={}, compiled={}, prepared={},
                             kept_linears={}, base_class=type(pipe))
    _install_scheduler_hook(state, _check_scheduler(pipe))
    try:
        with _run(pipe, state):
            yield state
    finally:
        _remove_scheduler_hook(state)


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


def _uncompile_blocks(module: nn.Module) -> None:
    """Undo nn.Module.compile on every submodule (regional compilation)."""
    for m in module.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None


def _has_hooks(module: nn.Module) -> bool:
    """Does the model carry diffusers hooks already (a cache the user enabled)? Then tracing it
    once more on real inputs would move the hooks' state; it is prepared by names, up front."""
    return any(getattr(m, "_diffusers_hook", None) is not None for m in module.modules())


def _once(setup):
    """A forward pre-hook that runs setup((args, kwargs)) before the first call (setup itself
    returns at once when it has run)."""
    lock = threading.Lock()

    def hook(compiled, args, kwargs):
        with lock:
            setup((args, kwargs))
        return None

    return hook


def _check_compile_kwargs(compile_kwargs, options: dict) -> dict:
    """torch.compile keywords, checked before anything is prepared. `mode` travels in the
    backend options (torch.compile refuses `mode` together with `options`)."""
    kwargs = dict(compile_kwargs or {})
    allowed = set(inspect.signature(torch.compile).parameters) - {"model", "backend", "options", "mode"}
    for key in kwargs:
        if key in ("backend", "options", "model"):
            raise ValueError(f"compile_kwargs may not set {key!r}: compile_pipeline sets it")
        if key not in allowed and key != "mode":
            raise ValueError(f"unknown torch.compile keyword {key!r} in compile_kwargs; known: {sorted(allowed | {'mode'})}")
    if "mode" in kwargs:
        mode = kwargs.pop("mode")
        if mode not in MODES:
            raise ValueError(f"invalid mode {mode!r} in compile_kwargs: expected one of {', '.join(map(str, MODES[1:]))}")
        options["mode"] = mode
    return kwargs


#: restore_pipeline(pipe, linears=...): what the prepared linears become
RESTORE_LINEARS = ("original", "quantized")


def restore_pipeline(pipe, *, linears: str = "original"):
    """Undo compile_pipeline: the original transformer objects, scheduler.step and __call__.

    linears: what the linears that compile_pipeline prepared become.
      "original" (the default): the original nn.Linear modules, in the transformer's current
        dtype and device (a pipe.to(...) after compile_pipeline is followed). They exist when
        compile_pipeline ran with keep_weights=True or prepare=False, or before the first call
        (nothing was prepared yet). After prepare=True without keep_weights=True their weights
        were freed: a ValueError says so and changes nothing; pass linears="quantized" then.
      "quantized": the QuantizedLinear modules stay (they run eagerly, in FP8); kept originals
        are dropped.
    The quantized copies the backend made for the transformers' weights (prepare=False) are
    released: a restored pipeline holds only its own weights. Group offloading enabled on a
    transformer is re-applied over the linears put back.
    """
    if linears not in RESTORE_LINEARS:
        raise ValueError(f"invalid linears {linears!r}: expected one of {', '.join(map(repr, RESTORE_LINEARS))}")
    state = pipeline_state(pipe)
    if state.running:
        raise RuntimeError("restore_pipeline called while the pipeline is running")
    put_back = {}  # attr -> [(name, kept nn.Linear, QuantizedLinear in the model)]
    for attr, original in state.originals.items():
        quantized = (state.prepared.get(attr) or {}).get("quantized", [])
        kept = state.kept_linears.get(attr)
        if linears == "original" and quantized and kept is None:
            raise ValueError(
                f"restore_pipeline(pipe): the original weights of the {len(quantized)} linears compile_pipeline "
                f"prepared in pipe.{attr} (first: {quantized[:3]}) were freed (prepare=True without "
                "keep_weights=True), so they cannot be put back. Pass restore_pipeline(pipe, linears='quantized') "
                "to keep them as QuantizedLinear modules (FP8, run eagerly), or compile with keep_weights=True "
                "(or prepare=False) to get the original weights back")
        if linears == "original" and kept:
            put_back[attr] = []
            for name, linear in kept.items():
                current = original.get_submodule(name)
                if not isinstance(current, QuantizedLinear):
                    raise ValueError(f"pipe.{attr}.{name} is a {type(current).__name__}, not the QuantizedLinear "
                                     "compile_pipeline put there: it was replaced since, so restore_pipeline will "
                                     "not put the original linear over it")
                put_back[attr].append((name, linear, current))
    # everything is checked: only now change the pipeline
    for handle in state.hook_handles:
        handle.remove()
    for attr, original in state.originals.items():
        _undo_extras(original, state.extras.get(attr))
    for attr, original in state.originals.items():
        for name, linear, current in put_back.get(attr, []):
            # the transformer may have moved since (pipe.to(dtype / device)): the original follows it
            linear = linear.to(device=current.weight.device, dtype=current.orig_dtype)
            parent, _, child = name.rpartition(".")
            setattr(original.get_submodule(parent) if parent else original, child, linear)
        if put_back.get(attr):
            _reapply_group_offload(original)
        release_quantized_copies(original)
        _uncompile_blocks(original)  # regional=True compiled its blocks in place
        setattr(pipe, attr, original)
    _remove_scheduler_hook(state)
    pipe.__class__ = state.base_class
    object.__delattr__(pipe, _STATE_ATTR)
    state.kept_linears.clear()
    return pipe


# -- offloading: diffusers' group offload and accelerate's hooks --------------------------------
def _reapply_group_offload(module: nn.Module) -> None:
    """Group offloading holds the modules and tensors it found when it was enabled: after
    linears are replaced (prepare, restore) its groups are rebuilt, so the new modules move with
    their group and the replaced ones are not kept alive by a stale group."""
    try:
        from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading
    except ImportError:  # no diffusers: nothing can have enabled it
        return
    _maybe_remove_and_reapply_group_offloading(module)


def _check_weights_readable(module: nn.Module, attr: str) -> None:
    """prepare reads every weight: weights offloaded to the meta device (accelerate's sequential
    CPU offload keeps them in its hooks) would be quantized as garbage, and the hooks would then
    write the original weights into the quantized slots."""
    on_meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    if on_meta:
        raise ValueError(f"pipe.{attr} has {len(on_meta)} weights on the meta device (first: {on_meta[:3]}): "
                         "offloaded by accelerate (pipe.enable_sequential_cpu_offload()) or not loaded, so "
                         "compile_pipeline(prepare=True) cannot quantize them. Call compile_pipeline and run the "
                         "pipeline once before enabling sequential offload, or pass prepare=False")


def _undo_extras(module, extras) -> None:
    if extras is not None:
        _parallel.undo_pipeline_options(module, extras)
