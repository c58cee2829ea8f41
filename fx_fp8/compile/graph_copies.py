"""Copies of a Dynamo graph: the one the backend keeps, and one per rewrite (instance, step variant)."""

from __future__ import annotations

import torch
import torch.fx

from fx_fp8.graph.dynamo_internals import lazy_graph_module


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
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


def kept_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The copy of Dynamo's graph the backend keeps (other instances and step variants are planned
    from it after this call returns), without Dynamo's record of each placeholder's example input:
    that holds a weak reference to the user's tensor, and torch's swap-based conversion (FSDP2,
    DTensor, tensor subclasses) refuses to swap a parameter anything references weakly."""
    kept = copy_graph(gm)
    for node in kept.graph.find_nodes(op="placeholder"):
        node.meta.pop("grapharg", None)
    return kept
