"""Step policies for the sensitivity search: the first and last k denoising steps in higher
precision, their FP8 FLOPs, measuring them and choosing one (`fx-fp8 sensitivity --step-policy`;
method in fx_fp8.tools.sensitivity)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fx_fp8.config.fp8_config import FP8Config


@dataclass
class StepPolicy:
    """One candidate step policy: the steps whose attention runs native and whose linears run
    `linear_mode` (weight_only: FP8 weights, high-precision activations; native)."""

    label: str
    attention_steps: list[int]
    linear_steps: list[int]
    linear_mode: str  # "weight_only" | "native" ("" when no linear step is skipped)
    fp8_work_fraction: float  # FP8 FLOPs it keeps / all-FP8 (from the report's FLOPs)
    mse: float = float("nan")
    psnr: float = float("nan")
    seconds: float = 0.0

    def overrides(self) -> dict:
        """FP8Config.replace keys of this policy."""
        out: dict = {"diffusion_kv_cache_skip_steps": list(self.attention_steps)}
        if self.linear_steps:
            out["quantization_skip_steps"] = ",".join(map(str, self.linear_steps))
            out["quantization_skip_steps_mode"] = self.linear_mode
        return out


def check_step_edges(step_edges, steps: int) -> list[int]:
    """The k values (first and last k steps) that leave at least one step in FP8."""
    edges = []
    for k in step_edges:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"step_edges: each k must be an integer >= 1, got {k!r}")
        edges.append(k)
    usable = sorted({k for k in edges if 2 * k < steps})
    if not usable:
        raise ValueError(
            f"step_edges {list(step_edges)}: with {steps} steps the first and last k steps leave "
            f"no FP8 step for any k given (k must be < {steps / 2:g})"
        )
    return usable


def edge_steps(k: int, steps: int) -> list[int]:
    """The first and last k of `steps` denoising steps."""
    return sorted(set(range(k)) | set(range(steps - k, steps)))


def step_policy_candidates(
    base: FP8Config, steps: int, step_edges, attention_per_step: float, linear_per_step: float
) -> list[StepPolicy]:
    """Policies over the first/last k steps for the features `base` has on: attention native,
    linears weight-only, linears native, and attention native with either linear mode.
    *_per_step: FP8 FLOPs per step of the FP8 attention / W8A8 linears (from the report)."""
    full = (attention_per_step + linear_per_step) * steps
    out = []
    for k in check_step_edges(step_edges, steps):
        sel = edge_steps(k, steps)
        text = ",".join(map(str, sel)) if len(sel) <= 2 else f"0-{k - 1},{steps - k}-{steps - 1}"
        shapes = []
        if base.attention_enabled and attention_per_step > 0:
            shapes.append((f"attention native on steps {text}", sel, [], ""))
        if base.linear_enabled and linear_per_step > 0:
            for mode in ("weight_only", "native"):
                shapes.append((f"linears {mode.replace('_', '-')} on steps {text}", [], sel, mode))
                if base.attention_enabled and attention_per_step > 0:
                    shapes.append(
                        (f"attention native + linears {mode.replace('_', '-')} on steps {text}", sel, sel, mode)
                    )
        for label, att, lin, mode in shapes:
            kept = attention_per_step * (steps - len(att)) + linear_per_step * (steps - len(lin))
            out.append(StepPolicy(label, att, lin, mode, kept / full if full else 0.0))
    return out


def choose_step_policy(candidates: list[StepPolicy], target: float) -> Optional[StepPolicy]:
    """The measured policy that keeps the most FP8 FLOPs while meeting `target` (ties: the higher
    PSNR); None when none meets it."""
    meeting = [c for c in candidates if c.psnr >= target]
    return max(meeting, key=lambda c: (c.fp8_work_fraction, c.psnr)) if meeting else None


def measure_step_policies(reports, base, steps, target, step_edges, all_fp8, measure, note):
    """Measure every candidate policy (unless all FP8 already meets `target`) and choose one:
    (the chosen policy or None, every candidate). measure(config, label, extra=) runs one config."""
    attention = sum(e.flops or 0.0 for r in reports for e in r.entries if e.op == "attention" and e.action == "fp8")
    linear = sum(e.flops or 0.0 for r in reports for e in r.entries if e.op == "linear" and e.action in ("fp8", "int8"))
    candidates = step_policy_candidates(base, steps, step_edges, attention, linear)
    if all_fp8.psnr >= target:
        note.say("step policy: all FP8 already meets the target, no step policy needed")
        return None, candidates
    for c in candidates:
        m = measure(
            base.replace(**c.overrides()),
            f"step policy: {c.label}",
            extra=f"  (keeps {100 * c.fp8_work_fraction:.0f}% of FP8 FLOPs)",
        )
        c.mse, c.psnr, c.seconds = m.mse, m.psnr, m.seconds
    chosen = choose_step_policy(candidates, target)
    if chosen is None:
        best = max(candidates, key=lambda c: c.psnr)
        note.say(
            f"step policy: none meets the {target:g} dB target alone (best: {best.label}, {best.psnr:.2f} dB); "
            f"the layer search starts from all FP8 without one"
        )
    else:
        note.say(
            f"step policy chosen: {chosen.label}, PSNR {chosen.psnr:.2f} dB, keeps "
            f"{100 * chosen.fp8_work_fraction:.0f}% of FP8 FLOPs (meets the target)"
        )
    return chosen, candidates
