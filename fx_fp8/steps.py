"""The published denoising step: per thread and per async task, never process-global.

Pipelines publish the current step with set_step / denoising_step (or
fx_fp8.compile_pipeline does it for them); a graph compiled with
diffusion_kv_cache_skip_steps reads only "is this step skipped?" (one bool per
call) to pick between its two compiled variants, so a run of N steps uses
exactly two graphs and never recompiles per step.

The step lives in a contextvars.ContextVar: two pipelines run in two threads
(or two asyncio tasks) each see their own step. A new thread starts with no
step published.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

#: the current denoising step of this thread / task (None: nothing published)
_STEP: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("fx_fp8_denoising_step", default=None)
#: called with the variant ("fp8" / "native") each step-dispatching graph runs (a pipeline run's record)
_VARIANT_LISTENER: contextvars.ContextVar[Optional[Callable[[str], None]]] = contextvars.ContextVar(
    "fx_fp8_variant_listener", default=None)


def _check(step) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"invalid denoising step {step!r}: expected an integer >= 0 or None")


def set_step(step: Optional[int]) -> None:
    """Publish the current denoising step (0-based across the whole request) for this
    thread / task; None clears it."""
    _check(step)
    _STEP.set(step)


def current_step() -> Optional[int]:
    return _STEP.get()


@contextlib.contextmanager
def denoising_step(step: int):
    """`with fx_fp8.denoising_step(i): transformer(...)` for custom loops."""
    _check(step)
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


@contextlib.contextmanager
def variant_listener(listener: Callable[[str], None]):
    """Within this context, `listener(variant)` hears which variant each dispatching graph runs."""
    token = _VARIANT_LISTENER.set(listener)
    try:
        yield
    finally:
        _VARIANT_LISTENER.reset(token)


def variant_for_step(skip_steps, on_unpublished: Callable[[], None]) -> str:
    """'native' when the published step is skipped (or none was published: then
    `on_unpublished()` is told, so its owner can warn), else 'fp8'."""
    step = _STEP.get()
    if step is None:
        on_unpublished()
        variant = "native"
    else:
        variant = "native" if step in skip_steps else "fp8"
    listener = _VARIANT_LISTENER.get()
    if listener is not None:
        listener(variant)
    return variant
