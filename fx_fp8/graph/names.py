"""Module names and layer indices that belong to the model, not to the graph piece.

Dynamo spells a node's module in `nn_module_stack` relative to the frame it
traced: `L['self'].transformer_blocks[0].attn` for the whole model, but `attn`
for a block compiled alone after a graph break, `L['self'].forward.__self__.proj_out`
under a diffusers hook, `L['module']...` inside a cache hook. Patterns and
layer selectors must see the model's own `named_modules()` names, so each node
is resolved against the model being compiled:

1. the model: the `_orig_mod` of the `torch.compile`d module whose call is on
   the Python stack, else the outermost nn.Module whose method is on the stack
   and owns the graph's parameters;
2. a node that reads a parameter (a linear's weight) is named after the
   parameter's owner, found by identity;
3. any other node (attention) is named by walking its nn_module_stack source
   from the traced frame's real local variables to the module object, then
   looking that object up in the model by identity;
4. an attention node still unnamed (hooks that call a module's forward
   directly leave no nn_module_stack) is named after the module that owns
   the projections producing its query, key and value (their common parent).

What cannot be resolved keeps Dynamo's spelling and is marked unresolved; the
passes report it and never apply a layer selector to it silently.
"""

from __future__ import annotations

import re
import weakref
from typing import Optional

import torch
import torch.fx
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import find_compiled_model, split_source, traced_frame_variables
from fx_fp8.graph.forms import is_attention
from fx_fp8.graph.owners import OWNERS, owner_in

_BLOCK = re.compile(r"^(.*?\b[A-Za-z_][\w]*)\.(\d+)(?:\.|$)")

#: node.meta keys the backend writes once per compile (the passes read them)
NAME_KEY = "fx_fp8_module"
RESOLVED_KEY = "fx_fp8_module_resolved"
#: gm.meta key: a weak reference to the model the names were resolved against
MODEL_KEY = "fx_fp8_model"
#: gm.meta key: the model's name of the module instance whose frame was traced ("" = the model itself)
INSTANCE_KEY = "fx_fp8_instance"


def normalize_module_path(source: str) -> str:
    """Dynamo's source spelling -> a dotted path relative to the traced frame."""
    return split_source(source)[1]


def stack_module_path(node: torch.fx.Node) -> Optional[str]:
    """The innermost nn_module_stack source of a node, as Dynamo spells it (None at the frame's top level)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]


def module_name(node: torch.fx.Node) -> str:
    """The node's module name: the resolved one when the backend resolved it, else Dynamo's relative spelling."""
    if NAME_KEY in node.meta:
        return node.meta[NAME_KEY]
    path = stack_module_path(node)
    return normalize_module_path(path) if path else ""


def is_resolved(node: torch.fx.Node) -> bool:
    return bool(node.meta.get(RESOLVED_KEY, False))


def block_key(name: str) -> Optional[tuple[str, int]]:
    """('transformer_blocks', 3) for 'transformer_blocks.3.attn.to_q'; None outside repeated blocks."""
    m = _BLOCK.match(name)
    if not m:
        return None
    return m.group(1), int(m.group(2))


# -- finding the model ------------------------------------------------------------------------
def _walk(obj, path: str):
    """Follow a dotted path of attributes / indices from obj; None where it breaks."""
    for part in path.split(".") if path else ():
        if isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)) and part.isdigit():
            try:
                obj = obj[int(part)]
            except IndexError:
                return None
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class ModelNames:
    """Resolves graph nodes to the compiled model's `named_modules()` names."""

    def __init__(self, model: Optional[nn.Module], frame_vars: dict, caller: Optional[nn.Module] = None):
        self.model = model
        self.frame_vars = frame_vars
        self.caller = caller
        self.module_name_of: dict[int, str] = module_names_of(model) if model is not None else {}
        # the model's tensors as they are now (a graph's activations are not looked up again on a miss)
        self.holders: dict[int, tuple] = OWNERS.fresh(model) if model is not None else {}

    def instance(self) -> Optional[str]:
        """The model's name of the module instance the traced frame belongs to: the frame's
        `self`, else the module whose call led to the frame; None if neither is in the model."""
        for root in (self.frame_vars.get("L:self"), self.caller):
            name = self.module_name_of.get(id(root)) if root is not None else None
            if name is not None:
                return name
        return None

    def of_tensor(self, t) -> Optional[str]:
        """Name of the module owning parameter/buffer `t`, or None."""
        if not isinstance(t, torch.Tensor):
            return None
        owner = owner_in(self.holders, t)
        return owner[2] if owner is not None else None

    def of_stack(self, node: torch.fx.Node) -> tuple[str, bool]:
        """(name, resolved) of the innermost module in a node's nn_module_stack."""
        path = stack_module_path(node)
        if path is None:
            # top level of the traced frame: the frame's `self` if it is a module of the model,
            # else the module whose call led here (a hook's forward, installed on that module)
            name = self.instance()
            return (name, True) if name is not None else ("", False)
        local, rel = split_source(path)
        if self.model is not None and local is not None and local in self.frame_vars:
            obj = _walk(self.frame_vars[local], rel)
            name = self.module_name_of.get(id(obj)) if obj is not None else None
            if name is not None:
                return name, True
        return rel, False


def resolve_names(
    gm: torch.fx.GraphModule,
    example_inputs,
    model: Optional[nn.Module],
    frame_vars: dict,
    caller: Optional[nn.Module] = None,
) -> None:
    """Write each call node's module name (and whether it is the model's real name) into its
    meta, and the model into gm.meta (weakly), so a stored graph keeps both."""
    names = ModelNames(model, frame_vars, caller)
    gm.meta[MODEL_KEY] = weakref.ref(model) if model is not None else None
    gm.meta[INSTANCE_KEY] = names.instance()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = {n: example_inputs[i] for i, n in enumerate(placeholders) if i < len(example_inputs)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        # a call whose weight operand is a parameter (linear, prepared linear) belongs to that parameter's module
        weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        owner = names.of_tensor(real.get(weight)) if isinstance(weight, torch.fx.Node) else None
        if owner is not None:
            node.meta[NAME_KEY], node.meta[RESOLVED_KEY] = owner, True
        else:
            node.meta[NAME_KEY], node.meta[RESOLVED_KEY] = names.of_stack(node)
    for node in gm.graph.nodes:
        if is_attention(node) and not node.meta[RESOLVED_KEY]:
            owner = _owner_of_producers(node)
            if owner is not None:
                node.meta[NAME_KEY], node.meta[RESOLVED_KEY] = owner, True


def _owner_of_producers(node: torch.fx.Node, depth: int = 24) -> Optional[str]:
    """The common parent module of the resolved parameter-reading calls (q/k/v projections)
    found walking back from an attention node's query, key and value, or None."""
    owners, seen = [], set()
    frontier = list(node.all_input_nodes[:3])
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if n.meta.get(RESOLVED_KEY) and n.meta.get(NAME_KEY) and _reads_parameter(n):
                owners.append(n.meta[NAME_KEY])
            else:
                nxt.extend(n.all_input_nodes)
        frontier = nxt
    if not owners:
        return None
    parts = [o.split(".") for o in owners]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(common) == len(parts[0]) and len(set(owners)) == 1:  # one fused projection (to_qkv): its parent
        common = common[:-1]
    return ".".join(common) or None


def _reads_parameter(node: torch.fx.Node) -> bool:
    weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
    return isinstance(weight, torch.fx.Node) and weight.op == "placeholder"


def resolve_graph(gm: torch.fx.GraphModule, example_inputs, *, model=None, owner=None):
    """Resolve names once per graph (a stored graph keeps them): call it while Dynamo compiles
    the graph, from a backend. Returns (model, owner) as find_compiled_model finds them."""
    if MODEL_KEY in gm.meta:
        ref = gm.meta[MODEL_KEY]
        return (ref() if ref is not None else None), owner
    param_ids = {id(t) for t in example_inputs if isinstance(t, nn.Parameter)}
    found_model, found_owner, caller = find_compiled_model(param_ids)
    model = model if model is not None else found_model
    owner = owner if owner is not None else found_owner
    resolve_names(gm, example_inputs, model, traced_frame_variables(), caller)
    return model, owner


def rename_name(name: str, old: str, new: str) -> str:
    """A resolved module name of instance `old`'s graph, as instance `new` spells it (names
    outside `old` stay as they are)."""
    if old == new:
        return name
    if old == "":
        return f"{new}.{name}" if name else new
    if name == old or name.startswith(old + "."):
        return new + name[len(old) :]
    return name


def instance_module_name(node: torch.fx.Node, old: str, new: str) -> str:
    """module_name(node) after rename_instance(gm, old, new), without copying the graph."""
    name = node.meta.get(NAME_KEY)
    if name is None or not node.meta.get(RESOLVED_KEY):
        return module_name(node)
    return rename_name(name, old, new)


def rename_instance(gm: torch.fx.GraphModule, old: str, new: str) -> None:
    """Move the resolved names of gm's nodes from module instance `old` to `new` (another
    instance of the same class, which Dynamo may run the same graph for)."""
    if old == new:  # the same place in another model of the same class
        return
    for node in gm.graph.nodes:
        name = node.meta.get(NAME_KEY)
        if name is not None and node.meta.get(RESOLVED_KEY):
            node.meta[NAME_KEY] = rename_name(name, old, new)
    gm.meta[INSTANCE_KEY] = new


def module_names_of(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in reversed(list(model.named_modules(remove_duplicate=False)))}


def instance_holding(param: torch.Tensor, anchor: str, models: list) -> Optional[tuple]:
    """(model, owner, instance name) for a parameter the compiled graph is called with: the
    module holding it is `<instance>.<anchor>` in one of `models` ((model, owner) pairs already
    known), else in the model found on the Python stack (a model of the same class seen for
    the first time). None when no model holds it. Runs once per new instance, not per call."""
    for model, owner in models:
        found = _instance_of(OWNERS.name(model, param), anchor)
        if found is not None:
            return model, owner, found
    model, owner, _ = find_compiled_model({id(param)})
    if model is not None and all(model is not m for m, _ in models):
        found = _instance_of(OWNERS.name(model, param), anchor)
        if found is not None:
            return model, owner, found
    return None


def _instance_of(holder: Optional[str], anchor: str) -> Optional[str]:
    """The instance name whose `anchor` submodule is `holder`, or None."""
    if holder is None:
        return None
    if holder == anchor:
        return ""
    if not anchor:
        return holder
    if holder.endswith("." + anchor):
        return holder[: -len(anchor) - 1]
    return None


# -- layer indices ------------------------------------------------------------------------------
class LayerMap:
    """Layer index of each transformer block, in order across the model's block lists.

    A block list is a repeated module list (`name.N`) whose blocks hold
    attention. Blocks keep their index within a list and lists are numbered one
    after the other in the model's definition order (which is also their
    execution order in the diffusers families: Flux double blocks 0..N-1, then
    single blocks N..), so one selector never names two blocks, and a graph
    piece (a block compiled alone after a graph break or under a hook) numbers
    its blocks as the whole model does. Without the model, the lists come from
    this graph's attention nodes, in order of appearance.
    """

    def __init__(self, sizes: dict[str, int]):
        self.offsets: dict[str, int] = {}
        total = 0
        for list_name, size in sizes.items():
            self.offsets[list_name] = total
            total += size
        self.num_layers = total

    @classmethod
    def from_model(cls, model: nn.Module, attention_modules: set[str]) -> "LayerMap":
        sizes: dict[str, int] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
                blocks = [f"{name}.{i}" for i in range(len(mod))]
                inside = tuple(b + "." for b in blocks)  # an attention node may be named after the block itself
                if any(_holds_attention(b) for b in mod) or any(
                    a in blocks or a.startswith(inside) for a in attention_modules
                ):
                    if not any(name.startswith(other + ".") for other in sizes):  # nested lists: the outer one counts
                        sizes[name] = len(mod)
        return cls(sizes)

    @classmethod
    def from_graph(cls, attention_names: list[str], all_names: list[str]) -> "LayerMap":
        lists = {key[0] for n in attention_names for key in [block_key(n)] if key}
        sizes: dict[str, int] = {}
        for name in all_names:
            key = block_key(name)
            if key and key[0] in lists:
                sizes[key[0]] = max(sizes.get(key[0], 0), key[1] + 1)
        return cls(sizes)

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


def _holds_attention(block: nn.Module) -> bool:
    """Does a block contain an attention module (diffusers' Attention classes, or anything named so)?"""
    return any(
        type(m).__name__.endswith(("Attention", "AttentionModule")) or hasattr(m, "processor") for m in block.modules()
    )
