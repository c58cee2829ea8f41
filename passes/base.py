"""What every pass shares: the compile context and the pass interface."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx

from fx_fp8.config import FP8Config
from fx_fp8.ops.lowering import Lowering
from fx_fp8.passes.fx_utils import LayerMap, placeholder_index
from fx_fp8.report import CompileReport


@dataclass
class CompileContext:
    """Per-compile state handed to each pass (passes keep only their config slice)."""

    gm: torch.fx.GraphModule
    example_inputs: list
    config: FP8Config
    lowering: Lowering
    report: CompileReport
    step_variant: Optional[str] = None
    layer_map: LayerMap = None
    placeholders: dict = None
    dumps: Optional[list] = None        # [(stage, python code)] when a dump was asked for
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_map is None:
            self.layer_map = LayerMap(self.gm.graph)
        if self.placeholders is None:
            self.placeholders = placeholder_index(self.gm)


class FXPass:
    """A graph rewrite. Subclasses set `name` and implement `run`, returning how
    many nodes they changed; every candidate gets a report entry."""

    name = "pass"

    def __init__(self, ctx: CompileContext):
        self.ctx = ctx

    def enabled(self) -> bool:
        return True

    def run(self, gm: torch.fx.GraphModule) -> int:
        raise NotImplementedError

    def record(self, node: torch.fx.Node, *, op: str, module: str, action: str, reason: str, shapes: str = "") -> None:
        self.ctx.report.add(op=op, module=module, layer=self.ctx.layer_map.layer_of(module), action=action,
                            reason=reason, shapes=shapes, node=node.name)

