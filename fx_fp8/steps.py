"""The denoising step symbol.

Pipelines publish the current step with set_step / denoising_step; a graph
compiled with diffusion_kv_cache_skip_steps reads only "is this step skipped?"
(one bool per call) to pick between its two compiled variants, so a run of N
steps uses exactly two graphs and never recompiles per step.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional


class _StepState:
    step: Optional[int] = None
    warned_unpublished: bool = False


STATE = _StepState()


def set_step(step: Optional[int]) -> None:
    """Publish the current denoising step (0-based across the whole request); None clears it."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"invalid denoising step {step!r}: expected an integer >= 0 or None")
    STATE.step = step


def current_step() -> Optional[int]:
    return STATE.step


@contextlib.contextmanager
def denoising_step(step: int):
    """`with fx_fp8.denoising_step(i): transformer(...)` for custom loops."""
    previous = STATE.step
    set_step(step)
    try:
        yield
    finally:
        STATE.step = previous


def variant_for_current_step(skip_steps: frozenset) -> str:
    """'native' when the published step is skipped (or none was published), else 'fp8'."""
    step = STATE.step
    if step is None:
        if not STATE.warned_unpublished:
            STATE.warned_unpublished = True
            warnings.warn(
                "fx_fp8: diffusion_kv_cache_skip_steps is set but no denoising step was published "
                "(use fx_fp8.compile_pipeline, fx_fp8.set_step(i) or `with fx_fp8.denoising_step(i):`); "
                "running the native-attention graph for these calls",
                stacklevel=3,
            )
        return "native"
    return "native" if step in skip_steps else "fp8"
