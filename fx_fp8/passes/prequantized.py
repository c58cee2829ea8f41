"""Pre-quantized FP8 linears: a layer that keeps a float8_e4m3fn weight with its scales and
dequantizes it in its forward (diffusers' BFL fp8r BFLFP8RLinear on devices without its own FP8
path, a module in ModelOpt FP8 layout) reaches the graph as

    w  = W.to(dt) * S                         W: e4m3 [N, K] graph input; S: its stored scale,
    y  = linear(x, w, b)                         [] / [1] (per tensor) or [N] / [N, 1] (per row)

optionally with the input fake-quantized by a stored static scale s ([] / [1]):

    x' = (x / s).clamp(-448, 448).to(float8_e4m3fn).to(dt) * s

This pass rewrites each such linear into the prepared form the linear pass lowers like a
prepare_model layer (fx_fp8/passes/linear.py `_prepared`):

    y  = fx_fp8::quantized_linear(x, W, S', b, s', None, method="fp8", weight_granularity=g, ...)

so the FP8 GEMM reads W's stored bytes as they are (no dequantize, no re-quantization); S' and s'
are S and s as fp32 [N, 1] / [] (a view, and a no-op cast for the fp32 scales both layouts store).

What is recognised, exactly (anything else is left alone, as the module's own forward):
* W is a graph input (placeholder or get_attr) of dtype float8_e4m3fn and rank 2; S a graph input
  of a float dtype whose elements are one or N; s one element;
* between W and the product only float casts, same-device `.to(device)` and full slices; between S
  and the product also order-preserving reshapes (view, reshape, unsqueeze, indexing with `None`
  and full slices), and the operand that reaches the product is [N, 1] or one element (so row i
  gets S[i]); after the product, float casts, same-device moves and full slices up to the linear;
* the product is one out-of-place multiplication of those two operands and has W's shape;
* the fake-quantization is a division by s, a clamp to exactly -448..448, a cast to
  float8_e4m3fn, float casts, and a multiplication by the same s.
The rewritten node carries the weight's origin in node.meta[WEIGHT_ORIGIN] (fx_fp8/passes/base.py):
"BFL fp8r checkpoint (per-channel weight scales)", "pre-quantized FP8 weights of <class>
(per-tensor weight scales, static input scale)". Prepared fx_fp8::quantized_linear calls whose
weight fx_fp8.adopt_prequantized swapped in get the same key.

A sensitive layer run weight-only (quantization_config.sensitive "weight_only", the default)
becomes a prepared weight-only call (act_granularity "weight_only": the stored weight, unquantized
activations, any static input scale unused). A linear the config keeps native (quantization off,
ignored_layers, a sensitive layer run native, a natively skipped step, what the lowering cannot
take) is left as the module's forward computes it: the stored weight dequantized for a native matmul.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Optional

import torch
import torch.fx

from fx_fp8.config.patterns import first_match
from fx_fp8.config.step_variants import linear_skip_mode
from fx_fp8.graph.forms import LINEAR_TARGETS, PREPARED_TARGETS
from fx_fp8.graph.fx_utils import call_args, insert_function, meta_val, real_tensor
from fx_fp8.graph.names import module_name
from fx_fp8.graph.shapes import concrete
from fx_fp8.ops.formats import FLOAT_DTYPES, FP8_DTYPE, FP8_MAX
from fx_fp8.passes.base import WEIGHT_ORIGIN, FXPass
from fx_fp8.quant.linear_plan import LinearPlan, native, plan_linear
from fx_fp8.quant.prequantized import (
    bad_scale,
    channel_scale,
    describe_origin,
    scale_granularity,
    source_of_class,
    tensor_scale,
    warn_bad_scales,
    weight_origin,
)
from fx_fp8.quant.recipe import WeightRecipe

MUL_TARGETS = {operator.mul, torch.mul}
DIV_TARGETS = {operator.truediv, torch.div}
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
_RESHAPES = ("view", "reshape", "unsqueeze")


@dataclasses.dataclass
class Match:
    """One pre-quantized linear found in the graph."""

    linear: torch.fx.Node
    x: torch.fx.Node  # the activation the prepared form quantizes
    weight: torch.fx.Node  # the stored e4m3 weight (a graph input)
    scale: torch.fx.Node  # its stored scale (a graph input)
    granularity: str  # "tensor" / "channel"
    bias: Optional[torch.fx.Node]
    input_scale: Optional[torch.fx.Node]  # the stored static activation scale, when the input is fake-quantized by it
    chain: list  # the nodes between the stored tensors and the linear (erased once unused)
    origin: str


# -- what a node computes ---------------------------------------------------------------------
def _is_call(node, method: Optional[str] = None, targets=()) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method":
        return method is not None and node.target == method
    return node.op == "call_function" and node.target in targets


def _cast(node) -> Optional[tuple]:
    """(source, dtype) when `node` only changes its input's dtype: x.to(dtype), x.float() ..."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_method" or not node.args:
        return None
    rest, kw = node.args[1:], dict(node.kwargs)
    if node.target in _CAST_METHODS and not rest and not kw:
        return node.args[0], _CAST_METHODS[node.target]
    if node.target in ("to", "type"):
        if len(rest) == 1 and not kw and isinstance(rest[0], torch.dtype):
            return node.args[0], rest[0]
        if not rest and set(kw) == {"dtype"} and isinstance(kw["dtype"], torch.dtype):
            return node.args[0], kw["dtype"]
    return None


def _same_device_move(node) -> Optional[torch.fx.Node]:
    """The source of x.to(device) where x is already on that device (a no-op)."""
    if not _is_call(node, "to") or len(node.args) != 2 or node.kwargs:
        return None
    src, dev = node.args
    val = meta_val(src)
    if isinstance(dev, (str, torch.device)) and val is not None and torch.device(dev) == val.device:
        return src
    return None


def _full_slice_source(node) -> Optional[torch.fx.Node]:
    """The source of x[:, :n] style indexing that keeps every element in place."""
    if not _is_call(node, targets={operator.getitem}) or len(node.args) != 2:
        return None
    src, idx = node.args
    val = meta_val(src)
    if val is None:
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) > val.dim() or any(not isinstance(i, slice) for i in idx):
        return None
    for i, d in zip(idx, val.shape):
        if i.step not in (None, 1) or i.start not in (None, 0):
            return None
        if i.stop is not None and (concrete(d) is None or not isinstance(i.stop, int) or i.stop < concrete(d)):
            return None
    return src


def _value_source(node, *, reshape: bool) -> Optional[tuple]:
    """(source, dtype or None) when `node` passes its input's values on unchanged: a float cast
    (dtype: the cast's), a same-device move, full slices, and with `reshape` an order-preserving
    reshape (view, reshape, unsqueeze, indexing with None / full slices)."""
    cast = _cast(node)
    if cast is not None:
        return cast if cast[1] in FLOAT_DTYPES else None
    for src in (_same_device_move(node), _full_slice_source(node)):
        if src is not None:
            return src, None
    if not reshape or not isinstance(node, torch.fx.Node) or not node.args:
        return None
    if node.op == "call_method" and node.target in _RESHAPES and not node.kwargs:
        return node.args[0], None
    if _is_call(node, targets={torch.reshape, torch.unsqueeze}) and not node.kwargs:
        return node.args[0], None
    if _is_call(node, targets={operator.getitem}) and len(node.args) == 2:
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if all(i is None or i is Ellipsis or i == slice(None) for i in idx):
            return node.args[0], None
    return None


def _root(node, *, reshape: bool) -> tuple:
    """(the stored tensor `node` passes on, the nodes in between), following _value_source."""
    chain = []
    while True:
        step = _value_source(node, reshape=reshape)
        if step is None:
            return node, chain
        chain.append(node)
        node = step[0]


def _stored(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


def _operands(node) -> Optional[tuple]:
    """(a, b) of an out-of-place multiplication a * b of two nodes, else None."""
    if node.kwargs or len(node.args) != 2:
        return None
    if not (_is_call(node, "mul") or _is_call(node, targets=MUL_TARGETS)):
        return None
    a, b = node.args
    return (a, b) if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) else None


def _dequantized_weight(weight_arg) -> Optional[tuple]:
    """(W, S, granularity, chain) when `weight_arg` is a stored e4m3 weight times its stored scale."""
    product, chain = _root(weight_arg, reshape=False)
    operands = _operands(product)
    if operands is None:
        return None
    chain.append(product)
    out = meta_val(product)
    for w_side, s_side in (operands, operands[::-1]):
        w, w_chain = _root(w_side, reshape=False)
        s, s_chain = _root(s_side, reshape=True)
        wv, sv, operand = meta_val(w), meta_val(s), meta_val(s_side)
        if not (_stored(w) and _stored(s)) or wv is None or sv is None or operand is None or out is None:
            continue
        if wv.dtype != FP8_DTYPE or wv.dim() != 2 or sv.dtype not in FLOAT_DTYPES:
            continue
        n, k = concrete(wv.shape[0]), concrete(wv.shape[1])
        if n is None or k is None or tuple(out.shape) != (n, k):
            continue
        stored = tuple(concrete(d) for d in sv.shape)
        granularity = scale_granularity(stored, n) if None not in stored else None
        reaching = tuple(concrete(d) for d in operand.shape)  # what multiplies W: row i must get S[i]
        if (granularity == "tensor" and len(reaching) <= 2 and all(d == 1 for d in reaching)) or (
            granularity == "channel" and reaching == (n, 1)
        ):
            return w, s, granularity, chain + w_chain + s_chain
    return None


def _one_element_input(node) -> Optional[tuple]:
    """(s, chain) when `node` passes on a stored one-element float tensor."""
    s, chain = _root(node, reshape=True)
    val = meta_val(s)
    if not _stored(s) or val is None or val.dtype not in FLOAT_DTYPES or val.numel() != 1:
        return None
    return s, chain


def _clamp_source(node) -> Optional[torch.fx.Node]:
    """The source of x.clamp(-448, 448) / torch.clamp(x, min=-448, max=448)."""
    if not (_is_call(node, "clamp") or _is_call(node, targets={torch.clamp})):
        return None
    args = call_args(node, ["input", "min", "max"], {"min": None, "max": None})
    lo, hi = args["min"], args["max"]
    if set(node.kwargs) - {"min", "max"} or len(node.args) > 3:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)):
        return None
    return args["input"] if (float(lo), float(hi)) == (-FP8_MAX, FP8_MAX) else None


def _static_input(x_arg) -> Optional[tuple]:
    """(x, s, chain) when the linear's input is x fake-quantized by the stored one-element scale s."""
    want = meta_val(x_arg)
    product, chain = _root(x_arg, reshape=False)
    operands = _operands(product)
    if operands is None or want is None:
        return None
    for q_side, s_side in (operands, operands[::-1]):
        s = _one_element_input(s_side)
        if s is None:
            continue
        node, q_chain = q_side, []
        while (cast := _cast(node)) is not None and cast[1] in FLOAT_DTYPES:  # back to float after the fp8 cast
            q_chain.append(node)
            node = cast[0]
        fp8 = _cast(node)
        if fp8 is None or fp8[1] != FP8_DTYPE:
            continue
        division = _clamp_source(fp8[0])
        if division is None or not _is_call(division, "div", DIV_TARGETS) or division.kwargs or len(division.args) != 2:
            continue
        divided, s_div = division.args
        s2 = _one_element_input(s_div)
        if s2 is None or s2[0] is not s[0] or not isinstance(divided, torch.fx.Node):
            continue
        # the activation itself: the deepest of the numerator's float casts in the linear's input dtype
        casts = [divided]
        while (cast := _cast(casts[-1])) is not None and cast[1] in FLOAT_DTYPES:
            casts.append(cast[0])
        same = [i for i, c in enumerate(casts) if (v := meta_val(c)) is not None and v.dtype == want.dtype]
        if not same:
            continue
        x = casts[same[-1]]
        return x, s[0], chain + [product] + q_chain + [node, fp8[0], division] + s[1] + s2[1] + casts[: same[-1]]
    return None


def _class_name(node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    cls = list(stack.values())[-1][1]
    return getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")


def _linear_weight(node) -> torch.fx.Node:
    return call_args(node, ["input", "weight", "bias"], {"bias": None})["weight"]


def _compute_dtype(m: "Match") -> torch.dtype:
    """The dtype the module dequantizes its weight to (what the rules' dtype check reads)."""
    w = meta_val(_linear_weight(m.linear))
    return w.dtype if w is not None else torch.float32


def find_prequantized(node: torch.fx.Node) -> Optional[Match]:
    """The pre-quantized linear `node` is, or None (see the module docstring for what matches)."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    args = call_args(node, ["input", "weight", "bias"], {"bias": None})
    if not isinstance(args["input"], torch.fx.Node) or not isinstance(args["weight"], torch.fx.Node):
        return None
    found = _dequantized_weight(args["weight"])
    if found is None:
        return None
    w, s, granularity, chain = found
    x, input_scale = args["input"], None
    static = _static_input(args["input"])
    if static is not None:
        x, input_scale, x_chain = static
        chain = chain + x_chain
    origin = describe_origin(source_of_class(_class_name(node)), granularity, input_scale is not None)
    return Match(node, x, w, s, granularity, args["bias"], input_scale, chain, origin)


class PrequantizedLinearPass(FXPass):
    """Rewrites linears on dequantized pre-quantized FP8 weights into prepared quantized_linear
    calls (see the module docstring); labels adopted layers' calls with their origin. Runs before
    the linear pass, which lowers both and reports them."""

    name = "prequantized_linear"

    def __init__(self, inputs, out):
        super().__init__(inputs, out)
        self.qcfg = inputs.config.quantization_config
        self.on = inputs.config.linear_enabled
        self.skip_mode = linear_skip_mode(inputs.step_variant) if self.on else None
        self._fp8_configs: dict = {}

    @classmethod
    def instance_facts(cls, fc, node, module):
        """The decision reads the linear's name (ignored_layers, the rules' plan); an adopted
        layer's origin is read from its weight."""
        if node.op != "call_function":
            return None
        qcfg = fc.config.quantization_config
        if node.target in PREPARED_TARGETS:
            w = call_args(node, ["x", "weight"], {}).get("weight")
            return (
                "adopted",
                weight_origin(fc.resolver.module(real_tensor(w, fc.gm, fc.example_inputs, fc.placeholders))),
            )
        m = find_prequantized(node)
        if m is None:
            return None
        wq = meta_val(m.weight)
        plan = plan_linear(
            module,
            wq.shape[1],
            wq.shape[0],
            _compute_dtype(m),
            qcfg,
            sensitive=fc.sensitive.get(node.name),
            stored=WeightRecipe("fp8", m.granularity),
        )
        return ("prequantized", first_match(qcfg.ignored_layers, module), plan.kind, plan.reason)

    def run(self, gm: torch.fx.GraphModule) -> int:
        matches = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in PREPARED_TARGETS:
                self._label_adopted(node)
                continue
            m = find_prequantized(node)
            if m is not None:
                matches.append(m)
        warn_bad_scales([b for m in matches if (b := self._bad_scale(m)) is not None], "torch.compile(backend='fp8')")
        rewritten = [m for m in matches if self._rewrite(gm, m)]
        self._erase_unused(gm, [n for m in rewritten for n in m.chain])
        return len(rewritten)

    def _bad_scale(self, m: Match) -> Optional[str]:
        """bad_scale of the stored scales this linear reads (when the compile has their values)."""
        real = [
            real_tensor(n, self.inputs.gm, self.inputs.example_inputs, self.inputs.placeholders)
            for n in (m.scale, m.input_scale)
        ]
        return bad_scale(module_name(m.linear), *real)

    def _label_adopted(self, node) -> None:
        w = call_args(node, ["x", "weight"], {}).get("weight")
        origin = weight_origin(
            self.inputs.resolver.module(
                real_tensor(w, self.inputs.gm, self.inputs.example_inputs, self.inputs.placeholders)
            )
        )
        if origin is not None:
            node.meta[WEIGHT_ORIGIN] = origin

    def _plan(self, m: Match) -> LinearPlan:
        """The linear's plan with its stored weights' own layout: a W8A8 or weight-only plan
        rewrites it, a native one leaves the module's own dequantizing forward."""
        if self.skip_mode == "native":
            return native("natively skipped step")
        wq, x = meta_val(m.weight), meta_val(m.x)
        graph_reason = None if x is not None and x.dtype in FLOAT_DTYPES else f"input dtype {getattr(x, 'dtype', None)}"
        return plan_linear(
            module_name(m.linear),
            wq.shape[1],
            wq.shape[0],
            _compute_dtype(m),
            self.qcfg,
            sensitive=self.sensitive_of(m.linear),
            enabled=self.on,
            graph_reason=graph_reason,
            lowering=self.inputs.lowering,
            values=(x, wq),
            lowering_config=self._fp8_config(m.granularity),
            stored=WeightRecipe("fp8", m.granularity),
        )

    def _fp8_config(self, granularity: str):
        """This compile's quantization config with the stored weights' method and granularity (what
        the lowering is asked about)."""
        if granularity not in self._fp8_configs:
            with warnings.catch_warnings():  # the config warned about itself when it was made
                warnings.simplefilter("ignore")
                self._fp8_configs[granularity] = dataclasses.replace(
                    self.qcfg, method="fp8", weight_granularity=granularity, weight_block_size=None
                )
        return self._fp8_configs[granularity]

    def _rewrite(self, gm, m: Match) -> bool:
        m.linear.meta[WEIGHT_ORIGIN] = m.origin  # a kept linear's row can say where its weight came from too
        plan = self._plan(m)
        if plan.native:
            return False
        # a sensitive layer run weight-only (W8A16) takes the stored weight with unquantized activations
        weight_only = plan.weight_only
        act = plan.act
        graph = gm.graph
        with graph.inserting_before(m.linear):
            to_scale = channel_scale if m.granularity == "channel" else tensor_scale
            scale = insert_function(graph, to_scale, (m.scale,), m.linear.meta)
            input_scale = (
                insert_function(graph, tensor_scale, (m.input_scale,), m.linear.meta)
                if m.input_scale is not None and not weight_only
                else None
            )
            new = graph.call_function(
                torch.ops.fx_fp8.quantized_linear.default,
                (m.x, m.weight, scale, m.bias, input_scale, None),
                dict(
                    method="fp8",
                    weight_granularity=m.granularity,
                    weight_block=[],
                    act_granularity=act,
                    lowering=self.inputs.lowering.name,
                ),
            )
        new.meta.update(m.linear.meta)  # the same value, module and names as the linear it replaces
        why = self.sensitive_of(m.linear)
        if why is not None:  # the linear pass reads it on the node that replaces the linear
            self.out.sensitive[new.name] = why
        m.linear.replace_all_uses_with(new)
        self.erase(gm, m.linear)
        return True

    def _erase_unused(self, gm, chain: list) -> None:
        """The dequantization and fake-quantization nodes nothing reads any more, consumers first."""
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in sorted(set(n for n in chain if n in order), key=order.get, reverse=True):
            if not node.users and node.op in ("call_function", "call_method"):
                self.erase(gm, node)
