"""Block instances that decide alike share one planned rewrite: an instance whose passes ran
is kept as a Template, and a later instance with equal facts (FXPass.instance_facts) reuses
its decisions instead of running the passes again.

fx_fp8.compile.graph_plan plans each instance; with the check_reuse setting on (backend option
`check_reuse`, default from FX_FP8_CHECK_REUSE) it also runs the passes for a reused instance and
check_reuse compares the two."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx

from fx_fp8.graph.names import INSTANCE_KEY, NAME_KEY, RESOLVED_KEY, instance_module_name


@dataclasses.dataclass
class Template:
    """An instance whose passes ran, kept for instances with equal facts to reuse."""

    name: str  # its instance name
    variants: dict  # variant -> (report, rewritten graph, the passes' outputs)
    warnings: list  # what its passes warned
    nodes_of: dict  # module name as it spells it -> the graph node it names
    portable_warnings: bool  # no warning names one of its modules: the same words for every instance

    @classmethod
    def of(cls, name: str, variants: dict, warnings: list, gm: torch.fx.GraphModule) -> Optional["Template"]:
        """None when its decisions cannot be carried to another instance: two nodes' modules
        spelled alike here but not elsewhere. (Its weight side effects are actions the graph plan
        redoes on each instance's weights: fx_fp8/quant/weight_actions.py.)"""
        nodes_of, originals = {}, {}
        for node in gm.graph.nodes:
            if node.op != "call_function" or not node.meta.get(RESOLVED_KEY) or NAME_KEY not in node.meta:
                continue
            spelling = instance_module_name(node, gm.meta.get(INSTANCE_KEY) or "", name)
            if originals.setdefault(spelling, node.meta[NAME_KEY]) != node.meta[NAME_KEY]:
                return None
            nodes_of.setdefault(spelling, node.name)
        portable = not any(spelling and spelling in message for message in warnings for spelling in nodes_of)
        return cls(name, variants, list(warnings), nodes_of, portable)


def check_reuse(reused: dict, full: dict, reused_warnings: list, warnings: list, name: str) -> None:
    """The check_reuse setting (compile.graph_plan.Settings): the reused decisions must be exactly what the passes decide."""
    problems = []
    if sorted(reused_warnings) != sorted(warnings):
        problems.append(f"warnings {reused_warnings} != {warnings}")
    for variant, (report, graph, ctx) in full.items():
        r_report, r_graph, r_ctx = reused[variant]
        if [e.to_dict() for e in r_report.entries] != [e.to_dict() for e in report.entries]:
            problems.append(
                f"variant {variant}: report rows differ: "
                f"{[e.to_dict() for e in r_report.entries if e not in report.entries][:2]}"
            )
        for attr in ("weights", "notes", "layer_map"):
            if getattr(r_report, attr) != getattr(report, attr):
                problems.append(f"variant {variant}: {attr} differ")
        if r_ctx.unmatched_ignored_layers != ctx.unmatched_ignored_layers:
            problems.append(f"variant {variant}: unmatched ignored_layers differ")
        shape = [[(n.op, str(n.target), n.name) for n in g.graph.nodes] for g in (r_graph, graph)]
        if shape[0] != shape[1]:
            problems.append(f"variant {variant}: rewritten graphs differ")
    if problems:
        raise AssertionError(f"fx_fp8: instance {name!r} reused decisions that differ from its passes': {problems}")
