"""What a user can set to change a native attention decision, appended to its reason in the report
(a surprising default says, where it happens, what changes it). A reason either names the
key to set or says that no setting changes it: a limit of the call or of the kernels, not a choice."""

from __future__ import annotations

import re

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: a reason that already names what to set (a lowering's own hint, the cross-attention rule's)
_NAMES_A_SETTING = re.compile(r"\bset \w|\battention\.\w+: \w|\brun the model\b")

NOTHING_TO_SET = "nothing to set: the FP8 kernels cannot take this call, it stays native"

#: set (True) on a module compile_pipeline compiles for its linears only (a text encoder of a
#: component map): its attention stays native by design, and no setting changes that
LINEARS_ONLY_ATTR = "_fx_fp8_linears_only"
LINEARS_ONLY_ATTENTION = (
    "attention native (text encoders: linears only): compile_pipeline quantizes a text "
    "encoder's linears, never its attention; nothing to set"
)


def attention_off(kv_cache_dtype, model=None) -> str:
    """Attention native because the config does not ask for FP8 attention. A config that names only
    linear keys (quantization, quantization_config, ignored_layers) leaves diffusion_kv_cache_dtype
    unset, so the user may never have written the key the report names. `model` (the compiled
    model, when known) marked LINEARS_ONLY_ATTR: no key to name."""
    if model is not None and getattr(model, LINEARS_ONLY_ATTR, False):
        return LINEARS_ONLY_ATTENTION
    if kv_cache_dtype == "auto":
        return (
            "attention not requested (diffusion_kv_cache_dtype: auto means the model's own attention): "
            "set diffusion_kv_cache_dtype: fp8 (--diffusion-kv-cache-dtype fp8)"
        )
    return (
        "attention not requested: set diffusion_kv_cache_dtype: fp8 (--diffusion-kv-cache-dtype fp8); a config "
        "naming only linear keys (quantization, quantization_config, ignored_layers) leaves attention native"
    )


def call_remedy(q, k, v, *, dropout_p: float, is_causal: bool) -> str:
    """What changes an attention call the FP8 kernels refuse whatever the device: the first check of
    attention_call_reason that fails, in its order (dropout, causal, rank, dtype, heads, mask)."""
    if dropout_p:
        return "run the model in eval mode (model.eval(): no attention dropout)"
    if is_causal or any(t is None or t.dim() != 4 for t in (q, k, v)):
        return NOTHING_TO_SET
    if any(t.dtype not in FLOAT_DTYPES for t in (q, k, v)):
        return "load the model in bfloat16, float16 or float32"
    return NOTHING_TO_SET


def with_remedy(reason: str, remedy: str) -> str:
    """`reason; remedy`, unless the reason already names what to set."""
    return reason if _NAMES_A_SETTING.search(reason) else f"{reason}; {remedy}"


def lowering_remedy(lowering_name: str) -> str:
    return (
        f"nothing to set on the {lowering_name} lowering: its FP8 kernels cannot take this call (attention.kernel "
        "and attention.granularity choose among them: docs/configuration.md)"
    )
