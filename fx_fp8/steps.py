"""The published denoising step: per thread and per async task, never process-global.

Pipelines publish the current step with set_step / denoising_step (or
fx_fp8.compile_pipeline does it for them); a graph compiled with step selectors
(diffusion_kv_cache_skip_steps for attention, quantization_config.skip_steps for
linears) maps the step to one variant of a closed set of at most four
(variant_name) per call, so a run of N steps uses at most four graphs and never
recompiles per step.

Step selectors may count from the end of the run ("last:2"): they need the
run's number of steps, published next to the step (set_step(i, total=N),
denoising_step(i, total=N); compile_pipeline reads it from the scheduler).

The step and the total live in contextvars.ContextVars: two pipelines run in two
threads (or two asyncio tasks) each see their own. A new thread starts with
nothing published.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional, Union

from fx_fp8.config.selectors import Selector
from fx_fp8.config.step_groups import format_step_groups
from fx_fp8.config.step_variants import variant_name

#: the current denoising step of this thread / task (None: nothing published)
_STEP: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("fx_fp8_denoising_step", default=None)
#: the run's number of denoising steps (None: not published); a pipeline run publishes a callable
#: that reads it from its scheduler when a selector first needs it (set_timesteps runs after the
#: pipeline call starts)
_TOTAL: contextvars.ContextVar[Union[int, Callable[[], int], None]] = contextvars.ContextVar(
    "fx_fp8_denoising_total", default=None
)
#: called with the variant ("fp8" / "native") each step-dispatching graph runs (a pipeline run's record)
_VARIANT_LISTENER: contextvars.ContextVar[Optional[Callable[[str], None]]] = contextvars.ContextVar(
    "fx_fp8_variant_listener", default=None
)


def _check(step) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"invalid denoising step {step!r}: expected an integer >= 0 or None")


def _check_total(step, total) -> None:
    if total is None:
        return
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"invalid number of denoising steps total={total!r}: expected an integer >= 1 or None")
    if step is None:
        raise ValueError(f"total={total} given without a step: publish the step with it (set_step(i, total={total}))")
    if step >= total:
        raise ValueError(
            f"invalid denoising step {step} for total={total}: steps of a {total}-step run are 0-{total - 1}"
        )


def set_step(step: Optional[int], total: Optional[int] = None) -> None:
    """Publish the current denoising step (0-based across the whole request) and the run's
    number of steps (`total`, needed by step selectors that count from the end, "last:k")
    for this thread / task. Both are set: a step published without total has none; None
    clears both."""
    _check(step)
    _check_total(step, total)
    _STEP.set(step)
    _TOTAL.set(total)


def current_step() -> Optional[int]:
    return _STEP.get()


def current_total() -> Optional[int]:
    """The run's number of denoising steps published with the step, or None."""
    total = _TOTAL.get()
    return total() if callable(total) else total


@contextlib.contextmanager
def _published(step: int, total) -> None:
    """The step and the run's total published for the block's duration (then the previous ones)."""
    token, total_token = _STEP.set(step), _TOTAL.set(total)
    try:
        yield
    finally:
        _TOTAL.reset(total_token)
        _STEP.reset(token)


def denoising_step(step: int, total: Optional[int] = None):
    """`with fx_fp8.denoising_step(i, total=N): transformer(...)` for custom loops (`total`, the
    run's number of steps, is needed by step selectors that count from the end: "last:k")."""
    _check(step)
    _check_total(step, total)
    return _published(step, total)


def pipeline_steps(total: Callable[[], int]):
    """A pipeline run: step 0 published, and `total()` (which reads the run's number of steps
    once it is known) as its total; advance_step moves the step within it."""
    return _published(0, total)


def advance_step(step: int) -> None:
    """The pipeline's next step; the run's total stays published."""
    _STEP.set(step)


@contextlib.contextmanager
def variant_listener(listener: Callable[[str], None]):
    """Within this context, `listener(variant)` hears which variant each dispatching graph runs."""
    token = _VARIANT_LISTENER.set(listener)
    try:
        yield
    finally:
        _VARIANT_LISTENER.reset(token)


def variant_for_step(
    skip_steps, on_unpublished: Callable[[], None], linear_skip_steps=None, linear_mode: str = "weight_only"
) -> str:
    """The variant of the published step: attention native when it is in `skip_steps`, linears
    `linear_mode` when it is in `linear_skip_steps`. With no step published, everything the
    selectors can skip is skipped and `on_unpublished()` is told, so its owner can warn."""
    step = _STEP.get()
    linear_skip_steps = linear_skip_steps or ()
    if step is None:
        on_unpublished()
        variant = variant_name(bool(skip_steps), bool(linear_skip_steps), linear_mode)
    else:
        # the total is read only for selectors that count from the end ("last:k")
        total = current_total() if _needs_total(skip_steps) or _needs_total(linear_skip_steps) else None
        variant = variant_name(
            _selected(skip_steps, step, total), _selected(linear_skip_steps, step, total), linear_mode
        )
    listener = _VARIANT_LISTENER.get()
    if listener is not None:
        listener(variant)
    return variant


def _needs_total(selector) -> bool:
    return isinstance(selector, Selector) and selector.needs_total


def _selected(selector, step: int, total: Optional[int]) -> bool:
    return selector.contains(step, total) if isinstance(selector, Selector) else step in selector


def step_group(groups) -> Optional[int]:
    """The index of the group holding the published step, for per-step activation scales;
    `groups` is flat [first0, last0, first1, last1, ...] (inclusive, sorted, disjoint). None
    when no step is published (the caller uses its all-steps scale). A published step in no
    group (the pipeline runs more steps than were calibrated) is an error: using another
    group's scale would clip or waste range with no sign of it."""
    step = _STEP.get()
    if step is None:
        return None
    for i in range(0, len(groups), 2):
        if groups[i] <= step <= groups[i + 1]:
            return i // 2
    calibrated = format_step_groups(zip(groups[::2], groups[1::2]))
    raise ValueError(
        f"fx_fp8: denoising step {step} is in none of the step groups ({calibrated}) of the per-step "
        "activation scales: recalibrate with fx_fp8.calibrate(..., per_step=True) over as many steps "
        "as the pipeline runs, or give step_groups that cover every step"
    )
