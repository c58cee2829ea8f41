"""Small FX helpers: module names from nn_module_stack, layer indices, node args."""
from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.fx

_ROOT = re.compile(r"^[LG]\[['\"][^'\"]*['\"]\]")
_DICT_MODULES = re.compile(r"\.__dict__\[['\"]_modules['\"]\]\[['\"]([^'\"]+)['\"]\]")
_MODULES = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
_ITEM_STR = re.compile(r"\[['\"]([^'\"]+)['\"]\]")
_ITEM_INT = re.compile(r"\[(\d+)\]")
_GETATTR = re.compile(r"getattr\((.*), ['\"]([^'\"]+)['\"]\)")
_BLOCK = re.compile(r"^(.*?\b[A-Za-z_][\w]*)\.(\d+)(?:\.|$)")


def normalize_module_path(source: str) -> str:
    """Dynamo's source spelling -> the name `model.named_modules()` uses.

    `L['self'].__dict__['_modules']['transformer_blocks'].0.attn` -> `transformer_blocks.0.attn`
    `L['s'].m.blocks.0.to_qkv` -> `m.blocks.0.to_qkv`
    """
    s = source
    while True:  # getattr(x, 'a') -> x.a, innermost first
        new = _GETATTR.sub(lambda m: f"{m.group(1)}.{m.group(2)}", s)
        if new == s:
            break
        s = new
    s = _ROOT.sub("", s)
    s = _DICT_MODULES.sub(r".\1", s)
    s = _MODULES.sub(r".\1", s)
    s = _ITEM_STR.sub(r".\1", s)
    s = _ITEM_INT.sub(r".\1", s)
    return s.strip(".")


def module_name(node: torch.fx.Node) -> str:
    """Fully qualified name of the innermost module that produced `node` ('' for the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_module_path(path)


def block_key(name: str) -> Optional[tuple[str, int]]:
    """('transformer_blocks', 3) for 'transformer_blocks.3.attn.to_q'; None outside repeated blocks."""
    m = _BLOCK.match(name)
    if not m:
        return None
    return m.group(1), int(m.group(2))


class LayerMap:
    """Layer index of each transformer block, in execution order across block lists.

    A block list is a repeated module list (`name.N`) that holds attention: the
    lists are found from the graph's SDPA nodes and ordered by where they first
    appear, and blocks keep their index within a list, so Flux gets double
    blocks 0..N-1, then single blocks N.., and one selector never names two
    blocks. Numbered modules without attention (e.g. `t_embedder.mlp.0`) are
    not layers.
    """

    def __init__(self, graph: torch.fx.Graph):
        from fx_fp8.passes.attention import is_sdpa

        attention_lists = {key[0] for n in graph.nodes if is_sdpa(n) for key in [block_key(module_name(n))] if key}
        sizes: dict[str, int] = {}
        for node in graph.nodes:
            key = block_key(module_name(node))
            if key and key[0] in attention_lists:
                sizes[key[0]] = max(sizes.get(key[0], 0), key[1] + 1)
        self.offsets: dict[str, int] = {}
        total = 0
        for list_name, size in sizes.items():  # dict keeps first-appearance order
            self.offsets[list_name] = total
            total += size
        self.num_layers = total

    def layer_of(self, name: str) -> Optional[int]:
        key = block_key(name)
        if key is None or key[0] not in self.offsets:
            return None
        return self.offsets[key[0]] + key[1]

    def as_dict(self) -> dict[str, str]:
        """{'transformer_blocks': '0-18', ...} for the report."""
        out, names = {}, list(self.offsets)
        for i, name in enumerate(names):
            end = self.offsets[names[i + 1]] if i + 1 < len(names) else self.num_layers
            out[name] = f"{self.offsets[name]}-{end - 1}"
        return out


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


def shape_str(*vals) -> str:
    return " ".join("x".join(str(int(d)) if isinstance(d, int) or hasattr(d, "__int__") else str(d) for d in v.shape)
                    if isinstance(v, torch.Tensor) else "-" for v in vals)


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
