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

An unprepared linear's weight is quantized now, into a copy its module owns
(fx_fp8/quant/weight_state.py), and the graph reads that copy through inputs the pass
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

import dataclasses
import functools
import operator
from typing import Optional

import torch
import torch.fx

from fx_fp8.config.patterns import first_match
from fx_fp8.graph.forms import LINEAR_TARGETS, PREPARED_PARAMS, PREPARED_TARGETS
from fx_fp8.graph.fx_utils import call_args, insert_function, meta_val, real_tensor
from fx_fp8.graph.names import module_name
from fx_fp8.graph.shapes import shape_str
from fx_fp8.ops import quant, tune_table
from fx_fp8.ops.formats import FLOAT_DTYPES, WEIGHT_ONLY
from fx_fp8.passes.base import WEIGHT_ORIGIN, FXPass, NotReusable
from fx_fp8.quant.linear_scales import (channel_stats, check_channel_amax, check_per_step_supported, method_scale,
                                        smoothed_static_scale, step_scale_table)
from fx_fp8.quant.recipe import Smoothing, WeightRecipe, group_smoothing
from fx_fp8.quant.keep_fp32 import model_keep_reason
from fx_fp8.quant.rules import linear_native_reason, linear_plan, sensitive_reason
from fx_fp8.quant.weight_feeds import Feed
from fx_fp8.report import dims_of
from fx_fp8.steps import linear_skip_mode


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
    return isinstance(node, torch.fx.Node) and node.target in (torch.ops.fx_fp8.step_scale,
                                                                torch.ops.fx_fp8.step_scale.default)


def restore_leading_dims(y, x):
    """[M, N] -> x.shape[:-1] + (N,)."""
    return y.unflatten(0, x.shape[:-1])


@dataclasses.dataclass(frozen=True)
class WeightAction:
    """What the pass does to one instance's weight: its quantized copy, and its calibrated
    static scale. Kept in CompileContext.weight_actions, so an instance that reuses another's
    decisions gets the same done to its own weight (apply_weight_action)."""

    slot: int                    # the weight's graph input
    node: str                    # the linear's node in the graph
    recipe: WeightRecipe
    static: bool                 # attach the layer's calibrated activation scale


def attach_static_scale(st, value: float, steps, device) -> None:
    """A linear's calibrated activation scale (and its per-step scales: (flat step groups,
    [scale per group]), linear_scales.step_scale_table) on its weight's state."""
    st.input_scale = torch.tensor(value, dtype=torch.float32, device=device)
    st.input_step_scales = None if steps is None else (
        tuple(steps[0]), torch.tensor(steps[1], dtype=torch.float32, device=device))
    st.generation += 1  # new tensors: feeders look them up again


def apply_weight_action(action: WeightAction, weight: torch.Tensor, module: str, qcfg, scales, resolver):
    """Quantize `weight` (linear `module`) as `action` says, into the copy its module owns, and
    attach its static scale; the copy (made now, or checked against the weight's bytes)."""
    st = resolver.state(action.slot, weight, module)
    copy = st.copy(weight, action.recipe, check_bytes=True)
    if action.static:
        attach_static_scale(st, method_scale(scales[module], qcfg.method),
                            step_scale_table(scales, module, lambda v: method_scale(v, qcfg.method)), weight.device)
    return copy


class Linear:
    """One linear the pass will rewrite, and how."""

    def __init__(self, node, module, x, weight, weight_scale, bias, input_scale, *, method, weight_granularity,
                 weight_block, act, weight_only, prepared, shapes, input_smoothing=None, real_weight=None,
                 channel_amax=None):
        self.node, self.module = node, module
        self.x, self.weight, self.weight_scale, self.bias, self.input_scale = x, weight, weight_scale, bias, input_scale
        self.method, self.weight_granularity, self.weight_block = method, weight_granularity, list(weight_block or [])
        self.act, self.weight_only, self.prepared, self.shapes = act, weight_only, prepared, shapes
        # smoothing: a prepared layer's 1/s buffer (graph node); for an unprepared one its weight and
        # calibrated channel maxima, then the group's Smoothing (set by FP8LinearPass._smooth)
        self.input_smoothing, self.real_weight, self.channel_amax = input_smoothing, real_weight, channel_amax
        self.smoothing: Optional[Smoothing] = None
        self.slot: Optional[int] = None  # an unprepared weight's graph input (its copy is fed from it)
        self.recipe: Optional[WeightRecipe] = None  # how an unprepared weight is quantized
        self.dims: list = []  # input shapes as numbers, for the report's FLOPs
        self.left_by_prepare = False  # prepare_model left this unprepared linear (it carries diffusers hooks)
        self.why = ""  # why a layer the device could run W8A8 runs weight-only (sensitive layer, skipped step)
        self.timing: dict = {}  # the tune table's measured ms of the pick and of native (report rows)

    @property
    def smoothed(self) -> bool:
        return self.input_smoothing is not None or self.channel_amax is not None

    def group_key(self):
        """Linears with equal keys share one activation quantization."""
        if self.act == "static":  # a calibrated scale per layer: never shared
            return (self.x, "static", self.node)
        if self.input_smoothing is not None:  # a prepared layer's own 1/s: never shared
            return (self.x, "smoothed", self.node)
        group = self.weight_block[1] if self.act == "group" else 0
        return (self.x, self.method, self.act, group) + (("smoothed",) if self.smoothed else ())


class FP8LinearPass(FXPass):
    """Decides every linear (report row each) and rewrites the quantized ones.

    Decision order: quantization off -> ignored_layers -> sensitive layer ->
    unsupported weight or shape -> no static scale -> what the lowering cannot
    take -> the tune table measured on this device (quantization_config.kernel
    auto: native, weight-only or W8A8, fx_fp8.ops.tune_table.linear_decision) ->
    quantized (W8A8, or weight-only where the device has no FP8/INT8 matrix units). Prepared QuantizedLinear calls always stay quantized (their
    original weights are gone) and are re-targeted to this compile's lowering.
    """

    name = "quantized_linear"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.qcfg = ctx.config.quantization_config
        self.on = ctx.config.linear_enabled
        self.scales = ctx.static_scales
        self.sensitive = ctx.analysis.get("sensitive", {})
        self.sensitive_prepared: list[str] = []  # prepared linears the graph finds sensitive (warned about once)
        self.ignored_prepared: list[str] = []  # prepared linears this compile's ignored_layers name
        self.alpha = self.qcfg.smoothing_alpha if self.on else None
        self.skip_mode = linear_skip_mode(ctx.step_variant) if self.on else None
        self.skipped_prepared: list[str] = []  # prepared linears run weight-only on native-skipped steps
        self.compile_quantized: list[str] = []  # unprepared linears whose weights this compile quantizes
        self.left_by_prepare: list[str] = []  # among them, those prepare_model left unreplaced (their hooks)
        # {linear name: max |x| per input channel} (raises, naming the key, when the calibration has none)
        self.channel = channel_stats(self.qcfg.activation_scales) if self.alpha is not None else None
        check_per_step_supported(self.scales, self.alpha)
        # per-step static scales: the graph reads the scale of the published step's group per call
        self.per_step = bool(getattr(self.scales, "per_step", False))

    @classmethod
    def instance_facts(cls, fc, node, module):
        """What _decide / _prepared read through the linear's name or the instance's inputs:
        the ignored_layers pattern it matches, the rules' plan for its name (sensitive name
        patterns, shape, size), whether its weight is a real tensor, whether the calibration
        has its static scale. Smoothing vectors come from each instance's own weights and
        statistics: never reused."""
        if node.op != "call_function":
            return None
        qcfg, on = fc.config.quantization_config, fc.config.linear_enabled
        if node.target in PREPARED_TARGETS:
            return ("prepared", first_match(qcfg.ignored_layers, module) if on else None)
        if node.target not in LINEAR_TARGETS:
            return None
        if on and qcfg.smoothing_alpha is not None:
            raise NotReusable("smoothing_alpha: each instance's smoothing comes from its own weights")
        args = call_args(node, ["input", "weight", "bias"], {"bias": None})
        w = meta_val(args["weight"])
        plan = (linear_plan(module, w.shape[1], w.shape[0], w.dtype, qcfg, fc.sensitive.get(node.name))
                if w is not None and w.dim() == 2 else None)
        real = real_tensor(args["weight"], fc.gm, fc.example_inputs, fc.placeholders) is not None
        scaled = fc.static_scales is None or module in fc.static_scales
        keep = model_keep_reason(fc.resolver.model() if fc.resolver is not None else None, module)
        return ("linear", first_match(qcfg.ignored_layers, module), plan, real, scaled, keep)

    def run(self, gm: torch.fx.GraphModule) -> int:
        weights = self.ctx.report.weights
        for key in ("quantized_linear_bytes_before", "quantized_linear_bytes_after"):
            weights.setdefault(key, 0)
        weights.setdefault("original_copy_kept", False)
        plan: list[Linear] = []
        matched: set[str] = set()
        disagreeing: list[str] = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in PREPARED_TARGETS:
                plan.append(self._prepared(node, disagreeing, matched))
            elif node.target in LINEAR_TARGETS:
                item = self._decide(gm, node, matched)
                if item is not None:
                    plan.append(item)
        self._check_channel_names(plan)
        groups: dict = {}
        for item in plan:
            groups.setdefault(item.group_key(), []).append(item)
        for members in groups.values():
            self._smooth(members)
        replaced: dict = {}  # a linear whose output feeds another linear is replaced first
        for n, members in enumerate(groups.values()):
            for m in members:
                m.x = replaced.get(m.x, m.x)
            self._rewrite_group(gm, members, f"g{n}:{members[0].x.name}", replaced)
        self._notes(matched, disagreeing)
        return len(plan)

    # -- decisions ---------------------------------------------------------------------------
    def _decide(self, gm, node, matched: set) -> Optional[Linear]:
        args = call_args(node, ["input", "weight", "bias"], {"bias": None})
        module = module_name(node)
        x, w = meta_val(args["input"]), meta_val(args["weight"])
        shapes, dims = f"{shape_str(x)} -> {shape_str(w)}", dims_of(x, w)
        hit = first_match(self.qcfg.ignored_layers, module)
        if hit is not None:
            matched.add(hit)
        reason = self._reason(node, args, module, x, w)
        if reason is not None:
            self.record(node, op="linear", module=module, action="native", reason=reason, shapes=shapes,
                        dims=dims)
            return None
        real_w = real_tensor(args["weight"], gm, self.ctx.example_inputs, self.ctx.placeholders)
        q = self.qcfg
        kind, why = linear_plan(module, w.shape[1], w.shape[0], w.dtype, q, self.sensitive.get(node))
        # quantization_config.kernel auto: the measured tune table of this device may keep it native or weight-only
        kind, why, timing = tune_table.linear_decision(kind, why, x, w, args["bias"] is not None, q,
                                                       self.ctx.lowering.name,
                                                       sensitive_reason(module, self.sensitive.get(node)) is not None)
        if kind == "native":
            self.record(node, op="linear", module=module, action="native", reason=why, shapes=shapes, dims=dims,
                        timing=timing)
            return None
        step_why = f"skipped step variant (quantization_config.skip_steps, {self.skip_mode})"
        if self.skip_mode == "native":
            self.record(node, op="linear", module=module, action="native", reason=step_why, shapes=shapes,
                        dims=dims)
            return None
        weights = self.ctx.report.weights
        weights["quantized_linear_bytes_before"] += real_w.numel() * real_w.element_size()
        weights["original_copy_kept"] = True
        # W8A16 sensitive layers: the storage the device's weight-only matmul takes
        recipe = WeightRecipe.weight_only(q, self.ctx.lowering) if kind == "weight_only" else WeightRecipe.w8a8(q)
        method, granularity = recipe.method, recipe.granularity
        block = recipe.block if kind == "weight_only" else q.weight_block_size
        weight_only = kind == "weight_only" or self.skip_mode == "weight_only" or self._weight_only(w, method)
        amax = None
        if self.channel is not None and not weight_only:  # smoothed: quantized per group, in _smooth
            amax = self.channel[module]
            check_channel_amax(module, amax, real_w.shape[1])
        slot = self.ctx.placeholders[args["weight"]]
        if amax is None:
            action = WeightAction(slot, node.name, recipe,
                                  static=q.activation_scheme == "static" and not weight_only)
            self.ctx.weight_actions.append(action)
            copy = apply_weight_action(action, real_w, module, q, self.scales, self.ctx.resolver)
            weights["quantized_linear_bytes_after"] += copy.wq.numel() * copy.wq.element_size() + copy.ws.numel() * 4
        item = Linear(node, module, args["input"], args["weight"], None, args["bias"], None, method=method,
                      weight_granularity=granularity, weight_block=block, act=q.act_granularity,
                      weight_only=weight_only, prepared=False, shapes=shapes, real_weight=real_w, channel_amax=amax)
        item.slot, item.recipe = slot, recipe
        item.why = why if kind == "weight_only" else (step_why if self.skip_mode else (why or ""))
        item.timing = timing
        item.dims = dims
        item.left_by_prepare = bool(self.ctx.resolver.state(slot, real_w, module).left_by_prepare)
        (self.left_by_prepare if item.left_by_prepare else self.compile_quantized).append(module)
        return item

    def _reason(self, node, args, module, x, w) -> Optional[str]:
        if not self.on:
            return "linear quantization off (quantization=None)"
        if x is None or w is None:
            return "input/weight shapes unknown at compile time"
        if w.dim() != 2:
            return f"weight of rank {w.dim()}"
        reason = linear_native_reason(module, w.shape[1], w.shape[0], w.dtype, self.qcfg, self.sensitive.get(node))
        if reason is not None:
            return reason
        reason = model_keep_reason(self.ctx.resolver.model(), module)  # as prepare_model keeps it (T5's wo)
        if reason is not None:
            return reason
        if x.dtype not in FLOAT_DTYPES:
            return f"input dtype {x.dtype} not supported"
        if real_tensor(args["weight"], self.ctx.gm, self.ctx.example_inputs, self.ctx.placeholders) is None:
            return "weight is computed inside the graph (not a parameter), cannot pre-quantize"
        if args["weight"].op != "placeholder":
            return ("weight is a constant of the graph, not one of its inputs (its quantized copy is fed as an input "
                    "derived from the weight input)")
        w8a8 = linear_plan(module, w.shape[1], w.shape[0], w.dtype, self.qcfg, self.sensitive.get(node))[0] == "quantized"
        if self.scales is not None and module not in self.scales and w8a8:
            return "no static activation scale for this layer (recalibrate)"
        if self.channel is not None and module not in self.channel and w8a8:
            return "no channel statistics for smoothing_alpha in the calibration (recalibrate with fx_fp8.calibrate)"
        return self.ctx.lowering.linear_reason(x, w, self.qcfg)

    def _weight_only(self, w, method: str) -> bool:
        qcfg = self.qcfg if method == self.qcfg.method else dataclasses.replace(self.qcfg, method=method)
        msg = self.ctx.lowering.weight_only(w, qcfg)
        if msg:
            self.ctx.warn(f"fx_fp8: {msg}: {method} linears use weight-only quantization "
                          "(quantized storage, native matmul)")
        return bool(msg)

    def _prepared(self, node, disagreeing: list, matched: set) -> Linear:
        """A QuantizedLinear made by prepare_model: it reports and runs as it was prepared."""
        args = call_args(node, PREPARED_PARAMS, {"bias": None, "input_scale": None, "input_smoothing": None})
        module = module_name(node)
        x, w = meta_val(args["x"]), meta_val(args["weight"])
        shapes, dims = f"{shape_str(x)} -> {shape_str(w)}", dims_of(x, w)
        method, wg, wb = args["method"], args["weight_granularity"], args["weight_block"]
        act = "static" if args["input_scale"] is not None else args["act_granularity"]
        q = self.qcfg
        smoothed = args["input_smoothing"] is not None
        prepared_wo = act == WEIGHT_ONLY
        why = self.sensitive.get(node)  # prepare_model without example inputs decides by name; the graph knows better
        if WEIGHT_ORIGIN in node.meta:
            pass  # a pre-quantized checkpoint's own layout: it runs as stored, nothing to disagree with
        elif prepared_wo:
            if not self.on or q.sensitive != "weight_only":
                disagreeing.append(module)
        elif ((method, wg, act, smoothed) != (q.method, q.weight_granularity, q.act_granularity,
                                              self.alpha is not None) or not self.on):
            disagreeing.append(module)
        hit = first_match(q.ignored_layers, module) if self.on else None
        if hit is not None:  # its original weight is gone: it cannot become native here
            matched.add(hit)
            self.ignored_prepared.append(f"{module} (pattern {hit!r})")
        if why is not None and not prepared_wo and q.sensitive != "fp8":
            self.sensitive_prepared.append(f"{module} ({why})")
        item = Linear(node, module, args["x"], args["weight"], args["weight_scale"], args["bias"],
                      args["input_scale"], method=method, weight_granularity=wg, weight_block=wb, act=act,
                      weight_only=prepared_wo or bool(self.skip_mode) or self._weight_only(w, method), prepared=True,
                      shapes=shapes, input_smoothing=args["input_smoothing"])
        item.dims = dims
        if prepared_wo:
            item.why = "prepared weight-only (sensitive: weight_only)"
        elif self.skip_mode == "native":  # its original weight is gone: the nearest to native it can run
            item.why = "skipped step variant (quantization_config.skip_steps, native): prepared, so weight-only"
            self.skipped_prepared.append(module)
        elif self.skip_mode:
            item.why = f"skipped step variant (quantization_config.skip_steps, {self.skip_mode})"
        # the tune table is read, not followed, here: the original weight is gone (the row says what it measured)
        ran = "weight_only" if prepared_wo else "quantized"
        kind, told, _ = tune_table.linear_decision(ran, None, x, w, args["bias"] is not None, q, self.ctx.lowering.name)
        if kind != ran:
            item.why = (f"{item.why}; " if item.why else "") + (
                f"{told}; its weights were quantized before compiling (prepare_model or a checkpoint), so it runs as "
                "they are")
        return item

    def _check_channel_names(self, plan: list[Linear]) -> None:
        """Smoothing statistics that name none of this graph's linears come from another model: an
        error, not a silently all-native graph (as check_scales_match does for static scales)."""
        if self.channel is None or any(m.channel_amax is not None for m in plan):
            return
        missing = [e.module for e in self.ctx.report.entries
                   if e.op == "linear" and e.reason.startswith("no channel statistics")]
        if missing:
            raise ValueError(f"quantization_config.smoothing_alpha: none of the {len(missing)} eligible linears of "
                             f"this graph has channel_amax statistics in the calibration (first: {missing[:3]}; the "
                             f"calibration names look like {sorted(self.channel)[:3]}): calibrate this model with "
                             "fx_fp8.calibrate")

    # -- smoothing ---------------------------------------------------------------------------
    def _smooth(self, members: list[Linear]) -> None:
        """One smoothing vector per activation-quantization group of unprepared linears:
        s = amax_x^alpha / max_over_members(|W[:, j]|)^(1 - alpha); each member's W * s is
        quantized once, now, and the Smoothing attached to its weight for run time. With
        static scales (one layer per group) the scale of the smoothed activation is
        max_j(amax_j / s_j) / qmax."""
        todo = [m for m in members if m.channel_amax is not None and not m.prepared]
        if not todo:
            return
        q = self.qcfg
        sm = group_smoothing([(m.channel_amax, m.real_weight) for m in todo], self.alpha)
        recipe = WeightRecipe.w8a8(q)
        weights = self.ctx.report.weights
        self.ctx.weight_actions.append(None)  # a group's smoothing: not redone per instance (instance_facts)
        for m in todo:
            st = self.ctx.resolver.state(m.slot, m.real_weight, m.module)
            st.smoothing[sm.alpha] = sm
            st.generation += 1
            copy = st.copy(m.real_weight, recipe, sm, check_bytes=True)
            weights["quantized_linear_bytes_after"] += copy.wq.numel() * copy.wq.element_size() + copy.ws.numel() * 4
            if m.act == "static":
                attach_static_scale(st, smoothed_static_scale(m.channel_amax, sm.inverse, q.method), None,
                                    m.real_weight.device)
            m.smoothing, m.recipe = sm, recipe

    # -- rewriting ---------------------------------------------------------------------------
    def _rewrite_group(self, gm, members: list[Linear], group: str, replaced: dict) -> None:
        graph = gm.graph
        lowering = self.ctx.lowering
        w8a8 = [m for m in members if not m.weight_only]
        first = members[0]
        xq = xs = None
        if w8a8:
            with graph.inserting_before(first.node):
                xq, xs = self._quantize(graph, first)
        for m in members:
            with graph.inserting_before(m.node):
                common = dict(method=m.method, weight_granularity=m.weight_granularity, weight_block=m.weight_block,
                              lowering=lowering.name)
                base_meta = {k: v for k, v in m.node.meta.items() if k not in ("val", "example_value")}
                wq, ws = (m.weight, m.weight_scale) if m.prepared else (self._fed(m, "wq"), self._fed(m, "ws"))
                if m.prepared and m.weight.op == "placeholder":  # checked not written, once per call
                    slot = self.ctx.placeholders.get(m.weight)
                    if slot is not None and slot not in self.ctx.feeds.prepared:
                        self.ctx.feeds.prepared.append(slot)
                if m.weight_only:
                    x = m.x  # a prepared layer's weight is W * s: its input still needs the 1/s
                    if m.input_smoothing is not None:
                        x = insert_function(graph, smooth_input, (m.x, m.input_smoothing), m.node.meta)
                    new = out = graph.call_function(torch.ops.fx_fp8.weight_only_linear.default,
                                                    (x, wq, ws, m.bias), common)
                else:
                    new = lowering.emit_gemm(graph, xq, xs, wq, ws, m.bias, out_dtype=meta_val(m.x).dtype,
                                             fast_accum=self.qcfg.fast_accum, meta=base_meta, act=m.act,
                                             weight_val=self._weight_value(m), **common)
                    out = insert_function(graph, restore_leading_dims, (new, m.x), m.node.meta)
                out.meta.update(m.node.meta)  # same value as the linear it replaces
            m.node.replace_all_uses_with(out)
            replaced[m.node] = out
            self.erase(gm, m.node)
            self.record(new, op="linear", module=m.module,
                        action="weight-only" if m.weight_only else ("fp8" if m.method == "fp8" else m.method),
                        reason=self._describe(m), shapes=m.shapes, dims=m.dims,
                        act_quant_group="" if m.weight_only else group, timing=m.timing)

    def _weight_value(self, m: Linear):
        """The quantized weight GEMM m reads (its value or fake value): shape and device."""
        if m.prepared:
            val = meta_val(m.weight)
            return val if val is not None else real_tensor(m.weight, self.ctx.gm, self.ctx.example_inputs,
                                                           self.ctx.placeholders)
        st = self.ctx.resolver.state(m.slot, m.real_weight, m.module)
        alpha = m.smoothing.alpha if m.smoothing is not None else None
        return Feed(m.slot, "wq", m.recipe, alpha).tensor(st, m.real_weight)

    def _fed(self, m: Linear, kind: str) -> torch.fx.Node:
        """The appended input carrying what the pass derived from unprepared linear m's weight."""
        alpha = m.smoothing.alpha if m.smoothing is not None and kind in ("wq", "ws", "inverse") else None
        feed = Feed(m.slot, kind, m.recipe if kind in ("wq", "ws") else None, alpha)
        st = self.ctx.resolver.state(m.slot, m.real_weight, m.module)
        return self.ctx.feeds.placeholder(feed, feed.tensor(st, m.real_weight), hint=str(m.slot))

    def _quantize(self, graph, m: Linear):
        """(xq, xs) nodes for a group's activation, at the graph's insert point."""
        lowering = self.ctx.lowering
        x = m.x
        inverse = m.input_smoothing  # a prepared layer's 1/s buffer
        if inverse is None and m.smoothing is not None:  # unprepared: its group's 1/s, an appended input
            inverse = self._fed(m, "inverse")
        if inverse is not None:  # plain torch ops before the quantization (a fused one too, on NPU)
            x = insert_function(graph, smooth_input, (m.x, inverse), m.node.meta)
        scale = m.input_scale
        if m.act == "static" and scale is None:  # unprepared: the calibrated scale, an appended input
            scale = self._fed(m, "input_scale")
            steps = self.ctx.resolver.state(m.slot, m.real_weight, m.module).input_step_scales
            if steps is not None:  # the published step's group picks its scale per call (no recompile)
                scale = graph.call_function(torch.ops.fx_fp8.step_scale.default, (self._fed(m, "step_scales"), scale),
                                            {"groups": list(steps[0])})
        group = m.weight_block[1] if m.act == "group" else 0
        if lowering.fused_activation_quant:
            node = graph.call_function(
                torch.ops.fx_fp8.quantize_activation.default, (x, scale),
                dict(method=m.method, granularity="tensor" if m.act == "static" else m.act, group=group,
                     lowering=lowering.name))
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
        name = self.ctx.lowering.name
        if m.weight_only:
            return f"{m.why + '; ' if m.why else ''}{name}: weight-only {m.method.upper()} ({w} scales), {src}"
        act = "static activations" if m.act == "static" else f"dynamic per-{m.act} activations"
        if m.act == "static" and (self.per_step if not m.prepared else _reads_step_scale(m.input_scale)):
            act = "static per-step activations"
        if m.smoothing is not None:
            act += f", smoothed (alpha {m.smoothing.alpha:g})"
        elif m.input_smoothing is not None:
            act += ", smoothed"
        gemm = self.ctx.lowering.gemm_description(m.method, m.weight_granularity, m.weight_block,
                                                  self.qcfg.fast_accum, act=m.act, weight_val=self._weight_value(m))
        return (f"{m.why + '; ' if m.why else ''}{name}: {m.method.upper()} W8A8, {w} weight scales, {act}, {src}"
                + (f"; {gemm}" if gemm else ""))

    def _notes(self, matched: set, disagreeing: list) -> None:
        report = self.ctx.report
        if self.compile_quantized:
            report.notes.append("quantized weights were made at compile time; the model still holds its original "
                                "weights (call fx_fp8.prepare_model(model, config) before torch.compile to free them)")
        if self.left_by_prepare:
            names = self.left_by_prepare
            report.notes.append(f"prepare_model left {len(names)} linear(s) unreplaced because they carry diffusers "
                                f"hooks (replacing them would lose the hooks): {', '.join(names[:8])}; their weights "
                                "are quantized at compile time and the model keeps their original weights")
        if self.on:
            unmatched = [p for p in self.qcfg.ignored_layers if p not in matched]
            if unmatched:
                self.ctx.unmatched_ignored_layers.extend(unmatched)
        if self.ignored_prepared:
            self.ctx.warn(f"fx_fp8: {len(self.ignored_prepared)} linear(s) named by ignored_layers were quantized by "
                          f"prepare_model and still run quantized (their original weights are gone): "
                          f"{', '.join(self.ignored_prepared[:8])}. Give these patterns to prepare_model's config "
                          "(or reload the original weights) to keep them native")
        if self.sensitive_prepared:
            mode = self.qcfg.sensitive
            would = "weight-only (W8A16)" if mode == "weight_only" else "native"
            self.ctx.warn(f"fx_fp8: prepare_model quantized {len(self.sensitive_prepared)} linear(s) W8A8 that this "
                          f"compile finds sensitive by the graph's structure: {', '.join(self.sensitive_prepared[:8])}; "
                          f"with quantization_config.sensitive {mode!r} they would run {would}, but prepared "
                          "linears run as prepared (W8A8). Give prepare_model example_inputs (it then finds them by "
                          "structure), or list them in quantization_config.ignored_layers when calling prepare_model")
        if self.skipped_prepared:
            self.ctx.warn(f"fx_fp8: quantization_config.skip_steps_mode is native but {len(self.skipped_prepared)} "
                          f"linear(s) were quantized by prepare_model (their original weights are gone): they run "
                          f"weight-only on the skipped steps: {', '.join(self.skipped_prepared[:8])}")
        if disagreeing:
            self.ctx.warn(f"fx_fp8: {len(disagreeing)} linear(s) were prepared by prepare_model with another method, "
                          f"granularity or activation scheme than this compile's config (or quantization is off); "
                          f"they run as prepared: {', '.join(disagreeing[:8])}")
