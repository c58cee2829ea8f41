"""Linears a `transformers` model asks to keep in float32 (`_keep_in_fp32_modules`): kept native.

transformers lists modules whose precision the model's own code relies on: T5's feed-forward
output `wo` casts its input to `wo.weight.dtype` before the matmul (an FP8 weight would make
it cast the activations to FP8, and the matmul fail). prepare_model leaves them nn.Linear, with
a reason that names the attribute. Names are matched as transformers matches them: whole dotted
components of the module path (fx_fp8.config.patterns' plain names).
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from fx_fp8.config.patterns import first_match

#: the transformers attributes read (the strict one upcasts bf16 too; both mean "keep this precision")
KEEP_ATTRS = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")


def keep_in_fp32_names(model: nn.Module) -> tuple[str, ...]:
    """The module names the model (a transformers PreTrainedModel, or anything with the attributes) keeps in float32."""
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
    return (f"{model_cls}._keep_in_fp32_modules names {hit!r}: the model's code relies on this layer's weight dtype "
            "(transformers keeps it in float32), kept native")
