"""Linears a `transformers` model asks to keep in float32 (`_keep_in_fp32_modules`): kept native.

transformers lists modules whose precision the model's own code relies on: T5's feed-forward
output `wo` casts its input to `wo.weight.dtype` before the matmul (an FP8 weight would make
it cast the activations to FP8, and the matmul fail). prepare_model leaves them nn.Linear and the
backend runs them native (a compile-time FP8 copy would disagree with the prepared model), with
a reason that names the attribute. Names are matched as transformers matches them: whole dotted
components of the module path (fx_fp8.config.patterns' plain names).

A transformers text encoder's sensitive parts (its lm_head and vision tower:
fx_fp8.quant.rules.TEXT_ENCODER_SENSITIVE_PATTERNS) are named here too (`model_sensitive_reason`),
for the same reason: only a transformers model has them. Their reason is passed as a sensitive
layer's, so quantization_config.sensitive decides them (weight-only by default).
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from fx_fp8.config.patterns import first_match
from fx_fp8.quant.rules import text_encoder_sensitive_reason

#: the transformers attributes read (the strict one upcasts bf16 too; both mean "keep this precision")
KEEP_ATTRS = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")


def is_transformers_model(model) -> bool:
    """A transformers PreTrainedModel (found on the class's MRO: transformers itself is not imported)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__
    )


def keep_in_fp32_names(model: nn.Module) -> tuple[str, ...]:
    """The module names a transformers model keeps in float32. Only transformers models: diffusers' attribute of the same name
    only says which weights to load in float32 under float16 (Wan's time_embedder), and the DiT
    rules already decide those layers (sensitive: weight-only)."""
    if not is_transformers_model(model):
        return ()
    names: list[str] = []
    for attr in KEEP_ATTRS:
        value = getattr(model, attr, None) or ()
        names += [n for n in (sorted(value) if isinstance(value, set) else value) if isinstance(n, str) and n]
    return tuple(dict.fromkeys(names))


def keep_in_fp32_reason(keep: tuple[str, ...], name: str, model_cls: str) -> Optional[str]:
    """Why the linear `name` stays native under the model's keep-in-float32 list `keep`, or None."""
    hit = first_match(keep, name) if keep else None
    if hit is None:
        return None
    return (
        f"{model_cls}._keep_in_fp32_modules names {hit!r}: the model's code relies on this layer's weight dtype "
        "(transformers keeps it in float32), kept native (no setting changes it)"
    )


def model_keep_reason(model, name: str) -> Optional[str]:
    """keep_in_fp32_reason for the linear `name` of `model` (None when there is no model)."""
    if model is None:
        return None
    return keep_in_fp32_reason(keep_in_fp32_names(model), name, type(model).__name__)


def model_sensitive_reason(model, name: str) -> Optional[str]:
    """Why the linear `name` of `model` is a transformers text encoder's sensitive part (its lm_head,
    its vision tower), or None (no model, not a transformers model, another layer)."""
    if model is None or not is_transformers_model(model):
        return None
    return text_encoder_sensitive_reason(name, type(model).__name__)
