"""Runs the passes in a fixed order, checks the graph after each, dumps graphs.

The manager never runs a whole-graph clean-up (dead-code elimination would
delete Dynamo's in-place side effects and vmap level markers, whose results
are unused): after each pass it checks that the only nodes that disappeared
are the ones the pass said it replaced, lints the graph and recompiles it.
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch._dynamo.utils import lazy_format_graph_code

from fx_fp8.passes.attention import FP8AttentionPass
from fx_fp8.passes.base import CompileInputs, CompileOutputs, FXPass
from fx_fp8.passes.linear import FP8LinearPass
from fx_fp8.passes.prequantized import PrequantizedLinearPass

log = logging.getLogger("fx_fp8.passes")


def default_passes() -> list[type[FXPass]]:
    return [FP8AttentionPass, PrequantizedLinearPass, FP8LinearPass]


class PassManager:
    def __init__(self, passes: list[type[FXPass]] | None = None):
        self.pass_types = passes if passes is not None else default_passes()
        self.counts: dict[str, int] = {}

    def _dump(self, inputs: CompileInputs, out: CompileOutputs, stage: str) -> None:
        title = f"fx_fp8 {stage} (variant={inputs.step_variant or 'single'})"
        # Through Dynamo's lazy formatter so TORCH_LOGS / graph_code logging sees it too.
        log.debug("%s", lazy_format_graph_code(title, inputs.gm, colored=False))
        if out.dumps is not None:
            out.dumps.append((stage, inputs.gm.print_readable(print_output=False)))

    def run(self, inputs: CompileInputs, out: CompileOutputs) -> torch.fx.GraphModule:
        gm = inputs.gm
        self._dump(inputs, out, "before")
        for pass_type in self.pass_types:
            p = pass_type(inputs, out)
            before = {n.name for n in gm.graph.nodes}
            changed = p.run(gm)
            removed = before - {n.name for n in gm.graph.nodes}
            if not removed <= p.erased:
                raise AssertionError(
                    f"fx_fp8 pass {p.name} removed nodes it did not replace: {sorted(removed - p.erased)}"
                )
            self.counts[p.name] = changed
            if changed or p.erased:  # regenerating the code of a large graph is the passes' main cost
                gm.graph.lint()
                gm.recompile()
            self._dump(inputs, out, f"after_{p.name}")
            log.debug(
                "fx_fp8 pass %s rewrote %d nodes", p.name, changed
            )  # the INFO summary: fx_fp8/compile/compile_log.py
        return gm
