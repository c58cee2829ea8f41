"""PipelineFP8State: what compile_pipeline changed on a pipeline, and the record of its last run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.report import get_reports

#: pipeline attributes holding a denoising transformer, in the order they run
TRANSFORMER_ATTRS = ("transformer", "transformer_2")


#: the pipeline attribute holding its PipelineFP8State
STATE_ATTR = "_fx_fp8"


@dataclass
class TransformerCall:
    """One call of a compiled transformer during a pipeline run."""

    step: Optional[int]  # the published denoising step
    transformer: str  # "transformer" or "transformer_2"
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
class SchedulerHook:
    """The wrapper put on a scheduler's step, and what to put back."""

    scheduler: Any
    had_own_step: bool  # an instance attribute `step` existed before (else the class's is used)
    own_step: Any = None  # that instance attribute


@dataclass
class PipelineFP8State:
    """What compile_pipeline changed on a pipeline, and a record of its last run (`calls`)."""

    config: FP8Config
    backend: str
    originals: dict  # attr -> the transformer (or a component map's text encoder, ...) before compilation
    compiled: dict  # attr -> the torch.compile'd module put on the pipeline
    prepared: dict  # attr -> prepare_model's result (or None)
    kept_linears: dict  # attr -> {linear name: original nn.Linear} (keep_weights=True)
    base_class: type
    scheduler_hook: Optional[SchedulerHook] = None  # how the denoising step is published
    hook_handles: list = field(default_factory=list)  # forward pre-hooks on the compiled transformers
    extras: dict = field(default_factory=dict)  # attr -> apply_options.TransformerExtras (caches, parallelism)
    pending_setup: dict = field(default_factory=dict)  # attr -> setup() still to run at the first call
    scheduler_steps: int = 0  # scheduler.step calls of the last finished run
    calls: list = field(default_factory=list)  # TransformerCall per transformer call of the last finished run
    running: int = 0  # runs in progress (in any thread)

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
    state = getattr(pipe, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(pipe).__name__} was not compiled with fx_fp8.compile_pipeline")
    return state
