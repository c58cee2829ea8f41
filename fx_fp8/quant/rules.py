"""What can run in FP8, and why not: the eligibility rules that depend on no device.

The linears' decision is fx_fp8/quant/linear_plan.py (plan_linear, from the sensitive layers
named here); the attention rules are used by the attention pass (at compile time, on
FakeTensor metadata) and by the tiny model's fake quantization, so the two never disagree. Device-specific limits live in each lowering's
`attention_reason` / `linear_reason`; everything that does not depend on a
device is here. Every check reads shapes through fx_fp8.graph.shapes, so none of
them specialises a symbolic size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils.parametrize import is_parametrized

from fx_fp8.config.patterns import first_match
from fx_fp8.graph.shapes import broadcasts_to, concrete, known_equal, known_true, size_str
from fx_fp8.ops.formats import FLOAT_DTYPES

#: Name patterns of linears known to be sensitive in the supported families
#: (timestep / text / image input embedders, adaLN modulation, the final
#: projection). How they run is quantization_config.sensitive (native, weight_only
#: or fp8; quantize_sensitive: true means fp8); `re:` keeps them anchored (the final `proj_out`, not
#: `single_transformer_blocks.3.proj_out`). Pattern syntax: fx_fp8/config/patterns.py.
#: They are the fallback: the graph's structure (fx_fp8/graph/sensitive.py) finds the
#: timestep conditioning, adaLN modulation and final projection of any model, and
#: its reason is the one reported where both apply. prepare_model, which sees no
#: graph, uses these names only.
SENSITIVE_LAYER_PATTERNS: tuple[str, ...] = (
    # timestep / text / image input embedders
    "time_text_embed",
    "timestep_embedder",
    "text_embedder",
    "context_embedder",
    "x_embedder",
    "condition_embedder",
    "img_in",
    "txt_in",
    "t_embedder",
    "cap_embedder",
    "all_x_embedder",
    "time_embedding",
    "time_proj",
    # the original Wan layout (diffusers' WanAnimate2Transformer3DModel): embedders run in frames Dynamo
    # leaves eager, so the pieces the structural analysis sees hold no model output
    "time_projection",
    "text_embedding",
    "img_emb",
    # adaLN modulation
    "re:(.*\\.)?norm[^.]*\\.linear",
    "img_mod",
    "txt_mod",
    "adaLN_modulation",
    # final projection / final layer
    "re:proj_out",
    "re:norm_out(\\..*)?",
    "all_final_layer",
    "re:head\\.head",
    # text encoders' final projection (transformers' CLIPTextModelWithProjection)
    "re:text_projection",
)

#: Name patterns of a `transformers` text encoder's sensitive parts: a causal LM's output head
#: (`lm_head`, its final projection: a pipeline reads the hidden states before it) and Qwen2.5-VL's
#: vision tower (`visual.*`, transformers 5's `model.visual.*`: it runs on images only, an edit
#: pipeline's reference image, with its own patch embedder and merger projection). As the DiT rules
#: treat embedders and final projections, quantization_config.sensitive decides them: weight-only
#: by default, native under "native", W8A8 under "fp8". Applied to transformers models only
#: (fx_fp8/quant/keep_fp32.py): a diffusers transformer's own `lm_head` (Cosmos3's) is the DiT
#: rules' to decide.
TEXT_ENCODER_SENSITIVE_PATTERNS: tuple[str, ...] = ("re:lm_head", "re:(model\\.)?visual\\..*")


def text_encoder_sensitive_reason(name: str, model_cls: str) -> Optional[str]:
    """Why the linear `name` of the transformers model `model_cls` is a sensitive part, or None."""
    hit = first_match(TEXT_ENCODER_SENSITIVE_PATTERNS, name)
    if hit is None:
        return None
    what = (
        "output head lm_head (the final projection; a prompt embedding is the hidden states before it)"
        if hit == TEXT_ENCODER_SENSITIVE_PATTERNS[0]
        else "vision tower visual.* (it runs on image inputs only)"
    )
    return f"{model_cls}'s {what}: a text encoder's sensitive layer"


# -- linears -------------------------------------------------------------------------
def is_plain_linear(module) -> bool:
    """Is `module` a linear fx_fp8 may calibrate and replace by a QuantizedLinear?

    The one rule of calibrate, prepare_model and the backend's static-scale names: an
    nn.Linear, or a subclass that keeps nn.Linear.forward (a subclass with its own forward,
    like diffusers' LoRACompatibleLinear or its GGUF/BFL quantized linears, computes something
    else). Excluded: NonDynamicallyQuantizableLinear (nn.MultiheadAttention reads its weight
    directly, never calls it) and parametrized linears (their weight is computed).
    PEFT's lora.Linear wraps an nn.Linear without being one: its base_layer is the linear.
    """
    if not isinstance(module, nn.Linear) or isinstance(module, NonDynamicallyQuantizableLinear):
        return False
    return type(module).forward is nn.Linear.forward and not is_parametrized(module)


def check_not_prepared(model, action: str, hint: str) -> None:
    """A model whose linears are QuantizedLinear modules no longer holds the weights `action`
    needs (the originals were freed): a ValueError saying so, naming the first ones and `hint`."""
    from fx_fp8.quant.quantized_linear import QuantizedLinear  # weights imports the ops; rules stays light

    names = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if names:
        raise ValueError(
            f"this model was already prepared by fx_fp8.prepare_model: {len(names)} linears are "
            f"QuantizedLinear modules (first: {names[:3]}), so {action}; {hint}"
        )


def sensitive_reason(name: str, sensitive: Optional[str] = None) -> Optional[str]:
    """Why `name` is a sensitive linear: the structural reason found in the graph (`sensitive`),
    else a name pattern of fx_fp8.quant.rules.SENSITIVE_LAYER_PATTERNS; None when it is not one."""
    if sensitive is not None:
        return sensitive
    hit = first_match(SENSITIVE_LAYER_PATTERNS, name)
    return f"known sensitive layer (pattern {hit!r})" if hit is not None else None


# -- attention -----------------------------------------------------------------------
def attention_call_reason(q, k, v, mask, *, dropout_p: float, is_causal: bool, enable_gqa: bool) -> Optional[str]:
    """Why an attention call cannot be FP8 whatever the device, or None.

    q/k/v/mask are FakeTensors (B, H, S, D); dropout_p / is_causal are their
    Python values (see shapes.scalar_value).
    """
    if q is None or k is None or v is None:
        return "query/key/value shapes unknown at compile time"
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (FP8 attention is inference-only)"
    if is_causal:
        return "is_causal=True not supported by the FP8 kernels"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"expected 4-D (B, H, S, D) inputs, got ranks {q.dim()}/{k.dim()}/{v.dim()}"
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype} not supported (need one of fp32/bf16/fp16)"
    if not known_equal(q.shape[1], k.shape[1]) or not known_equal(k.shape[1], v.shape[1]):
        kind = "grouped-query attention" if enable_gqa else "different head counts"
        return f"{kind} ({size_str(q.shape[1])} query heads, {size_str(k.shape[1])} kv heads) not supported"
    if not known_equal(q.shape[-1], k.shape[-1]) or not known_equal(k.shape[2], v.shape[2]):
        return "query/key head dims or key/value lengths differ"
    if concrete(q.shape[-1]) is None or concrete(v.shape[-1]) is None:
        return f"symbolic head dim {size_str(q.shape[-1])} (FP8 kernels are chosen per head dim)"
    if mask is not None:
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if mask.dim() > 4 or not broadcasts_to(mask.shape, target):
            return (
                f"attention mask of shape ({', '.join(map(size_str, mask.shape))}) not broadcastable to (B, H, Sq, Sk)"
            )
        if mask.dtype != torch.bool and mask.dtype not in FLOAT_DTYPES:
            return f"attention mask dtype {mask.dtype} not supported"
    return None


def short_keys_reason(q, k, cfg) -> Optional[str]:
    """Cost rule: attention whose keys are few compared with its queries (cross-attention to
    a short prompt) stays native, unless attention.cross_attention is true. Joint attention
    (keys = the image tokens plus a few more) is quantized. Decided from what holds for
    every value of symbolic lengths; when that cannot be known, native (with this reason)."""
    if cfg.cross_attention:
        return None
    s_q, s_k = q.shape[2], k.shape[2]
    if known_equal(s_q, s_k):
        return None
    # s_k >= ratio * s_q, in integers (ratio as a fraction of 1000) so sympy can decide it symbolically
    num = round(cfg.min_kv_ratio * 1000)
    if known_true(s_k * 1000 >= s_q * num):
        return None
    return (
        f"cross-attention (key length {size_str(s_k)} < {cfg.min_kv_ratio:g} x query length {size_str(s_q)}); "
        "set attention.cross_attention: true to quantize it"
    )
