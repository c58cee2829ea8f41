"""The lowering registry: which implementation runs behind the custom ops.

The passes pick a lowering name at compile time and bake it into each custom
op call, so the NPU lowering can also run on CPU tensors under the contract
simulator in the tests. Device modules are imported only when asked for.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

_MODULES = {
    "reference": "fx_fp8.ops.reference",
    "cuda": "fx_fp8.ops.cuda",
    "npu": "fx_fp8.ops.npu",
}
_CACHE: dict[str, "Lowering"] = {}


class Lowering:
    """Interface of a lowering module's `LOWERING` object.

    attention_reason / linear_reason return None when the node can run in FP8
    on this lowering, else the reason it stays native (goes into the report).
    """

    name = "base"
    description = ""

    def attention_reason(self, q, k, v, cfg, attn_mask=None) -> Optional[str]:  # FakeTensor metadata
        return None

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        return None

    def weight_only(self, weight) -> Optional[str]:
        """A message when linears must use weight-only FP8 on this device, else None."""
        return None

    def attention(self, q, k, v, *, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, quantize_p, p_scale):
        raise NotImplementedError

    def linear(self, x, weight, weight_scale, bias, input_scale, *, weight_granularity, weight_block, act_granularity, weight_only):
        raise NotImplementedError


def get_lowering(name: str) -> Lowering:
    if name not in _MODULES:
        raise ValueError(f"unknown lowering {name!r}: expected one of {sorted(_MODULES)}")
    if name not in _CACHE:
        _CACHE[name] = importlib.import_module(_MODULES[name]).LOWERING
    return _CACHE[name]


def npu_available() -> bool:
    """True when torch_npu is importable and a device is present. Never imports it eagerly at module load."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False
    try:
        return bool(npu.is_available())
    except Exception:  # a half-installed torch_npu must not break the CPU path
        return False


def resolve_lowering_name(requested: str, device: torch.device | None) -> str:
    """'auto' -> by device type of the graph's tensors; otherwise as requested."""
    if requested != "auto":
        return requested
    dev = device.type if device is not None else "cpu"
    if dev == "cuda":
        return "cuda"
    if dev in ("npu", "privateuseone"):
        return "npu"
    return "reference"
