"""The backend's work for one Dynamo graph: GraphPlan (what is decided once per graph) and
InstancePlan (one module instance's rewrite, per step variant, and its compiled callables).

Per graph Dynamo hands over:
  1. names: each node is resolved to the compiled model's real module name
     (fx_fp8/graph/names.py), once, into the node's meta;
  2. the passes run on a copy of the graph for each step variant the step selectors can
     produce (one, or up to four: fx_fp8.config.step_variants.variant_name), per module instance; an instance
     whose facts equal an earlier one's reuses its decisions (fx_fp8/compile/instance_plans.py);
  3. each variant goes to the downstream compiler on its first call; instances that decide alike
     share one compiled artifact, each called with its own weights' quantized copies appended
     (fx_fp8/quant/weight_feeds.py);
  4. the reports go to the compiled model's record (fx_fp8.get_reports(compiled)) and to the
     bounded recent-compiles log.
What runs per call lives in fx_fp8/compile/dispatch.py (step variant, module instance).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Callable, Optional

import torch.fx

from fx_fp8.compile import compile_log, downstream
from fx_fp8.compile.dispatch import InstanceDispatch, StepDispatch, find_anchors
from fx_fp8.compile.graph_copies import copy_graph, kept_graph
from fx_fp8.compile.instance_plans import Template, check_reuse
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.patterns import matches
from fx_fp8.graph.dynamo_internals import compiling_under, current_tracing_context, fake_inputs
from fx_fp8.graph.forms import is_attention
from fx_fp8.graph.fx_utils import fill_example_values, placeholder_index
from fx_fp8.graph.names import INSTANCE_KEY, LayerMap, instance_module_name, module_name, rename_instance, resolve_graph
from fx_fp8.graph.sensitive import find_sensitive_linears, holds_model_output
from fx_fp8.ops.lowering import get_lowering
from fx_fp8.passes.base import CompileOutputs, FactsContext, NotReusable, compile_contexts
from fx_fp8.passes.manager import PassManager
from fx_fp8.quant import weight_actions
from fx_fp8.quant.linear_plan import Calibration
from fx_fp8.quant.linear_scales import check_scales_match
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.rules import is_plain_linear
from fx_fp8.quant.weight_feeds import Fed, Resolver
from fx_fp8.report import RECENT, CompileReport, ModelRecord


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one backend call decided for every instance and variant of its graph."""

    backend: str
    config: FP8Config
    lowering: str
    downstream: str
    mode: Optional[str]
    inductor_options: dict  # Inductor config patches on top of the mode's (backend option inductor_options)
    dump_graphs: bool
    check_reuse: bool  # a reused instance also runs the passes; any difference raises (a debugging option)


class GraphPlan:
    """One Dynamo graph: its settings and analyses (once), the templates instances reuse, and the
    compiled artifacts (variant, decisions, feeds) -> callable that alike instances share."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, settings: Settings, model, owner):
        self.gm, self.settings, self.model = gm, settings, model
        config = settings.config
        # the calibration, once per graph: every instance and variant reads it from here
        self.calibration = Calibration.load(config)
        if self.calibration.scales is not None and model is not None:
            check_scales_match(
                self.calibration.scales,
                [n for n, m in model.named_modules() if is_plain_linear(m) or isinstance(m, QuantizedLinear)],
            )
        self.layer_map = _layer_map(gm, model)
        # graph analyses, once per Dynamo graph, keyed by node name (stable across the graph's copies)
        # (a block compiled on its own holds no final projection: see holds_model_output)
        self.sensitive = (
            {n.name: why for n, why in find_sensitive_linears(gm, model_output=holds_model_output(gm)).items()}
            if config.linear_enabled
            else {}
        )
        self.variants = config.step_variants()
        self.artifacts: dict = {}
        self.tracing_context = current_tracing_context()
        # the graph's own fake inputs (no memory held): a later compile sees the shapes Dynamo traced,
        # so the compile caches key it as they key a compile made inside Dynamo
        self.fake_args = fake_inputs(self.tracing_context, example_inputs)
        self.passes = PassManager().pass_types
        self.placeholders = placeholder_index(gm)
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.own_instance = gm.meta.get(INSTANCE_KEY) or ""
        self.templates: dict = {}  # instance facts -> Template

    # -- deciding one instance ---------------------------------------------------------------------
    def facts_of(self, inputs: list, name: str, resolver: Resolver) -> Optional[tuple]:
        """What every pass's decisions read that can differ between instances (FXPass.instance_facts),
        for instance `name`, evaluated on its names without copying the graph; None when a pass cannot say."""
        if self.settings.dump_graphs:  # graph dumps are per instance
            return None
        fc = FactsContext(
            config=self.settings.config,
            layer_map=self.layer_map,
            calibration=self.calibration,
            sensitive=self.sensitive,
            gm=self.gm,
            example_inputs=inputs,
            placeholders=self.placeholders,
            resolver=resolver,
        )
        facts = []
        try:
            for node in self.gm.graph.nodes:
                if node.op != "call_function":
                    continue
                module = instance_module_name(node, self.own_instance, name)
                for pass_type in self.passes:
                    f = pass_type.instance_facts(fc, node, module)
                    if f is not None:
                        facts.append((node.name, pass_type.name, f))
        except NotReusable:
            return None
        return tuple(facts)

    def _report(self, variant, **kw) -> CompileReport:
        s = self.settings
        return CompileReport(
            backend=s.backend, lowering=s.lowering, downstream=s.downstream, step_variant=variant, **kw
        )

    def run_passes(self, inputs: list, name: str, warn: Callable[[str], None], resolver: Resolver) -> dict:
        """{variant: (report, rewritten graph, the passes' outputs)} for instance `name` (its weight
        states kept where `resolver` finds them: on the instance model's modules)."""
        out = {}
        for variant in self.variants:
            graph_copy = copy_graph(self.gm)
            rename_instance(graph_copy, self.own_instance, name)
            report = self._report(variant)
            passes_in, passes_out = compile_contexts(
                graph_copy,
                inputs,
                self.settings.config,
                get_lowering(self.settings.lowering),
                report,
                self.layer_map,
                warn,
                step_variant=variant,
                calibration=self.calibration,
                sensitive=self.sensitive,
                resolver=resolver,
                dump=self.settings.dump_graphs,
                weight_applier=functools.partial(self.apply_weight_action, inputs=inputs, name=name, resolver=resolver),
            )
            PassManager(self.passes).run(passes_in, passes_out)
            report.layer_map = self.layer_map.as_dict()
            if passes_out.dumps is not None:
                report.notes.append(f"{len(passes_out.dumps)} graph dumps attached")
                report.graphs = dict(passes_out.dumps)
            out[variant] = (report, graph_copy, passes_out)
        return out

    def reuse(self, template: Template, inputs: list, name: str, resolver: Resolver) -> dict:
        """run_passes' result for instance `name`, from an instance with equal facts: its rewritten
        graphs, its report rows renamed, its weight side effects redone on this instance's weights.
        NotReusable where a name cannot be carried over."""
        if not template.portable_warnings and template.name != name:
            raise NotReusable("the template instance's passes warned, naming its layers")
        renamed: dict = {}

        def rename(spelling: str) -> str:  # the template's name of a resolved module -> this instance's
            if spelling not in renamed:
                if spelling not in template.nodes_of:
                    raise NotReusable(f"module {spelling!r} names no node of the graph")
                renamed[spelling] = instance_module_name(
                    self.nodes[template.nodes_of[spelling]], self.own_instance, name
                )
            return renamed[spelling]

        out = {}
        for variant, (t_report, graph, t_out) in template.variants.items():
            report = self._report(
                variant, layer_map=dict(t_report.layer_map), weights=dict(t_report.weights), notes=list(t_report.notes)
            )
            for e in t_report.entries:
                module = rename(e.module) if e.name_resolved else e.module
                report.entries.append(dataclasses.replace(e, module=module, layer=self.layer_map.layer_of(module)))
            for action in t_out.weight_actions:  # the template's side effects, on this instance's weights
                self.apply_weight_action(action, inputs, name, resolver)
            out[variant] = (
                report,
                graph,
                CompileOutputs(
                    report=report,
                    feeds=t_out.feeds,
                    weight_actions=list(t_out.weight_actions),
                    unmatched_ignored_layers=list(t_out.unmatched_ignored_layers),
                ),
            )
        return out

    def apply_weight_action(self, action, inputs: list, name: str, resolver: Resolver) -> dict:
        """One weight action a pass emitted (fx_fp8/quant/weight_actions.py), done to instance `name`'s
        weights: for the instance whose passes ran and for each that reuses its decisions alike."""
        return weight_actions.apply(
            action,
            inputs,
            lambda node: instance_module_name(self.nodes[node], self.own_instance, name),
            resolver,
            self.calibration,
        )

    def _decide(self, inputs: list, name: str, resolver: Resolver, record: ModelRecord) -> tuple[dict, list]:
        """(variants as run_passes gives them, warnings) for instance `name`: an earlier instance's
        decisions where the facts are equal, else the passes' (kept as a template)."""
        facts = self.facts_of(inputs, name, resolver)
        template = self.templates.get(facts) if facts is not None else None
        planned = warned = None
        if template is not None:
            try:
                planned, warned = self.reuse(template, inputs, name, resolver), template.warnings
            except NotReusable:
                planned = None
        if planned is None or self.settings.check_reuse:
            messages: list[str] = []
            full = self.run_passes(inputs, name, messages.append, resolver)
            if planned is not None:
                check_reuse(planned, full, warned, messages, name)
            else:
                planned, warned = full, messages
                if facts is not None and facts not in self.templates:
                    candidate = Template.of(name, full, messages, self.gm)
                    if candidate is not None:
                        self.templates[facts] = candidate
                record.plans["passes"] += 1
                return planned, warned
        record.plans["reused"] += 1
        return planned, warned

    def plan(self, inputs: list, model_, owner_, rename: Optional[tuple] = None) -> Callable:
        """The callable for one instance (its names moved from this graph's instance by `rename`,
        its reports to owner_'s record): every step variant decided now, compiled on first use
        unless an instance that decided alike already compiled it."""
        record = ModelRecord.of(owner_)
        started = time.perf_counter()
        name = rename[1] if rename is not None else self.own_instance
        resolver = Resolver(model_)
        planned, warned = self._decide(inputs, name, resolver, record)
        for message in warned:
            record.warn(message)
        instance = InstancePlan(self, record, resolver, planned, time.perf_counter() - started)
        for report, _, passes_out in planned.values():
            _warn_about_selectors(
                self.layer_map, passes_out.unmatched_ignored_layers, self.settings.config, record, model_
            )
            record.add(report)
            RECENT.add(report)
        return instance.entry(inputs)

    # -- the callable Dynamo runs ------------------------------------------------------------------
    def entry(self, example_inputs, model, owner) -> Callable:
        first = self.plan(list(example_inputs), model, owner)
        if model is None:
            return first
        instance = self.gm.meta.get(INSTANCE_KEY) or ""
        anchors = find_anchors(example_inputs, model, instance)
        dispatch = InstanceDispatch(self.gm, instance, anchors, first, self.plan, [(model, owner)])
        if anchors:
            dispatch.remember(example_inputs, first, model, instance)
        dispatch.by_name[instance] = first  # without parameters: instances told apart on the stack
        return dispatch


class InstancePlan:
    """One instance's rewrite of the graph, per step variant, and the callables that run it."""

    def __init__(self, graph: GraphPlan, record: ModelRecord, resolver: Resolver, planned: dict, passes_s: float):
        self.graph, self.record, self.resolver, self.passes_s = graph, record, resolver, passes_s
        self.reports = {v: report for v, (report, _, _) in planned.items()}
        self.rewritten = {v: gm for v, (_, gm, _) in planned.items()}
        self.feeds = {v: passes_out.feeds for v, (_, _, passes_out) in planned.items()}
        # instances whose decisions and appended inputs are equal share one compiled artifact
        self.keys = {
            v: (v, tuple((e.node, e.action, e.reason) for e in report.entries), self.feeds[v].signature)
            for v, report in self.reports.items()
        }

    def compile_variant(self, variant, inputs) -> Callable:
        g, key = self.graph, self.keys[variant]
        if key not in g.artifacts:
            # a variant or instance compiled on its first call runs outside Dynamo: Dynamo's tracing
            # context (fake mode, shape env) lets Inductor's caches take it; they need a fake value on
            # every node the passes inserted (only for a graph that is compiled)
            fill_example_values(self.rewritten[variant].graph)
            examples = (list(inputs) if g.fake_args is None else list(g.fake_args)) + self.feeds[
                variant
            ].example_inputs(fake=g.fake_args is not None)
            s = g.settings
            with (
                compiling_under(g.tracing_context),
                compile_log.compiling(
                    self.reports[variant],
                    self.rewritten[variant],
                    downstream=s.downstream,
                    passes_s=self.passes_s,
                    record=self.record,
                ),
            ):
                g.artifacts[key] = downstream.compile_downstream(
                    s.downstream, self.rewritten[variant], examples, s.mode, s.inductor_options
                )
        return self.fed(variant, g.artifacts[key], inputs)

    def fed(self, variant, artifact, inputs) -> Callable:
        """The artifact called with this instance's appended inputs (supplied once per call, outside it)."""
        feeder = self.feeds[variant].feeder(list(inputs), self.resolver)
        return artifact if feeder is None else Fed(artifact, feeder)

    def entry(self, inputs) -> Callable:
        config = self.graph.settings.config
        if not config.has_step_skips:
            return self.compile_variant(None, inputs)
        ready = {
            v: (self.fed(v, self.graph.artifacts[k], inputs) if k in self.graph.artifacts else None)
            for v, k in self.keys.items()
        }
        return StepDispatch(ready, config, self.record, self.compile_variant)


def compile_graph_plan(
    gm: torch.fx.GraphModule, example_inputs, settings: Settings, *, model=None, owner=None
) -> Callable:
    """The callable Dynamo runs for `gm`; `model`/`owner` default to what the Python stack shows
    (fx_fp8.graph.dynamo_internals.find_compiled_model)."""
    model, owner = resolve_graph(gm, example_inputs, model=model, owner=owner)
    gm = kept_graph(gm)
    compile_log.first_seen(ModelRecord.of(owner))  # the first call's clock
    return GraphPlan(gm, example_inputs, settings, model, owner).entry(example_inputs, model, owner)


def _layer_map(gm: torch.fx.GraphModule, model) -> LayerMap:
    attention = [module_name(n) for n in gm.graph.nodes if is_attention(n)]
    if model is not None:
        return LayerMap.from_model(model, set(attention))
    return LayerMap.from_graph(attention, [module_name(n) for n in gm.graph.nodes])


def _warn_about_selectors(
    layer_map: LayerMap, unmatched_ignored_layers: list, config: FP8Config, record: ModelRecord, model=None
) -> None:
    n = layer_map.num_layers
    beyond = config.diffusion_kv_cache_skip_layers.at_least(n)
    if config.attention_enabled and beyond:
        record.warn(
            f"fx_fp8: diffusion_kv_cache_skip_layers names layers {beyond} but the model has {n} layers"
            + (f" (0-{n - 1})" if n else "")
        )
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
