"""prepare_model: a model's eligible linears become QuantizedLinear modules, before compiling.

The same plan as the linear pass decides (fx_fp8.quant.linear_plan.plan_linear), including the sensitive
layers found by the graph's structure (fx_fp8/graph/sensitive.py) when example inputs
are given: the model is traced once on them. That trace also gives each linear's token count M,
at which the per-GPU tune table decides it as it does in the compiled graph (fx_fp8.quant.tuned_plan).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Optional

import torch
import torch.nn as nn

from fx_fp8 import progress
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.patterns import warn_unmatched_patterns
from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.graph.sensitive import trace_linears
from fx_fp8.ops.lowering import get_lowering, resolve_lowering_name
from fx_fp8.quant.keep_fp32 import keep_in_fp32_names, keep_in_fp32_reason, model_sensitive_reason
from fx_fp8.quant.linear_plan import Calibration, plan_linear
from fx_fp8.quant.linear_scales import check_scales_match, smoothed_static_scale
from fx_fp8.quant.module_swap import replace_module
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.recipe import group_smoothing
from fx_fp8.quant.rules import check_not_prepared, is_plain_linear, sensitive_reason
from fx_fp8.quant.tuned_plan import table_unapplied, tuned_plan
from fx_fp8.quant.weight_state import state_on

#: diffusers hooks that do not keep a linear from being replaced: group offloading's, whose groups
#: compile_pipeline rebuilds over the new modules after preparing (fx_fp8/pipeline/offload.py)
REBUILT_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")
#: why the tune table was not applied to a linear, by what prepare_model knows of its token count M
NO_EXAMPLE_INPUTS = (
    "M unknown: prepare_model was given no example_inputs (give them, as compile_pipeline does, to "
    "follow the table); planned by the rules, and the compiled graph runs it as prepared"
)
NOT_TRACED = "M unknown: not called by the forward traced on example_inputs; planned by the rules"
SYMBOLIC = "M symbolic in the trace on example_inputs; planned by the rules"

log = logging.getLogger("fx_fp8")


def hooks_lost_by_replacing(module: nn.Module) -> list[str]:
    """Names of the diffusers hooks on `module` that replacing it would lose (context parallelism's
    output gather on proj_out, TaylorSeer's lite mode): they live on the module object and its
    patched forward, which a new module does not have."""
    registry = getattr(module, "_diffusers_hook", None)
    return [h for h in getattr(registry, "hooks", None) or {} if h not in REBUILT_HOOKS]


def prepare_model(
    model: nn.Module, config=None, *, example_inputs=None, sensitive: Optional[dict] = None, **overrides
) -> dict:
    """Quantize eligible nn.Linear weights of `model` in place, freeing the originals.

    Uses the same plan as the linear pass (fx_fp8.quant.linear_plan: ignored_layers,
    sensitive layers, sizes). The sensitive layers are found by structure, as
    the backend finds them, when `example_inputs` is given (a tuple of
    arguments, a dict of keyword arguments, or (args, kwargs)): the model is
    traced once on them. Without it only the name patterns are known (the
    backend then warns about prepared layers it finds sensitive). `sensitive`
    ({module name: reason}) passes such a result directly.
    Everything is checked and every weight quantized before the model is
    touched: an error leaves the model exactly as it was.
    With quantization_config.smoothing_alpha, each layer is smoothed on its own (prepare_model
    sees no graph, so no activation-quantization groups): s from the calibrated channel
    maxima and the layer's weight columns, the weight stored as quantized W * s and 1/s as
    the layer's `input_smoothing` buffer (bytes_after counts it).
    With per-step static scales (fx_fp8.calibrate(..., per_step=True)) each layer keeps its scale
    per step group (`input_step_scales`), looked up from the published step per call.
    Under quantization_config.kernel "auto", where a tune table applies to the weights' device
    (fx_fp8.ops.tune_table.table_for; on CUDA, or anywhere with quantization_config.tune_table),
    each linear follows it as the compiled graph does (fx_fp8.quant.tuned_plan): a layer the table
    says loses to native stays an nn.Linear (its reason "tuned: native ..."), or becomes weight-only.
    The table is looked up at the token count M of the linear's input, known from the trace on
    `example_inputs` only: without them (or for a linear the trace did not call, or called at
    several M the table decides differently) the rules decide, and `tune_table` says so.
    Sensitive layers with quantization_config.sensitive "weight_only" become weight-only
    (W8A16) QuantizedLinear modules (`weight_only` is true; scales as weight_only_group_size says).
    A linear carrying diffusers hooks (other than group offloading's) is not replaced, since the
    hooks would be lost: it stays an nn.Linear with its hooks and original weight, the backend
    quantizes it at compile time, and `hooked` ({name: reason}) and a warning say so.
    Returns {"quantized": [names], "weight_only": [names among them], "native": {name: reason},
    "hooked": {name: reason}, "bytes_before", "bytes_after", "method", "tune_table"}; "tune_table"
    is None where no table applies (the compiled graph follows none either), else {"source": the
    table, "applied": [names it was looked up for, at their traced M], "not_applied": {name: why}}.
    Call it once before torch.compile(model, backend="fp8"/"fp8_npu").
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"prepare_model expects a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_compiled(model)  # a torch.compile'd module: prepare what it wraps
    started = time.perf_counter()  # progress log
    cfg = FP8Config.load(config, **overrides)
    qcfg = cfg.quantization_config
    result = {
        "quantized": [],
        "weight_only": [],
        "native": {},
        "hooked": {},
        "bytes_before": 0,
        "bytes_after": 0,
        "method": qcfg.method,
        "tune_table": None,
    }
    if not cfg.linear_enabled:
        return result
    check_not_prepared(
        model,
        "it cannot be prepared again",
        "prepare the original model once; compile a prepared "
        "model as it is (torch.compile(model, backend='fp8'), or compile_pipeline(pipe, prepare=False))",
    )
    linears = [(n, m) for n, m in model.named_modules() if is_plain_linear(m)]
    warn_unmatched_patterns(qcfg.ignored_layers, [n for n, _ in linears], "prepare_model")  # before weights are freed
    traced = None  # {linear name: {(M, activation dtype)}} where a trace ran: the tune table's M
    if example_inputs is not None:
        args, kwargs = _split_inputs(example_inputs)
        if sensitive is None or _follows_a_table(cfg, linears):  # a trace only for what it tells
            trace = trace_linears(model, args, kwargs)
            sensitive, traced = trace.sensitive if sensitive is None else sensitive, trace.inputs
    sensitive = sensitive or {}
    calibration = _calibration(cfg, [n for n, _ in linears])
    # quantized outside inference_mode: a model prepared inside it holds normal tensors, whose writes
    # (load_state_dict) the version counter sees, as one prepared outside it
    with torch.inference_mode(False):
        plan, hooked = _plan_layers(model, cfg, linears, sensitive, calibration, result, traced)
        for name, _, new in plan:  # its bytes' fingerprint and digest: what can still fail on the tensors
            new.accept_weight(name)
    _install(model, plan, hooked, result)  # every check passed and every weight is quantized and accepted
    progress.log_prepared(result, time.perf_counter() - started)  # progress log: INFO summary
    told = result["tune_table"]
    if told and told["not_applied"]:  # not silent: the compiled graph may have followed the table
        name, why = next(iter(told["not_applied"].items()))
        log.info(
            "fx_fp8: prepare_model did not apply the tune table %s to %d linear(s) (%s: %s)",
            told["source"],
            len(told["not_applied"]),
            name,
            why,
        )
    return result


def _plan_layers(
    model: nn.Module,
    cfg: FP8Config,
    linears: list,
    sensitive: dict,
    calibration: Calibration,
    result: dict,
    traced: Optional[dict],
) -> tuple[list, list]:
    """[(name, linear, its QuantizedLinear)] and the hooked linears left as they are; fills
    result["native"] / ["hooked"] / ["tune_table"]. Reads the model, changes nothing in it."""
    qcfg = cfg.quantization_config
    plan, hooked = [], []
    keep_fp32 = keep_in_fp32_names(model)  # transformers' list (T5's `wo` casts its input to its weight's dtype)
    tables: dict = {}  # {device: the tune table that applies there, or None}: looked up once per device
    for name, module in progress.bar(linears, desc="fx_fp8: quantizing linears"):  # a bar on a terminal
        w = module.weight
        lowering = get_lowering(resolve_lowering_name(cfg.lowering, w.device))
        why = model_sensitive_reason(model, name) or sensitive.get(name)  # a text encoder's lm_head / vision tower
        layer = plan_linear(
            name,
            module.in_features,
            module.out_features,
            w.dtype,
            qcfg,
            sensitive=why,
            calibration=calibration,
            graph_reason=keep_in_fp32_reason(keep_fp32, name, type(model).__name__),
            lowering=lowering,
        )
        device = w.device
        if device not in tables:
            tables[device] = table_unapplied(qcfg, lowering, device)
        layer = _tuned(name, module, layer, qcfg, lowering, tables[device], why, traced, result)
        if layer.native:
            result["native"][name] = layer.reason
            continue
        hooks = hooks_lost_by_replacing(module)
        if hooks:
            hooked.append(module)
            result["hooked"][name] = (
                f"carries diffusers hooks {hooks}: not replaced (the hooks would be lost); the backend quantizes it "
                f"at compile time ({'weight-only' if layer.weight_only else qcfg.method}) and it keeps its "
                "original weight"
            )
            continue
        plan.append((name, module, _quantized_layer(name, module, layer)))
    return plan, hooked


def _follows_a_table(cfg: FP8Config, linears: list) -> bool:
    """Whether a tune table applies to the device of some linear's weight (M then matters)."""
    devices = {m.weight.device for _, m in linears}
    qcfg = cfg.quantization_config
    return any(table_unapplied(qcfg, get_lowering(resolve_lowering_name(cfg.lowering, d)), d) for d in devices)


def _tuned(
    name: str,
    module: nn.Module,
    layer,
    qcfg,
    lowering,
    source: Optional[str],
    structural: Optional[str],
    traced: Optional[dict],
    result: dict,
):
    """`layer` as the tune table (`source`: the one that applies to its device, None: none) has it at
    the M the trace on example_inputs saw (tuned_plan, the linear pass's step); the rules' plan where
    no table applies or M is unknown (result["tune_table"] says which and why)."""
    sensitive = sensitive_reason(name, structural) is not None
    if source is None or layer.native or (sensitive and qcfg.sensitive == "fp8"):  # no say (as in the linear pass)
        return layer
    told = result["tune_table"] = result["tune_table"] or {"source": source, "applied": [], "not_applied": {}}
    seen = sorted(traced.get(name, ()), key=str) if traced is not None else []
    why = (
        NO_EXAMPLE_INPUTS
        if traced is None
        else NOT_TRACED
        if not seen
        else SYMBOLIC
        if any(m is None for m, _ in seen)
        else None
    )
    if why is None:
        tuned = [
            tuned_plan(
                layer,
                qcfg,
                lowering,
                m=m,
                k=module.in_features,
                n=module.out_features,
                dtype=dtype,
                device=module.weight.device,
                has_bias=module.bias is not None,
                sensitive=sensitive,
            )
            for m, dtype in seen
        ]
        if len({t.kind for t in tuned}) == 1:
            told["applied"].append(name)
            return tuned[0]
        why = (
            f"called at M {', '.join(str(m) for m, _ in seen)}, where the table picks "
            f"{' / '.join(t.kind for t in tuned)}: one prepared layer cannot run each; planned by the rules"
        )
    told["not_applied"][name] = why
    return layer


def _calibration(cfg: FP8Config, names: list) -> Calibration:
    """The calibration the config names, checked to name this model's linears."""
    calibration = Calibration.load(cfg)
    if calibration.scales is not None:
        check_scales_match(calibration.scales, names)
    if calibration.channel is not None:
        check_scales_match(calibration.channel, names, what="channel_amax entries", one="channel_amax entry")
    return calibration


def _install(model: nn.Module, plan: list, hooked: list, result: dict) -> None:
    """Only now change the model: each planned QuantizedLinear in its linear's place and the model
    guarded (every original put back if anything fails part-way), the hooked linears marked;
    `result` counts them."""
    from fx_fp8.quant.state_guard import guard, guarded

    replaced, was_guarded = [], guarded(model)
    try:
        for name, module, new in plan:
            replace_module(model, name, new, old=module)
            replaced.append((name, module))
        if plan:  # save_pretrained would write FP8 codes as weights; load_state_dict is checked first
            guard(model, {**result["native"], **result["hooked"]})  # save_quantized records why they are full precision
    except BaseException:
        _undo(model, replaced, was_guarded)
        raise
    for name, module, new in plan:
        result["bytes_before"] += module.weight.numel() * module.weight.element_size()
        result["bytes_after"] += new.weight.numel() * new.weight.element_size() + new.weight_scale.numel() * 4
        if new.input_smoothing is not None:
            result["bytes_after"] += new.input_smoothing.numel() * 4
        result["quantized"].append(name)
        if new.weight_only:
            result["weight_only"].append(name)
    for module, (name, reason) in zip(hooked, result["hooked"].items()):  # the backend's report says why
        state_on(module, "weight", name).left_by_prepare = reason
    if result["hooked"]:
        names = list(result["hooked"])
        warnings.warn(
            f"fx_fp8: prepare_model left {len(names)} linear(s) carrying diffusers hooks unreplaced (the "
            f"hooks would be lost): {', '.join(names[:8])}; the backend quantizes them at compile time "
            "and they keep their original weights",
            stacklevel=3,
        )


def _undo(model: nn.Module, replaced: list, was_guarded: bool) -> None:
    """Put the original linears back (the objects, with their weights and hooks) and drop the
    guard this call added: the model as it was before the call."""
    from fx_fp8.quant.state_guard import unguard

    for name, module in reversed(replaced):
        replace_module(model, name, module)
    if not was_guarded:
        unguard(model)


def _quantized_layer(name: str, module: nn.Module, layer) -> QuantizedLinear:
    """The QuantizedLinear of `module` as its plan says; a smoothed layer is smoothed on its own
    (prepare_model sees no graph, so no activation-quantization groups)."""
    smoothing = input_scale = None
    if layer.smoothing_alpha is not None:
        smoothing = group_smoothing([(layer.channel_amax, module.weight)], layer.smoothing_alpha, module.weight.device)
        if layer.static:
            input_scale = torch.tensor(
                smoothed_static_scale(layer.channel_amax, smoothing.inverse, layer.recipe.method),
                dtype=torch.float32,
                device=module.weight.device,
            )
    wq, ws = layer.recipe.quantize(module.weight, smoothing)
    return QuantizedLinear.from_plan(
        layer,
        wq,
        ws,
        module.bias,
        orig_dtype=module.weight.dtype,
        input_scale=input_scale,
        input_smoothing=smoothing.inverse if smoothing is not None else None,
    )


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tuple of arguments, a dict of keyword arguments, or (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), example_inputs[1]
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise ValueError(
        f"invalid example_inputs of type {type(example_inputs).__name__}: expected a tuple of "
        "arguments, a dict of keyword arguments, or (args, kwargs)"
    )
