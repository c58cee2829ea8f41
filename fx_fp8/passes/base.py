"""What every pass shares: what it reads (CompileInputs, frozen; FactsContext for instance facts),
what it writes (CompileOutputs), and the pass interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
import torch.fx

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.dynamo_internals import fake_mode_of
from fx_fp8.graph.fx_utils import placeholder_index
from fx_fp8.graph.names import LayerMap, is_resolved, module_name
from fx_fp8.ops.lowering import Lowering
from fx_fp8.quant import weight_actions
from fx_fp8.quant.linear_plan import Calibration
from fx_fp8.quant.weight_feeds import FeedPlan, Resolver
from fx_fp8.report import CompileReport

#: node.meta key: where a prepared linear's quantized weight came from ("BFL fp8r checkpoint (per-channel
#: weight scales)", ...), set by the pre-quantized pass (fx_fp8/passes/prequantized.py) for the linear pass's report
WEIGHT_ORIGIN = "fx_fp8_weight_origin"


@dataclass(frozen=True, kw_only=True)
class FactsContext:
    """What a pass reads about one instance of one graph, step variant aside (FXPass.instance_facts
    reads this much; the passes read CompileInputs, which adds the variant and the lowering)."""

    config: FP8Config
    layer_map: LayerMap
    calibration: Calibration  # loaded once per graph (GraphPlan)
    sensitive: Mapping[str, str]  # {node name: structural reason}, one per graph
    gm: torch.fx.GraphModule  # the graph (CompileInputs: the copy the passes rewrite)
    example_inputs: list
    placeholders: dict  # placeholder node -> its input slot
    resolver: Resolver  # the instance's model: which module holds a weight


@dataclass(frozen=True, kw_only=True)
class CompileInputs(FactsContext):
    """Everything the passes read for one instance and step variant; none of it is written."""

    lowering: Lowering
    warn: Callable[[str], None]  # a warning, once per compiled model
    step_variant: Optional[str] = None
    dump: bool = False  # keep the graph's code after each pass (CompileOutputs.dumps)
    weight_applier: Callable = None  # applies one weight action to this instance's weights


@dataclass
class CompileOutputs:
    """Everything the passes write for one instance and step variant, besides the graph itself."""

    report: CompileReport
    feeds: FeedPlan  # the inputs the passes append (fx_fp8/quant/weight_feeds.py)
    # what the passes did to the instance's own weights (fx_fp8/quant/weight_actions.py), in order:
    # redone for another instance that reuses these decisions (see FXPass.instance_facts)
    weight_actions: list = field(default_factory=list)
    unmatched_ignored_layers: list = field(default_factory=list)
    sensitive: dict = field(
        default_factory=dict
    )  # {node name: reason} of the nodes a pass put in a sensitive one's place
    dumps: Optional[list] = None  # [(stage, python code)] when a dump was asked for


def compile_contexts(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    config: FP8Config,
    lowering: Lowering,
    report: CompileReport,
    layer_map: LayerMap,
    warn: Callable[[str], None],
    *,
    step_variant: Optional[str] = None,
    calibration: Optional[Calibration] = None,
    sensitive: Optional[Mapping[str, str]] = None,
    placeholders: Optional[dict] = None,
    resolver: Optional[Resolver] = None,
    dump: bool = False,
    weight_applier: Optional[Callable] = None,
    feeds: Optional[FeedPlan] = None,
) -> tuple[CompileInputs, CompileOutputs]:
    """(inputs, outputs) of the passes on `gm`. Defaults: no calibration, no sensitive layers, no model
    (weights resolved on no module), weight actions applied to `example_inputs` (GraphPlan gives its own)."""
    placeholders = placeholder_index(gm) if placeholders is None else placeholders
    resolver = Resolver(None) if resolver is None else resolver
    calibration = Calibration() if calibration is None else calibration
    if weight_applier is None:
        nodes = {n.name: n for n in gm.graph.nodes}
        weight_applier = lambda action: weight_actions.apply(  # noqa: E731
            action, example_inputs, lambda node: module_name(nodes[node]), resolver, calibration
        )
    inputs = CompileInputs(
        config=config,
        layer_map=layer_map,
        calibration=calibration,
        sensitive=MappingProxyType(dict(sensitive or {})),
        gm=gm,
        example_inputs=example_inputs,
        placeholders=placeholders,
        resolver=resolver,
        lowering=lowering,
        warn=warn,
        step_variant=step_variant,
        dump=dump,
        weight_applier=weight_applier,
    )
    outputs = CompileOutputs(
        report=report,
        feeds=feeds if feeds is not None else FeedPlan(gm.graph, fake_mode_of(gm.graph)),
        dumps=[] if dump else None,
    )
    return inputs, outputs


class NotReusable(Exception):
    """An instance's decisions cannot be shown equal to another's without running the passes."""


class FXPass:
    """A graph rewrite. Subclasses set `name` and implement `run`, returning how
    many nodes they rewrote; every candidate gets a report entry. A pass removes
    only nodes it replaced, through `erase` (the manager checks it)."""

    name = "pass"

    def __init__(self, inputs: CompileInputs, out: CompileOutputs):
        self.inputs, self.out = inputs, out
        self.erased: set[str] = set()

    def run(self, gm: torch.fx.GraphModule) -> int:
        raise NotImplementedError

    @classmethod
    def instance_facts(cls, fc: FactsContext, node: torch.fx.Node, module: str):
        """Everything this pass's decision and report row for `node` read that can differ
        between the instances one graph runs for, `module` being the node's name in this
        instance (names and layer indices themselves excluded: the report is renamed). Two
        instances whose facts are equal for every node get the same decisions, so the backend
        reuses one's rewritten graph and renamed report for the other instead of running the
        passes. None: the node is not one this pass decides. Raise NotReusable when unsure
        (a pass that does not say runs for every instance)."""
        raise NotReusable(f"pass {cls.name!r} declares no instance facts")

    def erase(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        self.erased.add(node.name)
        gm.graph.erase_node(node)

    def record(
        self, node: torch.fx.Node, *, op: str, module: str, action: str, reason: str, shapes: str = "", **extra
    ) -> None:
        self.out.report.add(
            op=op,
            module=module,
            layer=self.inputs.layer_map.layer_of(module),
            action=action,
            reason=reason,
            shapes=shapes,
            node=node.name,
            name_resolved=is_resolved(node),
            **extra,
        )

    def sensitive_of(self, node: torch.fx.Node) -> Optional[str]:
        """The structural reason `node` is a sensitive linear (graph/sensitive.py), also for a node an
        earlier pass put in a sensitive one's place; None when it is not one."""
        return self.out.sensitive.get(node.name, self.inputs.sensitive.get(node.name))

    def apply_weight(self, action) -> dict:
        """A side effect on the instance's weights (fx_fp8/quant/weight_actions.py): kept in the
        outputs (for instances that reuse these decisions) and applied by whoever planned the compile."""
        self.out.weight_actions.append(action)
        return self.inputs.weight_applier(action)
