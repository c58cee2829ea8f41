"""Small FX helpers: node arguments by name, fake values, real tensors, eager functions as graph nodes."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.fx


def call_args(node: torch.fx.Node, names: list[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """Positional + keyword arguments of a call node, by parameter name."""
    out = dict(defaults)
    for name, value in zip(names, node.args):
        out[name] = value
    out.update(node.kwargs)
    return out


def meta_val(arg) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo recorded for a node argument (None for non-nodes)."""
    if isinstance(arg, torch.fx.Node):
        val = arg.meta.get("val", arg.meta.get("example_value"))
        return val if isinstance(val, torch.Tensor) else None
    return None


def placeholder_index(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}


def real_tensor(node_arg, gm: torch.fx.GraphModule, example_inputs, placeholders) -> Optional[torch.Tensor]:
    """The real tensor behind a placeholder or get_attr node, else None."""
    if not isinstance(node_arg, torch.fx.Node):
        return None
    if node_arg.op == "placeholder":
        i = placeholders.get(node_arg)
        if i is not None and i < len(example_inputs) and isinstance(example_inputs[i], torch.Tensor):
            return example_inputs[i]
        return None
    if node_arg.op == "get_attr":
        obj = gm
        for part in str(node_arg.target).split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


@functools.lru_cache(maxsize=None)
def _traced(fn: Callable, n_args: int) -> torch.fx.Graph:
    return torch.fx.symbolic_trace(fn).graph


def insert_function(graph: torch.fx.Graph, fn: Callable, args: tuple, meta: dict) -> Any:
    """Insert the torch ops of the plain eager function `fn(*args)` at the graph's insert point.

    `fn` takes node arguments only (bind constants with a module-level function or
    functools.partial of hashable values) and is traced once with torch.fx. The new
    nodes are ordinary torch calls, so the downstream compiler sees (and fuses) them;
    they copy `meta`'s nn_module_stack so they stay attributed to their module.
    Returns the node, or the tuple of nodes, that `fn` returns.
    """
    sub = _traced(fn, len(args))
    placeholders = [n for n in sub.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise TypeError(f"{fn} takes {len(placeholders)} node arguments, got {len(args)}")
    env = dict(zip(placeholders, args))
    out = None
    for n in sub.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out = torch.fx.map_arg(n.args[0], lambda a: env[a])
            break
        new = graph.node_copy(n, lambda a: env[a])
        for key in ("nn_module_stack", "fx_fp8_module", "fx_fp8_module_resolved", "stack_trace"):
            if key in meta:
                new.meta[key] = meta[key]
        env[n] = new
    return out


def fill_example_values(graph: torch.fx.Graph) -> int:
    """Give every call node the passes inserted an `example_value` (the fake value Dynamo
    records for each node), computed from its inputs' under the graph's fake mode: AOTAutograd's
    cache refuses a graph with a method call on a node that has none. Returns how many were set."""
    from fx_fp8.graph.dynamo_internals import fake_mode_of

    fake_mode = fake_mode_of(graph)
    if fake_mode is None:
        return 0
    filled = 0
    with fake_mode:
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method") or "example_value" in node.meta:
                continue
            missing = []

            def value(a):
                if "example_value" not in a.meta:
                    missing.append(a)
                return a.meta.get("example_value")

            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), value)
            if missing:
                continue
            if node.op == "call_method":
                result = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                result = node.target(*args, **kwargs)
            node.meta["example_value"] = result
            filled += 1
    return filled
