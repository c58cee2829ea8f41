"""A prepared model's state made impossible to misuse (`guard`, called by prepare_model):
`save_pretrained` raises and names fx_fp8.save_quantized (FP8/INT8 codes under plain weight
keys would load as garbage), and `load_state_dict` checks every quantized layer's incoming
entries before anything is copied. The guard also records the linears prepare_model kept
native, with the reason, for save_quantized."""

from __future__ import annotations

import os
from typing import Optional

import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.quant.quantized_linear import QuantizedLinear

#: attribute of a prepared model: {"native": {linear name: reason}} from prepare_model
_PREPARED_ATTR = "_fx_fp8_prepared"
_HOOK_ATTR = "_fx_fp8_load_check"


def quantized_layers(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, QuantizedLinear)]


class _RefuseSavePretrained:
    """Shadows ModelMixin.save_pretrained on a prepared model instance: its FP8/INT8 codes under
    plain `weight` keys would load as garbage. Checked at call time, so a model whose original
    linears were put back (restore_pipeline with keep_weights=True) saves normally again."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, save_directory, *args, **kwargs):
        names = quantized_layers(self.module)
        if not names:
            return type(self.module).save_pretrained(self.module, save_directory, *args, **kwargs)
        raise ValueError(
            f"{type(self.module).__name__} holds {len(names)} quantized linear(s) (first: {names[0]!r}): "
            "save_pretrained would write FP8/INT8 codes under plain weight keys that from_pretrained loads as "
            f"garbage; use fx_fp8.save_quantized(model_or_pipe, {os.fspath(save_directory)!r}) and "
            "fx_fp8.load_quantized to load it"
        )


def _check_quantized_state(module, state_dict, prefix, *_):
    """load_state_dict pre-hook of a prepared model: every quantized layer's incoming entries are
    checked before any tensor is copied (an error leaves the model as it was)."""
    problems = []
    for name, layer in module.named_modules():
        if isinstance(layer, QuantizedLinear):
            problem = layer._check_incoming(state_dict, f"{prefix}{name}." if name else prefix)
            if problem:
                problems.append(problem)
    if problems:
        raise ValueError("fx_fp8: cannot load this state dict into a prepared model:\n  " + "\n  ".join(problems))


def guard(module: nn.Module, native: Optional[dict] = None, *, refuse_save_pretrained: bool = True) -> None:
    """Make a prepared model's state impossible to misuse (idempotent; prepare_model calls it):
    save_pretrained refuses (diffusers models) and load_state_dict checks quantized layers first.
    `native`: {linear name: reason} kept native, recorded for save_quantized.
    refuse_save_pretrained=False: a model loaded through fx_fp8's diffusers quantizer, whose
    save_pretrained records its quantized layers in config.json (fx_fp8/pipeline/diffusers_quantizer.py)."""
    module = unwrap_compiled(module)
    record = module.__dict__.setdefault(_PREPARED_ATTR, {"native": {}})
    record["native"].update(native or {})
    if (
        refuse_save_pretrained
        and callable(getattr(type(module), "save_pretrained", None))
        and not isinstance(module.__dict__.get("save_pretrained"), _RefuseSavePretrained)
    ):
        module.__dict__["save_pretrained"] = _RefuseSavePretrained(module)
    if _HOOK_ATTR not in module.__dict__:
        module.__dict__[_HOOK_ATTR] = module.register_load_state_dict_pre_hook(_check_quantized_state)


def guarded(module: nn.Module) -> bool:
    return _PREPARED_ATTR in unwrap_compiled(module).__dict__


def unguard(module: nn.Module) -> None:
    """Undo guard (the model keeps its quantized layers)."""
    module = unwrap_compiled(module)
    if isinstance(module.__dict__.get("save_pretrained"), _RefuseSavePretrained):
        del module.__dict__["save_pretrained"]
    handle = module.__dict__.pop(_HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
    module.__dict__.pop(_PREPARED_ATTR, None)


def native_reasons(module: nn.Module) -> dict:
    """{linear name: reason} of the linears prepare_model kept native ({} when not guarded)."""
    return module.__dict__.get(_PREPARED_ATTR, {}).get("native", {})
