"""Sensitive linears found by the graph's structure (timestep conditioning, adaLN modulation,
final projection), for models nobody listed by name. See find_sensitive_linears.

The analysis reads only the traced graph's data flow and FakeTensor shapes (no module names), in
one forward and two backward sweeps over the nodes:

1. Graph inputs. The model's state (parameters, buffers, tensor attributes) carries no label.
   Every other tensor input is either
   *token stream* (it has a sequence dimension: the latents, the text tokens, position ids) or
   *conditioning* (it has none: the timestep / guidance (B,), a pooled text vector (B, C) or
   (B, 1, C)). The batch size B is the first dimension of the largest input of rank >= 3 (the
   latents); a graph piece without such an input (after a graph break) knows no batch, and then
   only 0-D / 1-D inputs count as conditioning.
2. Forward sweep. A value computed from any token-stream value is token stream while it keeps
   a sequence dimension (batch-first or sequence-first); reduced to (B, C) / (B, 1, C) (a pooled
   text vector, a selected global token) it becomes conditioning. A value computed from
   conditioning values only is conditioning. Size queries and dtype / device / shape references
   (`x.to(y)`, `zeros_like(y)`, `t.expand(x.shape[0])`) carry no data, so symbolic sizes never
   mix the two. In-place writes (`buf[:, :n] = x`, `x.add_(y)`) label the written tensor; a
   0-D / 1-D constant made in the graph (`torch.zeros(1)`, a zero timestep) is conditioning.
   The sweep also marks token-stream values that went through attention or met conditioning
   ("mixed": not raw inputs), and values computed from a linear's output.
3. Backward sweep over the conditioning values: does a value reach another linear without
   touching the token stream (it is inside the embedding MLP), and does it reach an elementwise
   op (mul / add / addcmul ...) with a token-stream value (shift, scale, gate)?
4. From the graph's output backwards through reshapes, permutes, slices, casts, concatenations
   (unpatchify), 1x1 post-convolutions with their residual, and masks: the first linear met that
   reads mixed token-stream values is the final projection. An input embedder in a graph piece
   (raw input -> linear -> output) is not. Only a graph that can hold the model's output is
   searched (holds_model_output): the model's own, or a direct child of the model Dynamo
   compiled on its own (the output layer when the model's forward breaks), never a block.

A linear whose input is conditioning is "adaLN modulation" when its output modulates the token
stream and reaches no further linear, else "timestep conditioning" (the embedders of the
timestep, guidance and pooled text, and the projections between them).

Anything unexpected leaves a node unlabelled: the analysis returns what it is sure of and never
raises.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterable

import torch
import torch.fx

from fx_fp8.graph.dynamo_internals import forward_on_private_code, isolated_compile_kwargs
from fx_fp8.graph.forms import LINEAR_TARGETS, PREPARED_TARGETS, is_attention
from fx_fp8.graph.names import INSTANCE_KEY, is_resolved, module_name, resolve_graph
from fx_fp8.graph.shapes import concrete, known_equal, known_one, token_count

TIMESTEP = "timestep conditioning"
MODULATION = "adaLN modulation"
FINAL = "final projection"
REASONS = (TIMESTEP, MODULATION, FINAL)

_TOKEN, _COND = 1, 2  # value labels (bit flags)
_CALLS = ("call_function", "call_method")


def _raw_name(target) -> str:
    if isinstance(target, str):
        return target
    overload = getattr(target, "_overloadpacket", None)  # aten.view.default -> view
    if overload is not None:
        return getattr(overload, "__name__", "") or ""
    return getattr(target, "__name__", "") or ""


def _name(target) -> str:
    """'view' for call_method 'view', torch.reshape / Tensor.reshape -> 'reshape', 'add_' -> 'add',
    operator.__mul__ -> 'mul'."""
    name = _raw_name(target)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name[:-1] if name.endswith("_") else name


def _inplace(target) -> bool:
    """x.add_(y), x.copy_(y), x[i] = y: the first argument is written."""
    name = _raw_name(target)
    if name in ("setitem", "__setitem__"):
        return True
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


#: only the first argument carries data (the rest name a dtype / device / shape by example)
_FIRST_ONLY = {"to", "type", "type_as", "expand_as", "view_as", "reshape_as", "broadcast_to", "expand"}
#: no argument carries data (shape / dtype / device by example)
_NO_DATA = {
    "size",
    "dim",
    "numel",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "stride",
    "get_device",
    "is_floating_point",
    "element_size",
    "arange",
}
#: a new tensor shaped like the first argument: it stands for the same kind of value (a zero timestep)
_LIKE = {
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "new_tensor",
}
#: factories of constants: a 0-D / 1-D one stands for a timestep (Helios embeds a zero timestep)
_FACTORY = {"zeros", "ones", "full", "tensor", "empty", "scalar_tensor", "as_tensor"}
#: elementwise ops that apply a modulation piece to the token stream
_ARITH = {
    "mul",
    "add",
    "sub",
    "div",
    "truediv",
    "addcmul",
    "addcdiv",
    "lerp",
    "where",
    "rsub",
    "iadd",
    "imul",
    "isub",
    "itruediv",
    "true_divide",
    "multiply",
    "subtract",
}
#: contractions that mix tokens with tokens (hand-written attention)
_CONTRACT = {"matmul", "bmm", "baddbmm", "einsum"}
#: reshapes and the like between the final projection and the output (unpatchify)
_PASSTHROUGH = {
    "view",
    "reshape",
    "permute",
    "transpose",
    "unflatten",
    "flatten",
    "squeeze",
    "unsqueeze",
    "contiguous",
    "clone",
    "to",
    "float",
    "half",
    "bfloat16",
    "double",
    "type",
    "type_as",
    "getitem",
    "narrow",
    "movedim",
    "moveaxis",
    "swapaxes",
    "swapdims",
    "pixel_shuffle",
    "pixel_unshuffle",
    "chunk",
    "split",
    "split_with_sizes",
    "unbind",
    "tensor_split",
    "einsum",
    "cat",
    "concat",
    "concatenate",
    "stack",
    "dropout",
    "t",
    "select",
    "slice",
    "alias",
    "detach",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
}
#: single-input steps of the output path (`_root` follows them)
_CHAIN = _PASSTHROUGH - {"cat", "concat", "concatenate", "stack", "einsum"}
#: elementwise ops on the output path: a mask multiply, a residual around a post-convolution
_OUTPUT_ARITH = {"mul", "add", "sub", "div", "truediv", "where", "masked_fill", "multiply"}


def _val(node) -> Any:
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val", node.meta.get("example_value"))
    return None


def _tensors(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _example_size(d) -> int:
    """A size's example value, without a guard (only to pick the largest input)."""
    c = concrete(d)
    if c is not None:
        return c
    try:
        hint = getattr(d.node, "hint", None)
        if hint is None:
            hint = getattr(d.node, "_hint", None)
        return int(hint) if hint is not None else 1
    except Exception:
        return 1


def _numel_hint(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= _example_size(d)
    return n


def _node_args(node) -> list:
    out: list = []
    torch.fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


class _Analysis:
    def __init__(self, gm: torch.fx.GraphModule, model_output: bool = True):
        self.model_output = model_output
        self.nodes = list(gm.graph.nodes)
        self.linears, self.prepared = LINEAR_TARGETS, PREPARED_TARGETS
        self.label: dict[torch.fx.Node, int] = {}
        self.mixed: set = set()  # token-stream values past attention or conditioning
        self.from_linear: set = set()  # values computed from some linear's output
        self.batch = None

    # -- shapes -------------------------------------------------------------------------------
    def has_seq(self, t: torch.Tensor) -> bool:
        """Does a tensor have a sequence dimension? (B, C) and (B, 1, C) do not; (B, S, C),
        (S, B, C), (B, C, H, W), (S, C) and flattened (B*S, C) do."""
        if t.dim() <= 1:
            return False
        rest = list(t.shape[:-1])  # all but the channels; one of them is the batch
        if self.batch is None:
            if len(rest) == 1:
                return True  # 2-D in a graph piece without batched inputs: cannot tell, tokens
        else:
            for i, d in enumerate(rest):  # batch-first and sequence-first alike
                if known_equal(d, self.batch):
                    del rest[i]
                    break
            else:
                return True
        return not all(known_one(d) for d in rest)

    def val_has_seq(self, val) -> bool:
        return any(self.has_seq(t) for t in _tensors(val))

    # -- linears ------------------------------------------------------------------------------
    def is_linear(self, node) -> bool:
        return node.op == "call_function" and (node.target in self.linears or node.target in self.prepared)

    @staticmethod
    def linear_input(node):
        if node.args:
            return node.args[0]
        return node.kwargs.get("input", node.kwargs.get("x"))

    # -- 1. inputs ----------------------------------------------------------------------------
    @staticmethod
    def _is_state(node, val) -> bool:
        """A parameter, buffer or tensor attribute of the model lifted into a graph input (model
        state carries no label: a frequency table is not a timestep)."""
        if isinstance(val, torch.nn.Parameter):
            return True
        if "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {}):  # Dynamo's mark of module state
            return True
        name = str(node.target)
        return "_parameters_" in name or "_buffers_" in name

    def label_inputs(self) -> None:
        acts = []
        for node in self.nodes:
            if node.op != "placeholder":
                continue
            val = _val(node)
            if isinstance(val, torch.Tensor) and not self._is_state(node, val):
                acts.append((node, val))
        batched = [val for _, val in acts if val.dim() >= 3]  # (B, S, C), (B, C, H, W), ...
        if batched:
            self.batch = max(batched, key=_numel_hint).shape[0]
        for node, val in acts:
            ids = val.dim() == 2 and not (val.is_floating_point() or val.is_complex()) and val.dtype != torch.bool
            # token ids, latents, text tokens; else timestep (0-D or (B,)), guidance, pooled vectors, (B, 1, C)
            self.label[node] = _TOKEN if ids or self.has_seq(val) else _COND

    # -- 2. forward sweep ---------------------------------------------------------------------
    def data_args(self, node) -> Iterable:
        if node.op == "call_module":
            return _node_args(node)
        name = _name(node.target)
        if name in _NO_DATA:
            return ()
        if name in _FIRST_ONLY or name in _LIKE:
            return (node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self")),)
        if self.is_linear(node):
            return (self.linear_input(node),)
        return _node_args(node)

    def _relabel(self, node, flags: int, val) -> None:
        if flags & _TOKEN:
            # pooled to (B, C) / (B, 1, C) or a selected token: conditioning. A flat (<= 1-D) value
            # of token data is a flattened buffer (the all_to_all of context parallelism), not a pool.
            flat = all(t.dim() <= 1 for t in _tensors(val))
            self.label[node] = _TOKEN if flat or self.val_has_seq(val) else _COND
        elif flags & _COND:
            self.label[node] = _COND

    def forward(self) -> None:
        for node in self.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            args = [a for a in self.data_args(node) if isinstance(a, torch.fx.Node)]
            if self.is_linear(node) or any(a in self.from_linear for a in args):
                self.from_linear.add(node)
            flags, tokens, mixed = 0, 0, False
            for a in args:
                flag = self.label.get(a, 0)
                flags |= flag
                if flag == _TOKEN:
                    tokens += 1
                    mixed = mixed or a in self.mixed
            if node.op != "call_module" and _inplace(node.target) and args:  # the written tensor now holds the data too
                target = node.args[0] if node.args else None
                if isinstance(target, torch.fx.Node) and target in args and isinstance(_val(target), torch.Tensor):
                    self._relabel(target, flags, _val(target))
                    if mixed or flags == _TOKEN | _COND:
                        self.mixed.add(target)
                    if node in self.from_linear:
                        self.from_linear.add(target)
            val = _val(node)
            if not _tensors(val):
                continue  # sizes, dtypes, Python values: carry nothing
            if (
                not args
                and isinstance(val, torch.Tensor)
                and val.dim() <= 1
                and node.op != "call_module"
                and _name(node.target) in _FACTORY
            ):
                flags = _COND
            self._relabel(node, flags, val)
            if self.label.get(node) == _TOKEN and (
                mixed
                or flags & _COND
                or is_attention(node)
                or (tokens > 1 and node.op != "call_module" and _name(node.target) in _CONTRACT)
            ):
                self.mixed.add(node)

    # -- 3. backward sweep over the conditioning values ---------------------------------------
    def is_arith(self, node) -> bool:
        return node.op in _CALLS and _name(node.target) in _ARITH

    def backward(self) -> tuple[dict, dict]:
        """For each conditioning value: does it reach a linear, and does it reach an elementwise
        op on the token stream, through conditioning values only?"""
        feeds_linear: dict = {}
        modulates: dict = {}
        for node in reversed(self.nodes):
            if self.label.get(node) != _COND:
                continue
            fl = mod = False
            for u in node.users:
                lu = self.label.get(u)
                if self.is_linear(u):
                    fl = fl or self.linear_input(u) is node
                elif lu == _TOKEN:
                    mod = mod or self.is_arith(u)
                elif lu == _COND:
                    fl = fl or feeds_linear.get(u, False)
                    mod = mod or modulates.get(u, False)
            feeds_linear[node], modulates[node] = fl, mod
        return feeds_linear, modulates

    # -- 4. the final projection --------------------------------------------------------------
    def _step_args(self, node) -> list:
        """The tensors an output-path step reads its data from."""
        name = _name(node.target)
        if name in ("to", "type", "type_as") or name.startswith("conv"):
            args = node.args[:1]
        else:
            args = _node_args(node)
        return [a for a in args if isinstance(a, torch.fx.Node) and isinstance(_val(a), (torch.Tensor, tuple, list))]

    def _root(self, node):
        """Follow single-input output-path steps back: conv(h) + h has one root, h."""
        for _ in range(64):
            if node.op not in _CALLS or _name(node.target) not in _CHAIN:
                return node
            args = [a for a in self._step_args(node) if a in self.from_linear]
            if len(args) != 1:
                return node
            node = args[0]
        return node

    def final_projections(self) -> list:
        out_nodes = [n for n in self.nodes if n.op == "output"]
        if not out_nodes:
            return []
        pending = _node_args(out_nodes[-1])
        seen, found = set(), []
        while pending:
            node = pending.pop()
            if node in seen:
                continue
            seen.add(node)
            if self.is_linear(node):
                x = self.linear_input(node)
                if self.label.get(x) == _TOKEN and x in self.mixed:  # not an input embedder
                    found.append(node)
                continue
            if node.op not in _CALLS:
                continue
            name = _name(node.target)
            args = self._step_args(node)
            if name in _PASSTHROUGH:
                if name == "einsum" and len(args) != 1:
                    continue  # a contraction of two tensors is not a reshape
                pending.extend(args)
            elif name in _OUTPUT_ARITH:
                # a mask (no linear behind it) is skipped; several computed operands must be one
                # value seen twice (a residual around a post-convolution), else this is the network
                computed = [a for a in args if a in self.from_linear]
                roots = {self._root(a) for a in computed}
                if len(roots) == 1:
                    pending.extend(roots)
        return found

    def run(self) -> dict:
        self.label_inputs()
        self.forward()
        feeds_linear, modulates = self.backward()
        out: dict = {}
        for node in self.nodes:
            if self.is_linear(node) and self.label.get(self.linear_input(node)) == _COND:
                modulation = modulates.get(node, False) and not feeds_linear.get(node, False)
                out[node] = MODULATION if modulation else TIMESTEP
        for node in self.final_projections() if self.model_output else ():
            out.setdefault(node, FINAL)
        return out


def holds_model_output(gm: torch.fx.GraphModule) -> bool:
    """Can this graph's output be the model's output, so that its last linear may be the final
    projection? The model's own graph: yes. A graph of one module compiled on its own (see
    fx_fp8/graph/names.py INSTANCE_KEY) is a piece Dynamo split off the model:
    - a block of a repeated stack or a module inside one (`blocks.3`, `blocks.3.attn`,
      `head.proj`: its path holds a dot or is an index): no (regional compilation, hooks);
    - a direct child of the model (`head`, `final_layer`): yes. Dynamo compiles one on its own
      when the model's forward breaks around it (WanAnimate2's forward breaks in every block
      and runs eagerly around its children), and the model's output layer is such a child.
      The other direct children are embedders, which read a raw input, and conditioning MLPs,
      which read no token stream: the final-projection rule (a linear reading token-stream
      values mixed with conditioning or attention) passes them over. A direct child that is a
      whole token-mixing sub-network ending in a linear would be taken for the output layer
      (its last linear kept native).
    """
    instance = gm.meta.get(INSTANCE_KEY)
    if instance in ("", None):
        return True
    return "." not in instance and not instance.isdigit()


def find_sensitive_linears(gm: torch.fx.GraphModule, *, model_output: bool = True) -> dict[torch.fx.Node, str]:
    """{linear node: why it is sensitive} from the graph's data flow: "timestep conditioning",
    "adaLN modulation" or "final projection" (see the module docstring). Linears are the
    call_function nodes of graph.forms.LINEAR_TARGETS and prepared fx_fp8::quantized_linear
    calls. model_output=False for a graph of one block or attention module (a region compiled
    on its own): its output is not the model's, so its last linear is no final projection
    (holds_model_output decides it from the graph's instance).
    Never raises: on anything unexpected it returns {} (the name patterns still apply)."""
    try:
        return _Analysis(gm, model_output).run()
    except Exception:  # an analysis must never break a compile
        return {}


@dataclasses.dataclass
class LinearTrace:
    """What one trace of a model on example inputs says about its linears: the sensitive ones
    ({module name: reason}) and the inputs each was called with ({module name: {(M, activation
    dtype)}}; M None where symbolic), the token counts the tune table is looked up at."""

    sensitive: dict[str, str]
    inputs: dict[str, set]


def sensitive_linear_names(model: torch.nn.Module, args=(), kwargs=None) -> dict[str, str]:
    """{linear module name: reason} for `model`, traced once on example inputs (trace_linears)."""
    return trace_linears(model, args, kwargs).sensitive


def trace_linears(model: torch.nn.Module, args=(), kwargs=None) -> LinearTrace:
    """The sensitive linears of `model` and each linear's inputs, traced once on example inputs: Dynamo
    with a capturing backend (each graph runs as traced, nothing is compiled), the same names and
    analysis the fp8 backends use. For prepare_model, which has no graph of its own.

    The trace leaves Dynamo's caches as they were for every other compile (the model's forward
    runs on a private copy of its code, graph-broken frames compile in a region of their own:
    fx_fp8/graph/dynamo_internals.py), so the 100th model of a class is traced as the first.
    A trace that captures no graph (Dynamo ran the model eagerly) raises: the analysis would
    otherwise find nothing sensitive and quantize the sensitive layers."""
    found: dict[str, str] = {}
    inputs: dict[str, set] = {}
    graphs = [0]  # graphs captured
    model_ref = weakref.ref(model)  # Dynamo may keep the backend (graph-broken frames): not the model

    def capture(gm, example_inputs):
        graphs[0] += 1
        resolve_graph(gm, example_inputs, model=model_ref())
        for node, why in find_sensitive_linears(gm, model_output=holds_model_output(gm)).items():
            if is_resolved(node):
                found.setdefault(module_name(node), why)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in LINEAR_TARGETS and is_resolved(node):
                x = _val(node.args[0] if node.args else node.kwargs.get("input"))
                if isinstance(x, torch.Tensor) and x.dim() >= 1:
                    inputs.setdefault(module_name(node), set()).add(
                        (token_count(x), str(x.dtype).replace("torch.", ""))
                    )
        return gm.forward

    with torch.no_grad(), forward_on_private_code(model):
        torch.compile(model, backend=capture, **isolated_compile_kwargs())(*args, **(kwargs or {}))
    if not graphs[0]:
        raise RuntimeError(
            f"fx_fp8: finding the sensitive layers of {type(model).__name__} traced no graph (Dynamo ran its "
            "forward eagerly: torch.compiler.disable, a recompile limit hit, or a forward Dynamo skips), so "
            "the analysis cannot tell which layers are sensitive; pass sensitive={name: reason} (or "
            "example_inputs=None: name patterns only) to prepare_model, or compile_pipeline(prepare=False)"
        )
    return LinearTrace(found, inputs)
