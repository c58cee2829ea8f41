"""Runs the passes in a fixed order, checks the graph after each, dumps graphs."""
from __future__ import annotations

import logging

import torch
import torch.fx
from torch._dynamo.utils import lazy_format_graph_code

from fx_fp8.passes.base import CompileContext, FXPass

log = logging.getLogger("fx_fp8.passes")


def default_passes() -> list[type[FXPass]]:
    from fx_fp8.passes.attention import FP8AttentionPass
    from fx_fp8.passes.linear import FP8LinearPass

    return [FP8AttentionPass, FP8LinearPass]


class PassManager:
    def __init__(self, passes: list[type[FXPass]] | None = None):
        self.pass_types = passes if passes is not None else default_passes()
        self.counts: dict[str, int] = {}

    def _dump(self, ctx: CompileContext, stage: str) -> None:
        title = f"fx_fp8 {stage} (variant={ctx.step_variant or 'single'})"
        # Through Dynamo's lazy formatter so TORCH_LOGS / graph_code logging sees it too.
        log.debug("%s", lazy_format_graph_code(title, ctx.gm, colored=False))
        if ctx.dumps is not None:
            ctx.dumps.append((stage, ctx.gm.print_readable(print_output=False)))

    def run(self, ctx: CompileContext) -> torch.fx.GraphModule:
        gm = ctx.gm
        self._dump(ctx, "before")
        for pass_type in self.pass_types:
            p = pass_type(ctx)
            if not p.enabled():
                self.counts[p.name] = 0
                continue
            changed = p.run(gm)
            self.counts[p.name] = changed
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
            self._dump(ctx, f"after_{p.name}")
            log.info("fx_fp8 pass %s changed %d nodes", p.name, changed)
        return gm
