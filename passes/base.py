"""What every pass shares: the compile context and the pass interface."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.config import FP8Config
from fx_fp8.ops.lowering import Lowering
from fx_fp8.graph.fx_utils import placeholder_index
from fx_fp8.graph.names import LayerMap, is_resolved
from fx_fp8.report import CompileReport


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
    static_scales: Optional[dict] = None      # calibrated activation scales by module name (static scheme)
    analysis: dict = field(default_factory=dict)   # results of graph analyses, e.g. {"sensitive": {node: reason}}
    dumps: Optional[list] = None              # [(stage, python code)] when a dump was asked for
    placeholders: dict = None
    unmatched_ignored_layers: list = field(default_factory=list)

    def __post_init__(self):
        if self.placeholders is None:
            self.placeholders = placeholder_index(self.gm)


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

    def erase(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        self.erased.add(node.name)
        gm.graph.erase_node(node)

    def record(self, node: torch.fx.Node, *, op: str, module: str, action: str, reason: str, shapes: str = "",
               **extra) -> None:
        self.ctx.report.add(op=op, module=module, layer=self.ctx.layer_map.layer_of(module), action=action,
                            reason=reason, shapes=shapes, node=node.name, name_resolved=is_resolved(node), **extra)
