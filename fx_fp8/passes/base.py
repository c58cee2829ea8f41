"""What every pass shares: the compile context and the pass interface."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

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


@dataclass
class CompileContext:
    """Per-compile state handed to each pass (passes keep only their config slice)."""

    gm: torch.fx.GraphModule
    example_inputs: list
    config: FP8Config
    lowering: Lowering
    report: CompileReport
    layer_map: LayerMap
    warn: Callable[[str], None]               # a warning, once per compiled model
    step_variant: Optional[str] = None
    calibration: Calibration = field(default_factory=Calibration)  # loaded once per graph (GraphPlan)
    analysis: dict = field(default_factory=dict)   # results of graph analyses, e.g. {"sensitive": {node: reason}}
    dumps: Optional[list] = None              # [(stage, python code)] when a dump was asked for
    placeholders: dict = None
    unmatched_ignored_layers: list = field(default_factory=list)
    # what the passes did to the instance's own weights (fx_fp8/quant/weight_actions.py), in order:
    # redone for another instance that reuses these decisions (see FXPass.instance_facts)
    weight_actions: list = field(default_factory=list)
    # where the weight states the passes fill live (the instance's model), and the inputs they append
    resolver: Optional[Resolver] = None
    feeds: Optional[FeedPlan] = None
    # applies one weight action to this instance's weights (GraphPlan's; default: these inputs)
    weight_applier: Optional[Callable] = None

    def __post_init__(self):
        if self.placeholders is None:
            self.placeholders = placeholder_index(self.gm)
        if self.resolver is None:
            self.resolver = Resolver(None)
        if self.feeds is None:
            self.feeds = FeedPlan(self.gm.graph, fake_mode_of(self.gm.graph))
        if self.weight_applier is None:
            nodes = {n.name: n for n in self.gm.graph.nodes}
            self.weight_applier = lambda action: weight_actions.apply(
                action, self.example_inputs, lambda node: module_name(nodes[node]), self.resolver, self.calibration)

    def apply_weight(self, action) -> dict:
        """A pass's side effect on the instance's weights: kept (for instances that reuse these
        decisions) and applied by whoever planned this compile."""
        self.weight_actions.append(action)
        return self.weight_applier(action)


class NotReusable(Exception):
    """An instance's decisions cannot be shown equal to another's without running the passes."""


@dataclass
class FactsContext:
    """What FXPass.instance_facts reads: the compile's settings and one instance's inputs."""

    config: FP8Config
    layer_map: LayerMap
    calibration: Calibration
    sensitive: dict                           # {node name: structural reason}, one per graph
    gm: torch.fx.GraphModule
    example_inputs: list
    placeholders: dict
    resolver: Optional[Resolver] = None       # the instance's model: which module holds a weight


class FXPass:
    """A graph rewrite. Subclasses set `name` and implement `run`, returning how
    many nodes they rewrote; every candidate gets a report entry. A pass removes
    only nodes it replaced, through `erase` (the manager checks it)."""

    name = "pass"

    def __init__(self, ctx: CompileContext):
        self.ctx = ctx
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

    def record(self, node: torch.fx.Node, *, op: str, module: str, action: str, reason: str, shapes: str = "",
               **extra) -> None:
        self.ctx.report.add(op=op, module=module, layer=self.ctx.layer_map.layer_of(module), action=action,
                            reason=reason, shapes=shapes, node=node.name, name_resolved=is_resolved(node), **extra)
