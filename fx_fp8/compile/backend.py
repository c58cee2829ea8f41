"""The Dynamo backends `fp8` and `fp8_npu`: options -> config -> passes -> downstream compiler.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fp8")` works without importing fx_fp8 first.

Per graph Dynamo hands over:
  1. names: each node is resolved to the compiled model's real module name
     (fx_fp8/graph/names.py), once, into the node's meta;
  2. the passes run on a copy of the graph for each step variant the step
     selectors can produce (one, or up to four: fx_fp8.steps.variant_name);
  3. each variant goes to the downstream compiler (eager, Inductor, npugraph_ex)
     on its first call;
  4. the reports go to the compiled model (fx_fp8.get_reports(compiled)) and to
     the bounded recent-compiles log.

What runs per call lives in fx_fp8/compile/dispatch.py (step variant, module instance); the reuse of
one instance's decisions by instances with equal facts in fx_fp8/compile/instance_plans.py.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.compile import compile_log
from fx_fp8.quant.activation_scales import load_activation_scales
from fx_fp8.quant.linear_scales import check_scales_match
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops.lowering import get_lowering, npu_available, resolve_lowering_name
from fx_fp8.config.patterns import matches
from fx_fp8.passes.base import CompileContext
from fx_fp8.passes.manager import PassManager
from fx_fp8.passes.base import FactsContext, NotReusable
from fx_fp8.passes.linear import apply_weight_action
from fx_fp8.graph.forms import is_attention
from fx_fp8.graph.fx_utils import fill_example_values
from fx_fp8.graph.dynamo_internals import (compiling_under, current_tracing_context, fake_inputs, generate_code_now,
                                           lazy_graph_module)
from fx_fp8.graph.fx_utils import placeholder_index
from fx_fp8.graph.names import INSTANCE_KEY, LayerMap, instance_module_name, module_name, rename_instance, resolve_graph
from fx_fp8.graph.sensitive import find_sensitive_linears, holds_model_output
from fx_fp8.compile.dispatch import InstanceDispatch, StepDispatch, find_anchor
from fx_fp8.compile.instance_plans import Template, check_reuse
from fx_fp8.report import RECENT, CompileReport, ModelRecord
from fx_fp8.quant.rules import is_plain_linear
from fx_fp8.quant.weight_feeds import Fed, Resolver
from fx_fp8.quant.quantized_linear import QuantizedLinear

#: tests set it: an instance that reuses another's decisions also runs the passes, and any
#: difference (report rows, weights, notes, warnings, decisions) raises
CHECK_REUSE = False
#: block instances planned in this process: by running the passes, or by reusing an equal instance's decisions
INSTANCE_PLANS = {"passes": 0, "reused": 0}


#: torch.compile options that configure the backend rather than the FP8 config
BACKEND_OPTION_KEYS = ("config", "dump_graphs", "mode")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def config_from_options(options: Optional[dict]) -> tuple[FP8Config, dict]:
    """Split torch.compile options into an FP8Config and backend-only settings."""
    options = dict(options or {})
    backend_opts = {k: options.pop(k) for k in BACKEND_OPTION_KEYS if k in options}
    base = backend_opts.pop("config", None)
    if backend_opts.get("mode") not in MODES:
        raise ValueError(f"invalid mode {backend_opts['mode']!r}: expected one of {', '.join(map(str, MODES[1:]))}")
    if base is None:
        return FP8Config.from_kwargs(**options), backend_opts
    return FP8Config.load(base, **options), backend_opts


def _graph_device(example_inputs) -> Optional[torch.device]:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return None


def choose_lowering(backend: str, config: FP8Config, device, warn: Callable[[str], None]) -> str:
    if config.lowering == "cuda" and (device is None or device.type != "cuda"):
        # its kernels take CUDA tensors only: every node would stay native, each row saying why
        warn(f"fx_fp8: lowering 'cuda' was asked for but the graph's tensors are on "
             f"{device.type if device is not None else 'no device'!r} (CUDA available: {torch.cuda.is_available()}): "
             "every attention and linear stays native; use lowering 'auto' or 'reference' here")
    if config.lowering != "auto":
        return config.lowering
    if backend == "fp8_npu":
        if npu_available() or (device is not None and device.type in ("npu", "privateuseone")):
            return "npu"
        warn("fx_fp8: backend 'fp8_npu' found no Ascend NPU (torch_npu not importable or no device); "
             "falling back to the CPU reference lowering ('reference')")
        return "reference"
    return resolve_lowering_name("auto", device)


def choose_downstream(config: FP8Config, lowering: str, mode: Optional[str]) -> str:
    if config.downstream != "auto":
        return config.downstream
    if mode:
        return "inductor"
    if lowering == "npu" and npu_available():
        return "npugraph_ex"
    if lowering == "cuda":
        return "inductor"
    return "eager"


def _downstream_compile(name: str, gm: torch.fx.GraphModule, example_inputs, mode: Optional[str]) -> Callable:
    if name == "eager":
        generate_code_now(gm)  # now, not on every call
        return gm.forward
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = torch._inductor.list_mode_options(mode) if mode else {}
        return compile_fx(gm, example_inputs, config_patches=patches)
    if name == "npugraph_ex":
        try:
            backend = torch._dynamo.lookup_backend("npugraph_ex")
        except Exception as e:
            from fx_fp8.install_hint import install_hint

            raise RuntimeError(f"downstream 'npugraph_ex' needs torch_npu ({install_hint('npu')}): {e}") from None
        return backend(gm, example_inputs)
    raise ValueError(f"unknown downstream compiler {name!r}")


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule sharing gm's submodules and constants, with its own copy of the graph
    (node meta copied). Its Python code is generated lazily, on first call, if ever: the
    downstream compiler reads the graph, and regenerating a large graph's code is the main
    cost of a backend call that changed nothing. It keeps what marks a graph as Dynamo's
    (gm.meta, the placeholders' sources, `_param_name_to_source`): AOTAutograd reads them to
    tell which inputs keep their address, so CUDA graphs do not copy parameters every replay."""
    new = torch.fx.Graph()
    out = new.graph_copy(gm.graph, {})
    new.output(out)
    copy = lazy_graph_module(gm, new)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for old, node in zip(gm.graph.find_nodes(op="placeholder"), new.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            node._dynamo_source = old._dynamo_source
    return copy


def _kept_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The copy of Dynamo's graph the backend keeps (other instances and step variants are planned
    from it after this call returns), without Dynamo's record of each placeholder's example input:
    that holds a weak reference to the user's tensor, and torch's swap-based conversion (FSDP2,
    DTensor, tensor subclasses) refuses to swap a parameter anything references weakly."""
    kept = _copy_graph(gm)
    for node in kept.graph.find_nodes(op="placeholder"):
        node.meta.pop("grapharg", None)
    return kept


def _layer_map(gm: torch.fx.GraphModule, model) -> LayerMap:
    attention = [module_name(n) for n in gm.graph.nodes if is_attention(n)]
    if model is not None:
        return LayerMap.from_model(model, set(attention))
    return LayerMap.from_graph(attention, [module_name(n) for n in gm.graph.nodes])


def compile_graph(gm: torch.fx.GraphModule, example_inputs, *, backend: str, options: Optional[dict] = None,
                  mode: Optional[str] = None, model=None, owner=None):
    """The whole backend for one Dynamo graph; `model`/`owner` default to what the Python
    stack shows (see fx_fp8.graph.dynamo_internals.find_compiled_model). Returns the callable Dynamo runs."""
    config, backend_opts = config_from_options(options)
    mode = mode or backend_opts.get("mode")
    model, owner = resolve_graph(gm, example_inputs, model=model, owner=owner)
    gm = _kept_graph(gm)
    device = _graph_device(example_inputs)
    first_record = ModelRecord.of(owner)
    compile_log.first_seen(first_record)  # progress log: the first call's clock
    lowering = choose_lowering(backend, config, device, first_record.warn)
    downstream = choose_downstream(config, lowering, mode)
    qcfg = config.quantization_config
    static_scales = (load_activation_scales(qcfg.activation_scales)
                     if config.linear_enabled and qcfg.activation_scheme == "static" else None)
    if static_scales is not None and model is not None:
        check_scales_match(static_scales, [n for n, m in model.named_modules()
                                           if is_plain_linear(m) or isinstance(m, QuantizedLinear)])
    layer_map = _layer_map(gm, model)
    # graph analyses, once per Dynamo graph, keyed by node name (stable across the graph's copies)
    # (a block compiled on its own holds no final projection: see holds_model_output)
    sensitive = ({n.name: why for n, why in
                  find_sensitive_linears(gm, model_output=holds_model_output(gm)).items()}
                 if config.linear_enabled else {})
    variants = config.step_variants()
    artifacts: dict = {}  # (variant, decisions) -> compiled callable: instances that decide alike share them

    tracing_context = current_tracing_context()
    # the graph's own fake inputs (no memory held): a later compile sees the shapes Dynamo traced,
    # so the compile caches key it as they key a compile made inside Dynamo
    fake_args = fake_inputs(tracing_context, example_inputs)

    passes = PassManager().pass_types
    placeholders = placeholder_index(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    own_instance = gm.meta.get(INSTANCE_KEY) or ""
    templates: dict = {}  # instance facts -> Template: decisions already made for an instance with these facts

    def facts_of(inputs: list, name: str, resolver: Resolver) -> Optional[tuple]:
        """What every pass's decisions read that can differ between instances
        (FXPass.instance_facts), for instance `name`, evaluated on its names without copying
        the graph; None when a pass cannot say."""
        if backend_opts.get("dump_graphs"):  # graph dumps are per instance
            return None
        fc = FactsContext(config=config, layer_map=layer_map, static_scales=static_scales, sensitive=sensitive,
                          gm=gm, example_inputs=inputs, placeholders=placeholders, resolver=resolver)
        facts = []
        try:
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                module = instance_module_name(node, own_instance, name)
                for pass_type in passes:
                    f = pass_type.instance_facts(fc, node, module)
                    if f is not None:
                        facts.append((node.name, pass_type.name, f))
        except NotReusable:
            return None
        return tuple(facts)

    def run_passes(inputs: list, name: str, warn: Callable[[str], None], resolver: Resolver) -> dict:
        """{variant: (report, rewritten graph, compile context)} for instance `name` (its weight
        states kept where `resolver` finds them: on the instance model's modules)."""
        out = {}
        for variant in variants:
            graph_copy = _copy_graph(gm)
            rename_instance(graph_copy, own_instance, name)
            report = CompileReport(backend=backend, lowering=lowering, downstream=downstream, step_variant=variant)
            ctx = CompileContext(gm=graph_copy, example_inputs=inputs, config=config,
                                 lowering=get_lowering(lowering), report=report, layer_map=layer_map,
                                 warn=warn, step_variant=variant, static_scales=static_scales,
                                 analysis={"sensitive": {n: sensitive[n.name] for n in graph_copy.graph.nodes
                                                         if n.name in sensitive}},
                                 dumps=[] if backend_opts.get("dump_graphs") else None, resolver=resolver)
            PassManager(passes).run(ctx)
            report.layer_map = layer_map.as_dict()
            if ctx.dumps is not None:
                report.notes.append(f"{len(ctx.dumps)} graph dumps attached")
                report.graphs = dict(ctx.dumps)
            out[variant] = (report, graph_copy, ctx)
        return out

    def reuse(template: "Template", inputs: list, name: str, resolver: Resolver) -> dict:
        """run_passes' result for instance `name`, from an instance with equal facts: its
        rewritten graphs, its report rows renamed, its weight side effects redone on this
        instance's weights. NotReusable where a name cannot be carried over."""
        if not template.portable_warnings and template.name != name:
            raise NotReusable("the template instance's passes warned, naming its layers")
        renamed: dict = {}

        def rename(spelling: str) -> str:  # the template's name of a resolved module -> this instance's
            if spelling not in renamed:
                if spelling not in template.nodes_of:
                    raise NotReusable(f"module {spelling!r} names no node of the graph")
                renamed[spelling] = instance_module_name(nodes[template.nodes_of[spelling]], own_instance, name)
            return renamed[spelling]

        qcfg_ = config.quantization_config
        out = {}
        for variant, (t_report, graph, t_ctx) in template.variants.items():
            report = CompileReport(backend=backend, lowering=lowering, downstream=downstream, step_variant=variant,
                                   layer_map=dict(t_report.layer_map), weights=dict(t_report.weights),
                                   notes=list(t_report.notes))
            for e in t_report.entries:
                module = rename(e.module) if e.name_resolved else e.module
                report.entries.append(dataclasses.replace(e, module=module, layer=layer_map.layer_of(module)))
            for action in t_ctx.weight_actions:
                module = instance_module_name(nodes[action.node], own_instance, name)
                apply_weight_action(action, inputs[action.slot], module, qcfg_, static_scales, resolver)
            ctx = CompileContext(gm=graph, example_inputs=inputs, config=config, lowering=t_ctx.lowering,
                                 report=report, layer_map=layer_map, warn=t_ctx.warn, step_variant=variant,
                                 static_scales=static_scales, placeholders=placeholders,
                                 unmatched_ignored_layers=list(t_ctx.unmatched_ignored_layers),
                                 resolver=resolver, feeds=t_ctx.feeds)
            out[variant] = (report, graph, ctx)
        return out

    def plan(inputs: list, model_, owner_, rename: Optional[tuple] = None) -> Callable:
        """Passes for every step variant of the graph, its names moved from one instance to
        another by `rename` (reports to owner_'s record), then the downstream compile unless an
        instance with the same decisions already has one. An instance whose facts equal an
        earlier instance's reuses that one's decisions without running the passes."""
        record = ModelRecord.of(owner_)
        planning_started = time.perf_counter()  # progress log: the passes' seconds
        name = rename[1] if rename is not None else own_instance
        resolver = Resolver(model_)
        facts = facts_of(inputs, name, resolver)
        template = templates.get(facts) if facts is not None else None
        planned = warned = full = None
        if template is not None:
            try:
                planned = reuse(template, inputs, name, resolver)
                warned = template.warnings
            except NotReusable:
                planned = None
        if planned is None or CHECK_REUSE:
            messages: list[str] = []
            full = run_passes(inputs, name, messages.append, resolver)
            if planned is not None:
                check_reuse(planned, full, warned, messages, name)
            else:
                planned, warned = full, messages
                if facts is not None and facts not in templates:
                    candidate = Template.of(name, full, messages, gm)
                    if candidate is not None:
                        templates[facts] = candidate
        INSTANCE_PLANS["reused" if planned is not full else "passes"] += 1
        passes_s = time.perf_counter() - planning_started  # progress log
        for message in warned:
            record.warn(message)
        rewritten, keys, feeds = {}, {}, {}
        for variant, (report, graph, ctx) in planned.items():
            _warn_about_selectors(layer_map, ctx.unmatched_ignored_layers, config, record, model_)
            record.add(report)
            RECENT.add(report)
            keys[variant] = (tuple((e.node, e.action, e.reason) for e in report.entries), ctx.feeds.signature)
            rewritten[variant] = graph
            feeds[variant] = ctx.feeds

        def compile_variant(variant, inputs_) -> Callable:
            key = (variant, keys[variant])
            if key not in artifacts:
                # a variant or instance compiled on its first call runs outside Dynamo: Dynamo's
                # tracing context (fake mode, shape env) lets Inductor's caches take it
                # the compile caches need a fake value on every node the passes inserted (only for
                # a graph that is compiled: an instance that reuses an artifact skips it)
                fill_example_values(rewritten[variant].graph)
                examples = (list(inputs_) if fake_args is None else list(fake_args)) + feeds[variant].example_inputs(
                    fake=fake_args is not None)
                with compiling_under(tracing_context), compile_log.compiling(  # progress log: INFO records
                        planned[variant][0], rewritten[variant], downstream=downstream, passes_s=passes_s,
                        record=record):
                    artifacts[key] = _downstream_compile(downstream, rewritten[variant], examples, mode)
            return fed(variant, artifacts[key], inputs_)

        def fed(variant, artifact, inputs_) -> Callable:
            """The artifact called with this instance's appended inputs (once per call, outside it)."""
            feeder = feeds[variant].feeder(list(inputs_), resolver)
            return artifact if feeder is None else Fed(artifact, feeder)

        if not config.has_step_skips:
            return compile_variant(None, inputs)
        ready = {v: (fed(v, artifacts[(v, keys[v])], inputs) if (v, keys[v]) in artifacts else None) for v in variants}
        return StepDispatch(ready, config, record, compile_variant)

    first = plan(list(example_inputs), model, owner)
    if model is None:
        return first
    instance = gm.meta.get(INSTANCE_KEY) or ""
    anchor_slot, anchor = find_anchor(example_inputs, model, instance)
    dispatch = InstanceDispatch(gm, instance, anchor_slot, anchor, first, plan, [(model, owner)])
    if anchor_slot is not None:
        dispatch.remember(example_inputs[anchor_slot], first, model)
    dispatch.by_name[instance] = first  # without parameters: instances told apart on the stack
    return dispatch



def _warn_about_selectors(layer_map: LayerMap, unmatched_ignored_layers: list, config: FP8Config,
                          record: ModelRecord, model=None) -> None:
    n = layer_map.num_layers
    beyond = config.diffusion_kv_cache_skip_layers.at_least(n)
    if config.attention_enabled and beyond:
        record.warn(f"fx_fp8: diffusion_kv_cache_skip_layers names layers {beyond} but the model has {n} layers"
                    + (f" (0-{n - 1})" if n else ""))
    typos = _matching_no_linear_of(model, unmatched_ignored_layers)
    if typos:
        record.warn(f"fx_fp8: ignored_layers patterns matched no linear of the model: {typos}")


#: model -> {patterns: those naming no linear of it}: every block instance asks the same question
_TYPOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _matching_no_linear_of(model, patterns: list) -> list:
    """Of the patterns a graph did not match, those that name no linear anywhere in the model:
    a pattern for another block (regional compilation) or another graph piece is not a mistake."""
    if model is None or not patterns:
        return list(patterns)
    names = tuple(n for n, m in model.named_modules() if is_plain_linear(m) or isinstance(m, QuantizedLinear))
    known = _TYPOS.setdefault(model, {})
    key = (tuple(patterns), names)  # the model's linears may change (LoRA, prepare): asked again then
    if key not in known:
        known[key] = [p for p in patterns if not any(matches(p, n) for n in names)]
    return list(known[key])



def fp8_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8", options={...})`: lowering from the tensors' device."""
    return compile_graph(gm, example_inputs, backend="fp8", options=options, mode=mode)


def fp8_npu_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8_npu", options={...})`: the Ascend lowering
    (CPU reference, with a warning, where no NPU is present)."""
    return compile_graph(gm, example_inputs, backend="fp8_npu", options=options, mode=mode)
