"""Pre-quantized FP8 checkpoints: their layouts, where a weight came from, and adopt_prequantized.

Two on-disk layouts of FP8 linears are recognised (docs/prequantized.md):
* Black Forest Labs' `fp8r` (diffusers' BFLQuantizationConfig, loaded by from_single_file into
  BFLFP8RLinear modules): weight float8_e4m3fn [N, K], weight_scale fp32 [N] (one per output row).
* ModelOpt FP8 (NVIDIAModelOptConfig; the HF export vLLM / vLLM-Omni serve, quant_algo "FP8" or
  "FP8_PER_CHANNEL_PER_TOKEN"): weight float8_e4m3fn [N, K], weight_scale [] / [1] (per tensor)
  or [N] / [N, 1] (per channel), and an optional input_scale [] / [1]: the static activation
  scale (x is quantized as x / input_scale, clamped to +-448).
Both mean W = weight * weight_scale (row-broadcast), which is what an FP8 GEMM with a tensor or
channel weight scale computes with the stored bytes as they are.

The backend rewrites layers that dequantize such weights in their forward (fx_fp8/passes/prequantized.py);
`adopt_prequantized` swaps them for QuantizedLinear modules before compiling, for users of
prepare_model / compile_pipeline(prepare=False). Either way the report says where each weight
came from (`weight_origin`, node meta `WEIGHT_ORIGIN`).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.ops.formats import FLOAT_DTYPES, FP8_DTYPE

BFL_FP8R = "BFL fp8r checkpoint"
MODELOPT_FP8 = "ModelOpt FP8 checkpoint"
#: module classes whose forward dequantizes a pre-quantized weight, by class name (what Dynamo's
#: nn_module_stack shows): the source the report names
KNOWN_SOURCES = {"BFLFP8RLinear": BFL_FP8R}


def describe_origin(source: str, weight_granularity: str, static_input: bool) -> str:
    """'BFL fp8r checkpoint (per-channel weight scales)', 'ModelOpt FP8 checkpoint (per-tensor
    weight scales, static input scale)': the text a report row gives as the weight's source."""
    scales = {"tensor": "per-tensor", "channel": "per-channel"}[weight_granularity]
    return f"{source} ({scales} weight scales" + (", static input scale)" if static_input else ")")


def source_of_class(class_name: str) -> str:
    """The source of a pre-quantized weight dequantized by a module of class `class_name`."""
    return KNOWN_SOURCES.get(class_name) or f"pre-quantized FP8 weights of {class_name or 'an unnamed module'}"


def weight_origin(module) -> Optional[str]:
    """Where an adopted layer's weight bytes came from (None: not adopted)."""
    return getattr(module, "origin", None) if isinstance(module, nn.Module) else None


def scale_granularity(shape, out_features: int) -> Optional[str]:
    """ "tensor" for a scale of one element ([], [1], [1, 1]), "channel" for [N] / [N, 1], else None."""
    shape = tuple(int(s) for s in shape)
    if shape in ((), (1,), (1, 1)):
        return "tensor"
    if shape in ((out_features,), (out_features, 1)):
        return "channel"
    return None


def channel_scale(scale):
    """A stored per-row scale ([N] or [N, 1]) as the lowerings take it: fp32 [N, 1] (graph-traceable)."""
    return scale.float().reshape(-1, 1)


def tensor_scale(scale):
    """A stored one-element scale as the lowerings take it: fp32 [] (graph-traceable)."""
    return scale.float().reshape(())


def canonical_weight_scale(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """The stored scale as QuantizedLinear and the lowerings take it: fp32, [] (tensor) or [N, 1]
    (channel); a view of the stored tensor when it is already fp32."""
    return (tensor_scale if granularity == "tensor" else channel_scale)(scale.detach())


def bad_scale(name: str, weight_scale, input_scale=None) -> Optional[str]:
    """'name (weight_scale: 2 of 96 not finite, 1 not positive)' when a stored scale of a
    pre-quantized layer is NaN, infinite, zero or negative (a damaged checkpoint: the layer then
    computes NaN, zeros or sign-flipped outputs, as the checkpoint's own dequantizing forward
    would), else None. Tensors without values (meta, fake) are not read."""
    from ..graph.dynamo_internals import is_fake_tensor

    found = []
    for what, scale in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if not isinstance(scale, torch.Tensor) or scale.is_meta or is_fake_tensor(scale):
            continue
        s = scale.detach().float()
        finite = torch.isfinite(s)
        nonfinite, nonpositive = int((~finite).sum()), int((finite & (s <= 0)).sum())
        if nonfinite or nonpositive:
            found.append(
                f"{what}: "
                + ", ".join(
                    f"{n} of {s.numel()} {kind}"
                    for n, kind in ((nonfinite, "not finite"), (nonpositive, "not positive"))
                    if n
                )
            )
    return f"{name} ({'; '.join(found)})" if found else None


def warn_bad_scales(found: list, where: str) -> None:
    """One warning naming every layer bad_scale found (nothing when none)."""
    import warnings

    if found:
        listed = ", ".join(found[:10]) + (f" (+{len(found) - 10} more)" if len(found) > 10 else "")
        warnings.warn(
            f"fx_fp8: {where}: pre-quantized scales that are not finite and positive in {listed}: those "
            "layers compute NaN, zeros or sign-flipped outputs, as the checkpoint's own dequantizing "
            "forward does; the checkpoint is probably damaged",
            stacklevel=3,
        )


def _is_bfl_fp8r(module: nn.Module) -> bool:
    return type(module).__name__ == "BFLFP8RLinear" and type(module).__module__.startswith("diffusers.")


def _kept_reason(module: nn.Module) -> Optional[str]:
    """Why `module` cannot be swapped: hooks that live on the module object would be lost."""
    from fx_fp8.quant.prepare import hooks_lost_by_replacing

    hooks = hooks_lost_by_replacing(module)
    if hooks:
        return f"carries diffusers hooks {hooks}: not replaced (the hooks would be lost)"
    if hasattr(module, "_hf_hook"):
        return f"carries an accelerate hook ({type(module._hf_hook).__name__}): not replaced (it would be lost)"
    return None


def _bfl_plan(name: str, module: nn.Module, problems: list) -> Optional[tuple]:
    w, s = module.weight, getattr(module, "weight_scale", None)
    n, k = module.out_features, module.in_features
    if w.is_meta or (s is not None and s.is_meta):
        problems.append(f"{name}: BFLFP8RLinear whose weights were never loaded (meta tensors)")
    elif w.dtype != FP8_DTYPE or tuple(w.shape) != (n, k):
        problems.append(f"{name}: BFLFP8RLinear weight {w.dtype} {list(w.shape)}, expected {FP8_DTYPE} [{n}, {k}]")
    elif s is None or s.dtype != torch.float32 or tuple(s.shape) != (n,):
        problems.append(
            f"{name}: BFLFP8RLinear weight_scale "
            f"{'missing' if s is None else f'{s.dtype} {list(s.shape)}'}, expected torch.float32 [{n}]"
        )
    else:
        return (
            w,
            s,
            None,
            module.bias,
            getattr(module, "compute_dtype", None) or torch.bfloat16,
            describe_origin(BFL_FP8R, "channel", False),
            "channel",
        )
    return None


def _modelopt_plan(prefix: str, module: Optional[nn.Module], sd: Mapping, problems: list) -> Optional[tuple]:
    w, s, i = sd.get(prefix + ".weight"), sd[prefix + ".weight_scale"], sd.get(prefix + ".input_scale")
    if prefix + ".weight_scale_2" in sd or (w is not None and w.dtype == torch.uint8):
        problems.append(f"{prefix}: NVFP4 layout (weight_scale_2 / packed uint8 weight): only FP8 is run here")
        return None
    from fx_fp8.quant.rules import is_plain_linear

    if not is_plain_linear(module):
        what = (
            "no module of that name"
            if module is None
            else f"a {type(module).__name__} there" + (" with its own forward" if isinstance(module, nn.Linear) else "")
        )
        problems.append(f"{prefix}: the checkpoint quantizes it but the model has {what}")
        return None
    n, k = module.out_features, module.in_features
    if w is None or w.dtype != FP8_DTYPE or tuple(w.shape) != (n, k):
        got = "no weight" if w is None else f"weight {w.dtype} {list(w.shape)}"
        problems.append(f"{prefix}: {got}, expected {FP8_DTYPE} [{n}, {k}] beside its weight_scale")
        return None
    g = scale_granularity(s.shape, n)
    if g is None or s.dtype not in FLOAT_DTYPES:
        problems.append(
            f"{prefix}: weight_scale {s.dtype} {list(s.shape)}: expected a float scale of shape [] / [1] "
            f"(per tensor) or [{n}] / [{n}, 1] (per channel); block scales are not supported"
        )
        return None
    if i is not None and (i.numel() != 1 or i.dtype not in FLOAT_DTYPES):
        problems.append(
            f"{prefix}: input_scale {i.dtype} {list(i.shape)}: expected one float (a static per-tensor "
            "activation scale)"
        )
        return None
    bias = sd.get(prefix + ".bias", module.bias)
    if bias is not None and (bias.is_meta or tuple(bias.shape) != (n,)):
        problems.append(
            f"{prefix}: bias {'not loaded (meta tensor)' if bias.is_meta else list(bias.shape)}; give "
            f"{prefix}.bias in the state dict"
        )
        return None
    dtype = bias.dtype if bias is not None else module.weight.dtype
    if dtype not in FLOAT_DTYPES:
        dtype = torch.bfloat16
    return w, s, i, bias, dtype, describe_origin(MODELOPT_FP8, g, i is not None), g


def adopt_prequantized(model: nn.Module, config=None, *, state_dict: Optional[Mapping] = None, **overrides) -> dict:
    """Swap a model's pre-quantized FP8 linears for QuantizedLinear modules holding the very same
    weight tensors (no copy, no re-quantization: the stored bytes are what the FP8 GEMMs read).

    * BFLFP8RLinear modules (diffusers' BFL `fp8r` loader, e.g. from_single_file with
      BFLQuantizationConfig) become per-channel QuantizedLinear layers sharing their weight.
    * With `state_dict` (the tensors of a ModelOpt FP8 export, e.g. safetensors' load_file of the
      checkpoint): every `<name>.weight_scale` entry names an nn.Linear of the model that becomes a
      QuantizedLinear holding `<name>.weight` itself (float8_e4m3fn [N, K]), its scale (per tensor or
      per channel), `<name>.input_scale` as its static activation scale when present, and
      `<name>.bias` (else the module's bias). The other entries are not read: load them with
      `model.load_state_dict({k: v for k, v in state_dict.items() if k not in used}, strict=False)`,
      `used` being the result's "state_dict_keys".
    `config` (and `overrides`) decide as for prepare_model (fx_fp8.quant.rules, by name: no graph is
    traced): a sensitive layer with quantization_config.sensitive "weight_only" (the default) becomes
    a weight-only QuantizedLinear (the stored weight, unquantized activations); a layer kept native
    (quantization off, ignored_layers, sensitive "native", too small) is not swapped: a BFLFP8RLinear
    stays as it is (its forward dequantizes), an export's layer gets W * scale in its own weight's
    dtype. Layers without a static input scale quantize activations dynamically, as
    quantization_config.activation_granularity says. A layer carrying diffusers or accelerate hooks
    is not swapped either (the hooks would be lost). Every layer is checked before the model is
    touched: an error names each bad entry and leaves the model as it was.
    Returns {"adopted": {name: origin}, "weight_only": [names among them], "kept": {name: reason},
    "state_dict_keys": [keys read]}.
    """
    from fx_fp8.config.fp8_config import FP8Config
    from fx_fp8.config.patterns import warn_unmatched_patterns
    from fx_fp8.quant.linear_plan import plan_linear
    from fx_fp8.quant.module_swap import replace_module
    from fx_fp8.quant.quantized_linear import QuantizedLinear
    from fx_fp8.quant.recipe import WeightRecipe
    from fx_fp8.quant.rules import is_plain_linear
    from fx_fp8.quant.state_guard import guard

    if not isinstance(model, nn.Module):
        raise ValueError(f"adopt_prequantized expects a torch.nn.Module, got {type(model).__name__}")
    if state_dict is not None and not isinstance(state_dict, Mapping):
        raise ValueError(
            f"state_dict must be a mapping of tensors (a ModelOpt FP8 export), got {type(state_dict).__name__}"
        )
    if isinstance(config, Mapping) and any(isinstance(v, torch.Tensor) for v in config.values()):
        raise ValueError(
            "adopt_prequantized: the second argument is the fx_fp8 config; pass a checkpoint's tensors "
            "as state_dict=..."
        )
    cfg = FP8Config.load(config, **overrides)
    qcfg = cfg.quantization_config
    model = unwrap_compiled(model)
    modules = dict(model.named_modules())
    plans, problems, used = {}, [], []
    for name, module in modules.items():
        if _is_bfl_fp8r(module):
            plan = _bfl_plan(name, module, problems)
            if plan is not None:
                plans[name] = plan
    for key in sorted(state_dict or {}):
        if not key.endswith(".weight_scale"):
            continue
        prefix = key[: -len(".weight_scale")]
        if prefix in plans:
            problems.append(f"{prefix}: both a loaded pre-quantized module and state_dict entries")
            continue
        plan = _modelopt_plan(prefix, modules.get(prefix), state_dict, problems)
        if plan is not None:
            plans[prefix] = plan
            used += [
                k
                for k in (f"{prefix}.{s}" for s in ("weight", "weight_scale", "input_scale", "bias"))
                if k in state_dict
            ]
    if problems:
        raise ValueError(
            "fx_fp8: adopt_prequantized found layers it cannot adopt (nothing was changed):\n  " + "\n  ".join(problems)
        )
    if cfg.linear_enabled:  # a typo here keeps nothing native, and a compile never sees the dequantized weights
        warn_unmatched_patterns(
            qcfg.ignored_layers,
            [n for n, m in modules.items() if n in plans or is_plain_linear(m) or isinstance(m, QuantizedLinear)],
            "adopt_prequantized",
        )
    warn_bad_scales(
        [b for name, p in plans.items() if (b := bad_scale(name, p[1], p[2])) is not None], "adopt_prequantized"
    )
    swaps, kept, dequantized = [], {}, []
    for name, (w, s, i, bias, dtype, origin, g) in plans.items():
        module = modules[name]
        plan = plan_linear(
            name, w.shape[1], w.shape[0], dtype, qcfg, enabled=cfg.linear_enabled, stored=WeightRecipe("fp8", g)
        )
        hooks = _kept_reason(module)
        if plan.native or hooks:
            kept[name] = hooks or plan.reason
            if not _is_bfl_fp8r(module):  # an export's layer: its weight, dequantized, is what runs natively
                weight = (w.float() * canonical_weight_scale(s, g)).to(dtype)
                dequantized.append((module, weight, bias))
                kept[name] += f"; {origin} dequantized into its weight ({dtype})"
            continue
        input_scale = tensor_scale(i.detach()) if i is not None and not plan.weight_only else None
        new = QuantizedLinear.from_plan(
            plan,
            w.detach(),
            canonical_weight_scale(s, g),
            bias,
            orig_dtype=dtype,
            input_scale=input_scale,
            origin=origin,
        )
        swaps.append((name, module, new, origin))
    # every layer checked and built: only now change the model
    for module, weight, bias in dequantized:
        module.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
    for name, old, new, origin in swaps:
        replace_module(model, name, new, old=old)
        new.accept_weight(name)
    if swaps:
        guard(model, kept)  # save_quantized records why the kept layers are full precision
    return {
        "adopted": {name: origin for name, _, _, origin in swaps},
        "weight_only": [name for name, _, new, _ in swaps if new.weight_only],
        "kept": kept,
        "state_dict_keys": used,
    }
