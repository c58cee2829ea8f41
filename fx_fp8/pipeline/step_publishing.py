"""Publishing the denoising step during a pipeline run, and recording each transformer call.

The pipeline's `__call__` starts the count at 0 (and clears it when it returns or raises), and each
`scheduler.step` call, which diffusers makes once per denoising step after that step's transformer
calls, advances it by one. Both calls of a classifier-free-guidance step therefore see the same
step, and the count does not restart when Wan2.2 switches expert (one shared scheduler).

The run's number of steps (for step selectors counting from the end, "last:k") is read from the
scheduler the first time a selector needs it, once the pipeline has set its timesteps: the
timesteps left after the pipeline's start index (img2img pipelines start part-way,
scheduler.set_begin_index), which is the number of scheduler.step calls the run makes. It is read
once per run, so every call of the run (both calls of a CFG step, both Wan2.2 experts) sees one total.

The step and the record of a run live in context variables (fx_fp8.steps): several compiled
pipelines may run at once in different threads or asyncio tasks, each seeing its own steps.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from fx_fp8 import steps as _steps
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.pipeline.apply_options import on_pipeline_run
from fx_fp8.pipeline.state import STATE_ATTR, PipelineFP8State, SchedulerHook, TransformerCall
from fx_fp8.quant.weight_state import refresh_copies


@dataclass
class _Run:
    """One pipeline call in progress, in the context (thread / task) that runs it."""

    state: PipelineFP8State
    scheduler: object = None
    step: int = 0
    scheduler_steps: int = 0
    calls: list = field(default_factory=list)
    total: Optional[int] = None  # the run's number of steps, once a selector asked for it

    def on_variant(self, variant: str) -> None:
        if self.calls:
            self.calls[-1].variants.append(variant)

    def total_steps(self) -> int:
        if self.total is None:
            self.total = scheduler_total(self.scheduler)
        return self.total


def scheduler_total(scheduler) -> int:
    """The number of denoising steps of the run the scheduler was set up for: its timesteps past
    the begin index an img2img pipeline sets (each is one scheduler.step call)."""
    timesteps = getattr(scheduler, "timesteps", None)
    try:
        n = len(timesteps)
    except TypeError:
        n = None
    begin = getattr(scheduler, "begin_index", None)
    if isinstance(begin, bool) or not isinstance(begin, (int, type(None))):
        begin = None  # a scheduler without diffusers' begin_index property
    total = None if n is None else n - (begin or 0)
    if total is None or total < 1:
        raise ValueError(
            f"fx_fp8: a step selector counts from the end of the run (last:k) but "
            f"{type(scheduler).__name__}.timesteps ({timesteps!r:.60}) gives no number of steps "
            f"(begin index {begin!r}) at this transformer call: publish it yourself with "
            "fx_fp8.set_step(i, total=N) around each step, or use absolute steps"
        )
    return total


#: the pipeline run in progress in this thread / task (nested pipeline calls stack by token)
_RUN: contextvars.ContextVar[Optional[_Run]] = contextvars.ContextVar("fx_fp8_pipeline_run", default=None)


def _current_run(state: PipelineFP8State) -> Optional[_Run]:
    run = _RUN.get()
    return run if run is not None and run.state is state else None


def call_recorder(state: PipelineFP8State, attr: str):
    """A forward pre-hook for pipe.<attr> that records each call (and its step) in the run in progress.
    Never traced: Dynamo runs it as it is when a trace of the model (prepare_model's) runs its hooks."""

    @torch.compiler.disable
    def hook(module, args):
        run = _current_run(state)
        if run is not None:
            run.calls.append(TransformerCall(step=_steps.current_step(), transformer=attr))

    return hook


@contextlib.contextmanager
def outside_run():
    """Transformer calls made meanwhile belong to no run (prepare_model's trace of the model on its
    first call runs the model's hooks: it is not one of the run's transformer calls)."""
    token = _RUN.set(None)
    try:
        yield
    finally:
        _RUN.reset(token)


def check_scheduler(pipe):
    scheduler = getattr(pipe, "scheduler", None)
    step = getattr(scheduler, "step", None) if scheduler is not None else None
    if step is None or not callable(step):
        what = (
            "no scheduler"
            if scheduler is None
            else f"a scheduler ({type(scheduler).__name__}) without a callable step()"
        )
        raise ValueError(
            f"{type(pipe).__name__} has {what}: fx_fp8.compile_pipeline publishes the denoising step by "
            "hooking pipe.scheduler.step, so diffusion_kv_cache_skip_steps could not work. Compile the "
            "transformer yourself and call fx_fp8.set_step(i) (or `with fx_fp8.denoising_step(i):`) "
            "around each step's transformer calls"
        )
    return scheduler


def install_scheduler_hook(state: PipelineFP8State, scheduler) -> None:
    """scheduler.step advances the published step by one, for runs of this state's pipeline."""
    original = scheduler.step
    state.scheduler_hook = SchedulerHook(scheduler, "step" in vars(scheduler), vars(scheduler).get("step"))

    @functools.wraps(original)
    def step_and_advance(*args, **kwargs):
        out = original(*args, **kwargs)
        run = _current_run(state)
        if run is not None:  # a scheduler used outside a pipeline call publishes nothing
            run.scheduler_steps += 1
            run.step += 1
            _steps.advance_step(run.step)
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


def remove_scheduler_hook(state: PipelineFP8State) -> None:
    hook = state.scheduler_hook
    if hook is None:
        return
    if hook.had_own_step:
        hook.scheduler.step = hook.own_step
    else:
        vars(hook.scheduler).pop("step", None)
    state.scheduler_hook = None


@functools.lru_cache(maxsize=None)
def wrapped_class(cls: type) -> type:
    """A subclass of the pipeline's class whose __call__ publishes the step (Python looks
    __call__ up on the type, so an instance attribute would not do). Made once per class."""

    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        state = getattr(self, STATE_ATTR, None)
        if state is None:
            return cls.__call__(self, *args, **kwargs)
        with _run(self, state):
            return cls.__call__(self, *args, **kwargs)

    # same name and module: diffusers writes the class name into model_index.json
    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": __call__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_fx_fp8_base_class": cls,
        },
    )


@contextlib.contextmanager
def _run(pipe, state: PipelineFP8State):
    for attr, compiled in state.compiled.items():
        if getattr(pipe, attr, None) is not compiled:
            raise RuntimeError(
                f"pipe.{attr} was replaced after fx_fp8.compile_pipeline; call "
                "fx_fp8.restore_pipeline(pipe) first, then compile the new pipeline"
            )
    scheduler = getattr(pipe, "scheduler", None)
    hooked = state.scheduler_hook.scheduler if state.scheduler_hook is not None else None
    if scheduler is not hooked or not _hooked(scheduler, state):
        # the user swapped schedulers, or another pipeline sharing this scheduler was restored
        remove_scheduler_hook(state)
        install_scheduler_hook(state, check_scheduler(pipe))
    # caches enabled on the transformers since compile_pipeline are treated like those given to it
    on_pipeline_run(state)
    # a weight written through `.data` in place since the last run (no per-call check sees it):
    # compile-time copies follow it (a digest of each unprepared weight with copies, once per run)
    for module in state.originals.values():
        refresh_copies(module)
    run = _Run(state, scheduler=getattr(pipe, "scheduler", None))
    run_token = _RUN.set(run)
    state.running += 1
    try:
        with _steps.pipeline_steps(run.total_steps), _steps.variant_listener(run.on_variant):
            yield
    finally:
        state.running -= 1
        _RUN.reset(run_token)
        state.calls, state.scheduler_steps = run.calls, run.scheduler_steps
    if run.calls and run.scheduler_steps == 0 and state.config.has_step_skips:
        # Never a silent no-op: every call ran as step 0.
        warnings.warn(
            f"fx_fp8: {type(pipe).__name__} called its transformer {len(run.calls)} times but never "
            "pipe.scheduler.step, so every call ran as denoising step 0 and "
            "diffusion_kv_cache_skip_steps did not select steps",
            RuntimeWarning,
            stacklevel=3,
        )
    if run.total is not None and run.scheduler_steps not in (0, run.total):
        # last:k was placed with a total the run did not make: say so rather than skip the wrong steps
        warnings.warn(
            f"fx_fp8: {type(pipe).__name__} made {run.scheduler_steps} scheduler steps but its scheduler "
            f"gave {run.total} as the run's number of steps, so the step selectors counting from the end "
            "(last:k) selected other steps than the last ones: publish the total yourself "
            "(fx_fp8.set_step(i, total=N)) or use absolute steps",
            RuntimeWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def publish_steps(pipe):
    """Publish the denoising step during pipeline calls made inside the block, for a pipeline
    whose transformer was compiled without compile_pipeline: step 0 when a call starts, +1
    after each scheduler.step, exactly as compile_pipeline does (the same mechanism)."""
    state = getattr(pipe, STATE_ATTR, None)
    if state is not None:  # compile_pipeline already publishes for this pipeline
        yield state
        return
    state = PipelineFP8State(
        config=FP8Config(), backend="", originals={}, compiled={}, prepared={}, kept_linears={}, base_class=type(pipe)
    )
    install_scheduler_hook(state, check_scheduler(pipe))
    # each pipeline call in the block starts at step 0, as under compile_pipeline
    setattr(pipe, STATE_ATTR, state)
    pipe.__class__ = wrapped_class(state.base_class)
    try:
        yield state
    finally:
        pipe.__class__ = state.base_class
        vars(pipe).pop(STATE_ATTR, None)
        remove_scheduler_hook(state)
