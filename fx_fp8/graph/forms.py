"""The call forms the passes recognise: linears (plain and prepared) and, one table, attention.

Linears: LINEAR_TARGETS (F.linear and its aten spellings), PREPARED_TARGETS (the
fx_fp8::quantized_linear call a prepared QuantizedLinear makes, PREPARED_PARAMS its arguments).

Attention:

  sdpa            F.scaled_dot_product_attention / aten.scaled_dot_product_attention
  flash           aten._scaled_dot_product_flash_attention          -> (out, lse [B,H,Sq], ...)
  flash_cpu       aten._scaled_dot_product_flash_attention_for_cpu  -> (out, lse [B,H,Sq])
  efficient       aten._scaled_dot_product_efficient_attention      -> (out, lse [B,H,pad32(Sq)], seed, offset)
  cudnn           aten._scaled_dot_product_cudnn_attention          -> (out, lse [B,H,Sq,1], ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

aten = torch.ops.aten

LINEAR_TARGETS = {F.linear, torch._C._nn.linear, aten.linear.default}
PREPARED_PARAMS = ["x", "weight", "weight_scale", "bias", "input_scale", "input_smoothing"]


class _OpsNamed:
    """Node targets that are the custom op `name` (its packet or any overload), matched by name:
    reading a graph needs no import of the layer that registers the op (fx_fp8.ops.library)."""

    def __init__(self, name: str):
        self.name = name

    def __contains__(self, target) -> bool:
        packet = getattr(target, "_overloadpacket", target)
        return getattr(packet, "_qualified_op_name", None) == self.name


#: the call a prepared QuantizedLinear's forward makes
PREPARED_TARGETS = _OpsNamed("fx_fp8::quantized_linear")


@dataclass(frozen=True)
class AttentionForm:
    name: str
    params: tuple[str, ...]  # positional parameter names of the call
    defaults: dict
    mask_param: Optional[str]  # the argument holding the mask / bias
    lse_layout: Optional[str]  # how index 1 (lse) is laid out: "bhs", "bhs1", or None (not producible)
    returns_tuple: bool


def _overloads(packet) -> set:
    return {packet, packet.default}


SDPA = AttentionForm(
    "sdpa",
    ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
    "attn_mask",
    None,
    False,
)
FLASH = AttentionForm(
    "flash",
    ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"),
    {"dropout_p": 0.0, "is_causal": False, "return_debug_mask": False, "scale": None},
    None,
    "bhs",
    True,
)
FLASH_CPU = AttentionForm(
    "flash_cpu",
    ("query", "key", "value", "dropout_p", "is_causal"),
    {"dropout_p": 0.0, "is_causal": False, "attn_mask": None, "scale": None},
    "attn_mask",
    "bhs",
    True,
)
EFFICIENT = AttentionForm(
    "efficient",
    ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"),
    {"attn_bias": None, "compute_log_sumexp": False, "dropout_p": 0.0, "is_causal": False, "scale": None},
    "attn_bias",
    None,
    True,
)
CUDNN = AttentionForm(
    "cudnn",
    ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask"),
    {
        "attn_bias": None,
        "compute_log_sumexp": False,
        "dropout_p": 0.0,
        "is_causal": False,
        "return_debug_mask": False,
        "scale": None,
    },
    "attn_bias",
    "bhs1",
    True,
)

FORMS: dict = {}
for _t in (
    F.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
    *_overloads(aten.scaled_dot_product_attention),
):
    FORMS[_t] = SDPA
for _packet, _form in (
    (aten._scaled_dot_product_flash_attention, FLASH),
    (aten._scaled_dot_product_flash_attention_for_cpu, FLASH_CPU),
    (aten._scaled_dot_product_efficient_attention, EFFICIENT),
    (aten._scaled_dot_product_cudnn_attention, CUDNN),
):
    for _t in _overloads(_packet):
        FORMS[_t] = _form


def attention_form(node: torch.fx.Node) -> Optional[AttentionForm]:
    return FORMS.get(node.target) if node.op == "call_function" else None


def is_attention(node: torch.fx.Node) -> bool:
    return attention_form(node) is not None
