"""Quantized W8A8 linears (FP8 or INT8): linear -> activation quantization + fx_fp8::scaled_mm.

For each eligible linear the pass writes
    xq, xs = quantize(x)                    # once per activation-quant group
    y      = scaled_mm(xq, xs, W, ...)      # W quantized once, kept on the model
    y      = y.unflatten(0, x.shape[:-1])
Linears that read the same tensor with the same dynamic recipe (to_q / to_k /
to_v of one norm output, proj_mlp beside attention) form one group and share
one quantization. Where the lowering quantizes with plain torch ops (CPU
reference, CUDA) those ops are written into the graph, so the downstream
compiler fuses them into the producer; where it has a fused kernel (NPU) one
opaque fx_fp8::quantize_activation call is written per group.

Prepared QuantizedLinear modules (prepare_model) reach the graph as
fx_fp8::quantized_linear calls and are rewritten the same way; devices without
quantized matrix units get fx_fp8::weight_only_linear.

Which linears, and how, is decided in fx_fp8/passes/linear_decisions.py (one LinearPlan each).
An unprepared linear's weight is quantized into a copy its module owns
(fx_fp8/quant/weight_state.py) by a weight action the graph plan applies
(fx_fp8/quant/weight_actions.py), and the graph reads that copy through inputs the pass
appends (fx_fp8/quant/weight_feeds.py: the caller supplies them once per graph call,
re-quantizing a changed weight in place), never through a lookup at run time.
The GEMM itself is what the lowering writes (Lowering.emit_gemm): aten ops on
CUDA (torch._scaled_mm, so Inductor sees it), the fx_fp8::scaled_mm custom op
on the CPU reference and the NPU.

SmoothQuant-style smoothing (quantization_config.smoothing_alpha): after the
groups are formed, each group gets one vector s from the calibrated per-channel
activation maxima and the group's weight columns; every member's weight is
quantized as W * s (its own copy) and the group's activation is multiplied by
1/s before its one quantization:
    xq, xs = quantize(x * inv)      # inv: 1/s, an appended input (the first member's)
1/s is an input, never a graph constant (Dynamo shares a graph between model
instances). Prepared layers carry their own 1/s buffer (per layer: they do not
share a quantization then).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from fx_fp8.graph.fx_utils import insert_function, meta_val, real_tensor
from fx_fp8.ops import quant
from fx_fp8.passes.base import WEIGHT_ORIGIN, FXPass
from fx_fp8.passes.linear_decisions import Linear, LinearDecisions
from fx_fp8.quant.weight_feeds import Feed


@functools.lru_cache(maxsize=None)
def dynamic_quant_fn(method: str, granularity: str, group: int):
    """x [..., K] -> (xq [M, K], scale): quant.quantize_activation as a traceable function."""

    def quantize(x):
        return quant.quantize_activation(x.reshape(-1, x.shape[-1]), granularity, method, group or None)

    return quantize


@functools.lru_cache(maxsize=None)
def static_quant_fn(method: str):
    def quantize(x, scale):
        return quant.quantize_activation_static(x.reshape(-1, x.shape[-1]), scale, method)

    return quantize


def smooth_input(x, inverse):
    """x * (1/s) before the group's quantization (plain torch ops: fused into the producer)."""
    return quant.smooth_activation(x, inverse)


def _reads_step_scale(node) -> bool:
    """A prepared layer's input scale that its per-step scales look up (QuantizedLinear.forward)."""
    return isinstance(node, torch.fx.Node) and node.target in (
        torch.ops.fx_fp8.step_scale,
        torch.ops.fx_fp8.step_scale.default,
    )


def restore_leading_dims(y, x):
    """[M, N] -> x.shape[:-1] + (N,)."""
    return y.unflatten(0, x.shape[:-1])


class FP8LinearPass(FXPass):
    """Rewrites the linears its decisions (fx_fp8/passes/linear_decisions.py) quantize: a report
    row each, the weight actions emitted there and applied by the graph plan; this class only
    writes the graph."""

    name = "quantized_linear"

    def __init__(self, inputs, out):
        super().__init__(inputs, out)
        self.qcfg = inputs.config.quantization_config
        self.calibration = inputs.calibration
        self.decisions = LinearDecisions(self)

    @classmethod
    def instance_facts(cls, fc, node, module):
        """What the decisions read through the linear's name or the instance's inputs
        (LinearDecisions.facts)."""
        return LinearDecisions.facts(fc, node, module)

    def run(self, gm: torch.fx.GraphModule) -> int:
        plan = self.decisions.linears(gm)
        groups: dict = {}
        for item in plan:
            groups.setdefault(item.group_key(), []).append(item)
        for members in groups.values():
            self.decisions.smooth(members)
        replaced: dict = {}  # a linear whose output feeds another linear is replaced first
        for n, members in enumerate(groups.values()):
            for m in members:
                m.x = replaced.get(m.x, m.x)
            self._rewrite_group(gm, members, f"g{n}:{members[0].x.name}", replaced)
        self.decisions.notes()
        return len(plan)

    # -- rewriting ---------------------------------------------------------------------------
    def _rewrite_group(self, gm, members: list[Linear], group: str, replaced: dict) -> None:
        graph = gm.graph
        lowering = self.inputs.lowering
        w8a8 = [m for m in members if not m.weight_only]
        first = members[0]
        xq = xs = None
        if w8a8:
            with graph.inserting_before(first.node):
                xq, xs = self._quantize(graph, first)
        for m in members:
            with graph.inserting_before(m.node):
                common = dict(
                    method=m.method,
                    weight_granularity=m.weight_granularity,
                    weight_block=m.weight_block,
                    lowering=lowering.name,
                )
                base_meta = {k: v for k, v in m.node.meta.items() if k not in ("val", "example_value")}
                wq, ws = (m.weight, m.weight_scale) if m.prepared else (self._fed(m, "wq"), self._fed(m, "ws"))
                if m.prepared and m.weight.op == "placeholder":  # checked not written, once per call
                    slot = self.inputs.placeholders.get(m.weight)
                    if slot is not None and slot not in self.out.feeds.prepared:
                        self.out.feeds.prepared.append(slot)
                if m.weight_only:
                    x = m.x  # a prepared layer's weight is W * s: its input still needs the 1/s
                    if m.input_smoothing is not None:
                        x = insert_function(graph, smooth_input, (m.x, m.input_smoothing), m.node.meta)
                    new = out = graph.call_function(
                        torch.ops.fx_fp8.weight_only_linear.default, (x, wq, ws, m.bias), common
                    )
                else:
                    new = lowering.emit_gemm(
                        graph,
                        xq,
                        xs,
                        wq,
                        ws,
                        m.bias,
                        out_dtype=meta_val(m.x).dtype,
                        fast_accum=self.qcfg.fast_accum,
                        meta=base_meta,
                        act=m.act,
                        weight_val=self._weight_value(m),
                        **common,
                    )
                    out = insert_function(graph, restore_leading_dims, (new, m.x), m.node.meta)
                out.meta.update(m.node.meta)  # same value as the linear it replaces
            m.node.replace_all_uses_with(out)
            replaced[m.node] = out
            self.erase(gm, m.node)
            self.record(
                new,
                op="linear",
                module=m.module,
                action="weight-only" if m.weight_only else ("fp8" if m.method == "fp8" else m.method),
                reason=self._describe(m),
                shapes=m.shapes,
                dims=m.dims,
                act_quant_group="" if m.weight_only else group,
                timing=m.plan.timing or {},
            )

    def _weight_value(self, m: Linear):
        """The quantized weight GEMM m reads (its value or fake value): shape and device."""
        if m.prepared:
            val = meta_val(m.weight)
            return (
                val
                if val is not None
                else real_tensor(m.weight, self.inputs.gm, self.inputs.example_inputs, self.inputs.placeholders)
            )
        st = self.inputs.resolver.state(m.slot, m.real_weight, m.module)
        alpha = m.smoothing.alpha if m.smoothing is not None else None
        return Feed(m.slot, "wq", m.plan.recipe, alpha).tensor(st, m.real_weight)

    def _fed(self, m: Linear, kind: str) -> torch.fx.Node:
        """The appended input carrying what the pass derived from unprepared linear m's weight."""
        alpha = m.smoothing.alpha if m.smoothing is not None and kind in ("wq", "ws", "inverse") else None
        feed = Feed(m.slot, kind, m.plan.recipe if kind in ("wq", "ws") else None, alpha)
        st = self.inputs.resolver.state(m.slot, m.real_weight, m.module)
        return self.out.feeds.placeholder(feed, feed.tensor(st, m.real_weight), hint=str(m.slot))

    def _quantize(self, graph, m: Linear):
        """(xq, xs) nodes for a group's activation, at the graph's insert point."""
        lowering = self.inputs.lowering
        x = m.x
        inverse = m.input_smoothing  # a prepared layer's 1/s buffer
        if inverse is None and m.smoothing is not None:  # unprepared: its group's 1/s, an appended input
            inverse = self._fed(m, "inverse")
        if inverse is not None:  # plain torch ops before the quantization (a fused one too, on NPU)
            x = insert_function(graph, smooth_input, (m.x, inverse), m.node.meta)
        scale = m.input_scale
        if m.act == "static" and scale is None:  # unprepared: the calibrated scale, an appended input
            scale = self._fed(m, "input_scale")
            steps = self.inputs.resolver.state(m.slot, m.real_weight, m.module).input_step_scales
            if steps is not None:  # the published step's group picks its scale per call (no recompile)
                scale = graph.call_function(
                    torch.ops.fx_fp8.step_scale.default,
                    (self._fed(m, "step_scales"), scale),
                    {"groups": list(steps[0])},
                )
        group = m.weight_block[1] if m.act == "group" else 0
        if lowering.fused_activation_quant:
            node = graph.call_function(
                torch.ops.fx_fp8.quantize_activation.default,
                (x, scale),
                dict(
                    method=m.method,
                    granularity="tensor" if m.act == "static" else m.act,
                    group=group,
                    lowering=lowering.name,
                ),
            )
            node.meta["nn_module_stack"] = m.node.meta.get("nn_module_stack", {})
            return (graph.call_function(operator.getitem, (node, 0)), graph.call_function(operator.getitem, (node, 1)))
        if m.act == "static":
            return insert_function(graph, static_quant_fn(m.method), (x, scale), m.node.meta)
        return insert_function(graph, dynamic_quant_fn(m.method, m.act, group), (x,), m.node.meta)

    def _describe(self, m: Linear) -> str:
        w = m.weight_granularity + (f" {m.weight_block}" if m.weight_granularity == "block" else "")
        src = m.node.meta.get(WEIGHT_ORIGIN, "prepared weights") if m.prepared else "weights quantized at compile"
        if m.left_by_prepare:
            src += " (prepare_model left it: it carries diffusers hooks)"
        name = self.inputs.lowering.name
        if m.weight_only:
            return f"{m.why + '; ' if m.why else ''}{name}: weight-only {m.method.upper()} ({w} scales), {src}"
        act = "static activations" if m.act == "static" else f"dynamic per-{m.act} activations"
        if m.act == "static" and (self.calibration.per_step if not m.prepared else _reads_step_scale(m.input_scale)):
            act = "static per-step activations"
        if m.smoothing is not None:
            act += f", smoothed (alpha {m.smoothing.alpha:g})"
        elif m.input_smoothing is not None:
            act += ", smoothed"
        gemm = self.inputs.lowering.gemm_description(
            m.method,
            m.weight_granularity,
            m.weight_block,
            self.qcfg.fast_accum,
            act=m.act,
            weight_val=self._weight_value(m),
        )
        return f"{m.why + '; ' if m.why else ''}{name}: {m.method.upper()} W8A8, {w} weight scales, {act}, {src}" + (
            f"; {gemm}" if gemm else ""
        )
