"""The diffusers attention backend context parallelism runs with, chosen so FP8 can rewrite it.

Ulysses uses diffusers' `native` backend (plain SDPA between two all-to-alls: the FP8 pass rewrites
it). Ring attention needs each partial attention's log-sum-exp: fx_fp8 selects diffusers'
`_native_flash` backend (aten._scaled_dot_product_flash_attention, which the FP8 pass rewrites into
fx_fp8::fp8_attention_lse), so each ring step is FP8 and the steps merge exactly as diffusers
merges native ones.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:  # an annotation only: options imports cache_dit, which asks this module for the backend
    from fx_fp8.pipeline.options import ParallelOptions


#: diffusers attention backends whose attention the FP8 pass can rewrite (aten SDPA forms)
FP8_ATTENTION_BACKENDS = ("native", "_native_flash", "_native_cudnn", "_native_efficient", "_native_math")


def _processors(model: nn.Module) -> list:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    out = []
    for m in model.modules():
        if isinstance(m, (Attention, MochiAttention, AttentionModuleMixin)):
            p = getattr(m, "processor", None)
            if p is not None and hasattr(p, "_attention_backend"):
                out.append(p)
    return out


def current_attention_backend(model: nn.Module) -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    names = {p._attention_backend for p in _processors(model)}
    names.discard(None)
    if len(names) > 1:
        raise ValueError(f"{type(model).__name__} mixes attention backends {sorted(map(str, names))}")
    name = names.pop() if names else _AttentionBackendRegistry.get_active_backend()[0]
    return getattr(name, "value", str(name))


def _has_kernel(op: str, device_type: str) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA", "npu": "PrivateUse1", "xpu": "XPU"}.get(device_type, "PrivateUse1")
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def choose_attention_backend(model: nn.Module, opts: ParallelOptions, warn=None) -> str:
    """The diffusers attention backend context parallelism runs with, set on the model's processors.

    Ulysses keeps the model's backend (`native` by default). Ring needs each partial attention's
    log-sum-exp: `native` cannot give it, so `native` becomes `_native_flash`
    (aten._scaled_dot_product_flash_attention, which the FP8 pass rewrites into fp8_attention_lse)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    warn = warn or (lambda m: warnings.warn(m, stacklevel=3))
    name = current_attention_backend(model)
    if opts.ring_degree > 1 and name in ("native", "_native_math", "_native_efficient"):
        device_type = torch._C._get_accelerator().type
        if not _has_kernel("aten::_scaled_dot_product_flash_attention", device_type):
            raise RuntimeError(
                f"ring attention (ring_degree {opts.ring_degree}) needs each partial attention's log-sum-exp; fx_fp8 "
                "uses diffusers' _native_flash backend (aten._scaled_dot_product_flash_attention) for it, which has no "
                f"{device_type} kernel in this torch build: use ulysses_degree instead"
            )
        name = "_native_flash"
        for p in _processors(model):
            p._attention_backend = AttentionBackendName(name)
    if not _AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(name)):
        raise ValueError(
            f"attention backend {name!r} does not support diffusers' context parallelism; use one of "
            f"{sorted(_AttentionBackendRegistry._supports_context_parallel)}"
        )
    if name not in FP8_ATTENTION_BACKENDS:
        warn(
            f"fx_fp8: attention backend {name!r} computes attention outside aten's SDPA ops, so fx_fp8 cannot make "
            "it FP8 (the report shows no attention rows); use 'native' (Ulysses) or '_native_flash' (ring)"
        )
    return name
