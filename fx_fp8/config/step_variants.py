"""The step variants' vocabulary: the closed set of names a step can map to (which of attention
and the linears its step selectors skip, and how the linears run then). The config lists the
variants a run can produce (FP8Config.step_variants), fx_fp8.steps picks the published step's, the
passes read what a variant skips."""

from __future__ import annotations

from typing import Optional

#: the variant of unskipped steps; "native" is the one whose attention is native (its historical name)
ALL_QUANTIZED = "fp8"
ATTENTION_NATIVE = "native"
LINEAR_PREFIX = "linear_"


def variant_name(attention_skipped: bool, linears_skipped: bool, mode: str = "weight_only") -> str:
    """The closed set of step variants: "fp8" (nothing skipped), "native" (attention native),
    "linear_<mode>" (linears run `mode`: weight_only or native), "native+linear_<mode>"."""
    parts = [ATTENTION_NATIVE] if attention_skipped else []
    if linears_skipped:
        parts.append(LINEAR_PREFIX + mode)
    return "+".join(parts) or ALL_QUANTIZED


def attention_skipped(variant: Optional[str]) -> bool:
    return variant is not None and variant.split("+")[0] == ATTENTION_NATIVE


def linear_skip_mode(variant: Optional[str]) -> Optional[str]:
    """ "weight_only" / "native" when the variant's linears are skipped, else None."""
    for part in (variant or "").split("+"):
        if part.startswith(LINEAR_PREFIX):
            return part[len(LINEAR_PREFIX) :]
    return None
