"""prepare_model: a model's eligible linears become QuantizedLinear modules, before compiling.

The same rules as the linear pass decide (fx_fp8.rules), including the sensitive
layers found by the graph's structure (passes/sensitive.py) when example inputs
are given: the model is traced once on them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fx_fp8.calibration import check_scales_match, load_activation_scales
from fx_fp8.config import FP8Config
from fx_fp8.ops import quant
from fx_fp8.passes.sensitive import sensitive_linear_names
from fx_fp8.rules import linear_native_reason
from fx_fp8.weights import QuantizedLinear


def prepare_model(model: nn.Module, config=None, *, example_inputs=None, sensitive: Optional[dict] = None,
                  **overrides) -> dict:
    """Quantize eligible nn.Linear weights of `model` in place, freeing the originals.

    Uses the same rules as the linear pass (fx_fp8.rules: ignored_layers,
    sensitive layers, sizes). The sensitive layers are found by structure, as
    the backend finds them, when `example_inputs` is given (a tuple of
    arguments, a dict of keyword arguments, or (args, kwargs)): the model is
    traced once on them. Without it only the name patterns are known (the
    backend then warns about prepared layers it finds sensitive). `sensitive`
    ({module name: reason}) passes such a result directly.
    Everything is checked and every weight quantized before the model is
    touched: an error leaves the model exactly as it was.
    Returns {"quantized": [names], "native": {name: reason}, "bytes_before", "bytes_after", "method"}.
    Call it once before torch.compile(model, backend="fp8"/"fp8_npu").
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"prepare_model expects a torch.nn.Module, got {type(model).__name__}")
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: prepare what it wraps
    cfg = FP8Config.load(config, **overrides)
    qcfg = cfg.quantization_config
    result = {"quantized": [], "native": {}, "bytes_before": 0, "bytes_after": 0, "method": qcfg.method}
    if not cfg.linear_enabled:
        return result
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    if example_inputs is not None and sensitive is None:
        args, kwargs = _split_inputs(example_inputs)
        sensitive = sensitive_linear_names(model, args, kwargs)
    sensitive = sensitive or {}
    scales = None
    if qcfg.activation_scheme == "static":
        scales = load_activation_scales(qcfg.activation_scales)
        check_scales_match(scales, [n for n, _ in linears])
    plan = []
    for name, module in linears:
        reason = linear_native_reason(name, module.in_features, module.out_features, module.weight.dtype, qcfg,
                                      sensitive.get(name))
        if reason is None and scales is not None and name not in scales:
            reason = "no static activation scale for this layer (recalibrate)"
        if reason is not None:
            result["native"][name] = reason
            continue
        with torch.no_grad():
            wq, ws = quant.quantize_weight(module.weight.detach(), qcfg.weight_granularity, qcfg.weight_block_size,
                                           qcfg.method)
        input_scale = (torch.tensor(scales[name], dtype=torch.float32, device=module.weight.device)
                       if scales is not None else None)
        plan.append((name, module, QuantizedLinear(
            wq, ws, module.bias, method=qcfg.method, weight_granularity=qcfg.weight_granularity,
            weight_block=qcfg.weight_block_size,
            act_granularity=qcfg.act_granularity if qcfg.act_granularity != "static" else qcfg.activation_granularity,
            input_scale=input_scale, orig_dtype=module.weight.dtype)))
    # every check passed and every weight is quantized: only now change the model
    for name, module, new in plan:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        result["bytes_before"] += module.weight.numel() * module.weight.element_size()
        result["bytes_after"] += new.weight.numel() * new.weight.element_size() + new.weight_scale.numel() * 4
        result["quantized"].append(name)
    return result


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tuple of arguments, a dict of keyword arguments, or (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if (isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[0], (tuple, list))
            and isinstance(example_inputs[1], dict)):
        return tuple(example_inputs[0]), example_inputs[1]
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise ValueError(f"invalid example_inputs of type {type(example_inputs).__name__}: expected a tuple of "
                     "arguments, a dict of keyword arguments, or (args, kwargs)")
