"""The linear pass's decisions (fx_fp8/passes/linear.py rewrites, this module decides): each
linear's plan (fx_fp8/quant/linear_plan.py), a report row for each native one, the weight actions
a quantized one needs (fx_fp8/quant/weight_actions.py: applied by whoever planned the compile, for
every instance), one smoothing per activation-quantization group, and the notes and warnings.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx

from fx_fp8.config.patterns import first_match
from fx_fp8.config.step_variants import linear_skip_mode
from fx_fp8.graph.forms import LINEAR_TARGETS, PREPARED_PARAMS, PREPARED_TARGETS
from fx_fp8.graph.fx_utils import call_args, meta_val, real_tensor
from fx_fp8.graph.names import module_name
from fx_fp8.graph.shapes import shape_str, token_count
from fx_fp8.ops import tune_table
from fx_fp8.ops.formats import FLOAT_DTYPES, WEIGHT_ONLY
from fx_fp8.passes.base import WEIGHT_ORIGIN, NotReusable
from fx_fp8.quant.keep_fp32 import model_keep_reason, model_sensitive_reason
from fx_fp8.quant.linear_plan import QUANTIZATION_OFF, LinearPlan, native, plan_linear
from fx_fp8.quant.recipe import Smoothing, recipe
from fx_fp8.quant.rules import sensitive_reason
from fx_fp8.quant.tuned_plan import tuned_plan
from fx_fp8.quant.weight_actions import SmoothingAction, WeightAction
from fx_fp8.report import dims_of


@dataclasses.dataclass(eq=False)
class Linear:
    """One linear the pass will rewrite, and how (its plan: fx_fp8/quant/linear_plan.py)."""

    node: torch.fx.Node
    module: str
    plan: LinearPlan
    x: torch.fx.Node
    weight: torch.fx.Node
    bias: Optional[torch.fx.Node]
    act: str  # "static", or the dynamic granularity (its group key)
    shapes: str
    dims: list
    prepared: bool = False
    weight_scale: Optional[torch.fx.Node] = None  # prepared: its scale, input scale, 1/s buffer (graph nodes)
    input_scale: Optional[torch.fx.Node] = None
    input_smoothing: Optional[torch.fx.Node] = None
    real_weight: Optional[torch.Tensor] = None  # unprepared: its weight, graph input `slot`
    slot: Optional[int] = None
    smoothing: Optional[Smoothing] = None  # unprepared, smoothed: its group's (set by smooth)
    left_by_prepare: bool = False  # prepare_model left this unprepared linear (it carries diffusers hooks)
    why: str = ""  # why a layer the device could run W8A8 runs weight-only (sensitive layer, skipped step)

    @property
    def weight_only(self) -> bool:
        return self.plan.weight_only

    @property
    def method(self) -> str:
        return self.plan.recipe.method

    @property
    def weight_granularity(self) -> str:
        return self.plan.recipe.granularity

    @property
    def weight_block(self) -> list:
        return list(self.plan.recipe.block or [])

    @property
    def channel_amax(self):
        return self.plan.channel_amax

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


class LinearDecisions:
    """Every linear of one graph copy decided once, for FP8LinearPass to rewrite.

    Decision order (plan_linear's): quantization off -> ignored_layers -> sensitive layer ->
    unsupported weight or shape -> what the graph gives -> no static scale -> what the lowering
    cannot take -> the step variant -> quantized (W8A8, or weight-only where the device has no
    FP8/INT8 matrix units); then the tune table measured on this device (quantization_config.kernel
    auto: native, weight-only or W8A8, `tuned`). Prepared QuantizedLinear calls always stay quantized (their
    original weights are gone) and are re-targeted to this compile's lowering.
    """

    def __init__(self, owner):
        """`owner`: the pass (its inputs and outputs, its report rows and weight actions)."""
        self.inputs, self.out = owner.inputs, owner.out
        self.record, self.apply_weight, self.sensitive_of = owner.record, owner.apply_weight, owner.sensitive_of
        inputs = owner.inputs
        self.qcfg = inputs.config.quantization_config
        self.on = inputs.config.linear_enabled
        self.calibration = inputs.calibration
        self.alpha = self.qcfg.smoothing_alpha if self.on else None
        self.skip_mode = linear_skip_mode(inputs.step_variant) if self.on else None
        self.matched: set[str] = set()  # the ignored_layers patterns that named a linear
        self.disagreeing: list[str] = []  # prepared linears whose recipe is not this compile's
        self.sensitive_prepared: list[str] = []  # prepared linears the graph finds sensitive (warned about once)
        self.ignored_prepared: list[str] = []  # prepared linears this compile's ignored_layers name
        self.skipped_prepared: list[str] = []  # prepared linears run weight-only on native-skipped steps
        self.compile_quantized: list[str] = []  # unprepared linears whose weights this compile quantizes
        self.left_by_prepare: list[str] = []  # among them, those prepare_model left unreplaced (their hooks)

    def linears(self, gm) -> list[Linear]:
        """The linears to rewrite, in graph order (a report row for each one kept native)."""
        weights = self.out.report.weights
        for key in ("quantized_linear_bytes_before", "quantized_linear_bytes_after"):
            weights.setdefault(key, 0)
        weights.setdefault("original_copy_kept", False)
        out = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in PREPARED_TARGETS:
                out.append(self.prepared(node))
            elif node.target in LINEAR_TARGETS:
                item = self.decide(gm, node)
                if item is not None:
                    out.append(item)
        self.check_channel_names(out)
        return out

    @staticmethod
    def facts(fc, node, module):
        """What decide / prepared read through the linear's name or the instance's inputs:
        the ignored_layers pattern it matches, the plan's kind and reason for its name
        (sensitive name patterns, shape, size, its weight as a graph input, the calibration).
        Smoothing vectors come from each instance's own weights and statistics: never reused."""
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
        real = real_tensor(args["weight"], fc.gm, fc.example_inputs, fc.placeholders) is not None
        plan = (
            plan_linear(
                module,
                w.shape[1],
                w.shape[0],
                w.dtype,
                qcfg,
                sensitive=fc.sensitive.get(node.name),
                enabled=on,
                calibration=fc.calibration,
            )
            if w is not None and w.dim() == 2
            else None
        )
        model = fc.resolver.model() if fc.resolver is not None else None
        keep = model_keep_reason(model, module), model_sensitive_reason(model, module)
        return ("linear", first_match(qcfg.ignored_layers, module), plan and (plan.kind, plan.reason), real, keep)

    def decide(self, gm, node) -> Optional[Linear]:
        args = call_args(node, ["input", "weight", "bias"], {"bias": None})
        module = module_name(node)
        x, w = meta_val(args["input"]), meta_val(args["weight"])
        shapes, dims = f"{shape_str(x)} -> {shape_str(w)}", dims_of(x, w)
        hit = first_match(self.qcfg.ignored_layers, module)
        if hit is not None:
            self.matched.add(hit)
        real_w = real_tensor(args["weight"], gm, self.inputs.example_inputs, self.inputs.placeholders)
        plan = self.plan(node, args, module, x, w, real_w)
        if plan.native:
            self.record(
                node,
                op="linear",
                module=module,
                action="native",
                reason=plan.reason,
                shapes=shapes,
                dims=dims,
                timing=plan.timing or {},
            )
            return None
        if plan.warning:
            self.warn_weight_only(plan.warning, plan.recipe.method)
        weights = self.out.report.weights
        weights["quantized_linear_bytes_before"] += real_w.numel() * real_w.element_size()
        weights["original_copy_kept"] = True
        slot = self.inputs.placeholders[args["weight"]]
        if plan.channel_amax is None:  # smoothed: quantized per group, in smooth
            copy = self.apply_weight(WeightAction(slot, node.name, plan.recipe, static=plan.static))[slot]
            weights["quantized_linear_bytes_after"] += copy.wq.numel() * copy.wq.element_size() + copy.ws.numel() * 4
        left = bool(self.inputs.resolver.state(slot, real_w, module).left_by_prepare)
        (self.left_by_prepare if left else self.compile_quantized).append(module)
        return Linear(
            node,
            module,
            plan,
            args["input"],
            args["weight"],
            args["bias"],
            act=self.qcfg.act_granularity,
            shapes=shapes,
            dims=dims,
            real_weight=real_w,
            slot=slot,
            left_by_prepare=left,
            why=plan.reason or "",
        )

    def model(self):
        """The compiled model (None when the resolver does not know it)."""
        return self.inputs.resolver.model() if self.inputs.resolver is not None else None

    def sensitive_here(self, node, module: str) -> Optional[str]:
        """Why this linear is sensitive: a transformers text encoder's lm_head / vision tower
        (fx_fp8/quant/keep_fp32.py), else the graph's structural reason."""
        return model_sensitive_reason(self.model(), module) or self.sensitive_of(node)

    def plan(self, node, args, module, x, w, real_w) -> LinearPlan:
        """The linear's plan, after what only the graph can say (its values, its weight as an input)."""
        if not self.on:
            return native(QUANTIZATION_OFF)
        if x is None or w is None:
            return native("input/weight shapes unknown at compile time")
        if w.dim() != 2:
            return native(f"weight of rank {w.dim()}")
        # a transformers model's _keep_in_fp32_modules (T5's wo casts its input to its weight's dtype): native,
        # as prepare_model keeps it (a compile-time FP8 copy would disagree with the prepared model)
        keep = model_keep_reason(self.model(), module)
        sensitive = self.sensitive_here(node, module)
        graph_reason = None
        if keep is not None:
            graph_reason = keep
        elif x.dtype not in FLOAT_DTYPES:
            graph_reason = f"input dtype {x.dtype} not supported"
        elif real_w is None:
            graph_reason = "weight is computed inside the graph (not a parameter), cannot pre-quantize"
        elif args["weight"].op != "placeholder":
            graph_reason = (
                "weight is a constant of the graph, not one of its inputs (its quantized copy is fed as "
                "an input derived from the weight input)"
            )
        plan = plan_linear(
            module,
            w.shape[1],
            w.shape[0],
            w.dtype,
            self.qcfg,
            sensitive=sensitive,
            graph_reason=graph_reason,
            calibration=self.calibration,
            lowering=self.inputs.lowering,
            values=(x, w),
            step_mode=self.skip_mode,
        )
        return self.tuned(plan, module, x, w, args["bias"] is not None, sensitive)

    def tuned(self, plan: LinearPlan, module, x, w, has_bias: bool, sensitive: Optional[str]) -> LinearPlan:
        """quantization_config.kernel auto: the tune table measured on this device may keep the
        linear native or weight-only, at the graph's M (fx_fp8.quant.tuned_plan, the step
        prepare_model takes too). The report says what was measured."""
        return tuned_plan(
            plan,
            self.qcfg,
            self.inputs.lowering,
            m=token_count(x),
            k=int(w.shape[1]),
            n=int(w.shape[0]),
            dtype=str(x.dtype).replace("torch.", ""),
            device=x.device,
            has_bias=has_bias,
            sensitive=sensitive_reason(module, sensitive) is not None,
        )

    def prepared(self, node) -> Linear:
        """A QuantizedLinear made by prepare_model: it reports and runs as it was prepared."""
        args = call_args(node, PREPARED_PARAMS, {"bias": None, "input_scale": None, "input_smoothing": None})
        module = module_name(node)
        x, w = meta_val(args["x"]), meta_val(args["weight"])
        method, wg, wb = args["method"], args["weight_granularity"], args["weight_block"]
        act = "static" if args["input_scale"] is not None else args["act_granularity"]
        q = self.qcfg
        smoothed = args["input_smoothing"] is not None
        prepared_wo = act == WEIGHT_ONLY
        why = self.sensitive_here(
            node, module
        )  # prepare_model without example inputs decides by name; the graph knows better
        has_bias, lowering = args["bias"] is not None, self.inputs.lowering.name
        tuned_wo = None  # a weight-only layer that is not sensitive: the tune table's pick prepare_model followed
        if prepared_wo and self.on and WEIGHT_ORIGIN not in node.meta and sensitive_reason(module, why) is None:
            kind, told, _ = tune_table.linear_decision("quantized", None, x, w, has_bias, q, lowering)
            tuned_wo = told if kind == "weight_only" else None
        if WEIGHT_ORIGIN in node.meta:
            pass  # a pre-quantized checkpoint's own layout: it runs as stored, nothing to disagree with
        elif prepared_wo:
            if not self.on or (q.sensitive != "weight_only" and tuned_wo is None):
                self.disagreeing.append(module)
        elif (method, wg, act, smoothed) != (
            q.method,
            q.weight_granularity,
            q.act_granularity,
            self.alpha is not None,
        ) or not self.on:
            self.disagreeing.append(module)
        hit = first_match(q.ignored_layers, module) if self.on else None
        if hit is not None:  # its original weight is gone: it cannot become native here
            self.matched.add(hit)
            self.ignored_prepared.append(f"{module} (pattern {hit!r})")
        if why is not None and not prepared_wo and q.sensitive != "fp8":
            self.sensitive_prepared.append(f"{module} ({why})")
        stored = LinearPlan.stored(recipe(method, wg, tuple(wb) or None), args["act_granularity"])
        item_why = ""
        if tuned_wo is not None:
            item_why = tuned_wo
        elif prepared_wo:
            item_why = "prepared weight-only (sensitive: weight_only)"
        elif self.skip_mode == "native":  # its original weight is gone: the nearest to native it can run
            item_why = "skipped step variant (quantization_config.skip_steps, native): prepared, so weight-only"
            self.skipped_prepared.append(module)
        elif self.skip_mode:
            item_why = f"skipped step variant (quantization_config.skip_steps, {self.skip_mode})"
        if not prepared_wo and (self.skip_mode or self.device_weight_only(w, method)):
            stored = dataclasses.replace(stored, kind="weight_only", act=WEIGHT_ONLY)
        # the tune table is read, not followed, here: the original weight is gone (the row says what it measured;
        # prepare_model given example inputs followed the table already, at the same M)
        ran = "weight_only" if prepared_wo else "quantized"
        kind, told, _ = tune_table.linear_decision(ran, None, x, w, has_bias, q, lowering)
        if kind != ran and tuned_wo is None:
            item_why = (f"{item_why}; " if item_why else "") + (
                f"{told}; its weights were quantized before compiling (prepare_model or a checkpoint), so it runs as "
                "they are"
            )
        return Linear(
            node,
            module,
            stored,
            args["x"],
            args["weight"],
            args["bias"],
            act=act,
            shapes=f"{shape_str(x)} -> {shape_str(w)}",
            dims=dims_of(x, w),
            prepared=True,
            weight_scale=args["weight_scale"],
            input_scale=args["input_scale"],
            input_smoothing=args["input_smoothing"],
            why=item_why,
        )

    def device_weight_only(self, w, method: str) -> bool:
        """A prepared W8A8 layer on a device without matrix units for `method`: it runs weight-only."""
        qcfg = self.qcfg if method == self.qcfg.method else dataclasses.replace(self.qcfg, method=method)
        msg = self.inputs.lowering.weight_only(w, qcfg)
        if msg:
            self.warn_weight_only(msg, method)
        return bool(msg)

    def warn_weight_only(self, why: str, method: str) -> None:
        """The lowering runs `method` linears weight-only on this device (said once per compiled model)."""
        self.inputs.warn(
            f"fx_fp8: {why}: {method} linears use weight-only quantization (quantized storage, native matmul)"
        )

    def check_channel_names(self, plan: list[Linear]) -> None:
        """Smoothing statistics that name none of this graph's linears come from another model: an
        error, not a silently all-native graph (as check_scales_match does for static scales)."""
        channel = self.calibration.channel
        if channel is None or any(m.channel_amax is not None for m in plan):
            return
        missing = [
            e.module
            for e in self.out.report.entries
            if e.op == "linear" and e.reason.startswith("no channel statistics")
        ]
        if missing:
            raise ValueError(
                f"quantization_config.smoothing_alpha: none of the {len(missing)} eligible linears of "
                f"this graph has channel_amax statistics in the calibration (first: {missing[:3]}; the "
                f"calibration names look like {sorted(channel)[:3]}): calibrate this model with "
                "fx_fp8.calibrate"
            )

    # -- smoothing ---------------------------------------------------------------------------
    def smooth(self, members: list[Linear]) -> None:
        """One smoothing vector per activation-quantization group of unprepared linears:
        s = amax_x^alpha / max_over_members(|W[:, j]|)^(1 - alpha); each member's W * s is
        quantized once (fx_fp8/quant/weight_actions.py). With static scales (one layer per group)
        the scale of the smoothed activation is max_j(amax_j / s_j) / qmax."""
        todo = [m for m in members if m.channel_amax is not None and not m.prepared]
        if not todo:
            return
        action = SmoothingAction(
            tuple((m.slot, m.node.name) for m in todo), self.alpha, todo[0].plan.recipe, static=todo[0].act == "static"
        )
        done = self.apply_weight(action)
        weights = self.out.report.weights
        for m in todo:
            copy = done[m.slot]
            weights["quantized_linear_bytes_after"] += copy.wq.numel() * copy.wq.element_size() + copy.ws.numel() * 4
            m.smoothing = done["smoothing"]

    def notes(self) -> None:
        """The report's notes and the warnings about this graph's linears."""
        matched, disagreeing = self.matched, self.disagreeing
        report = self.out.report
        if self.compile_quantized:
            report.notes.append(
                "quantized weights were made at compile time; the model still holds its original "
                "weights (call fx_fp8.prepare_model(model, config) before torch.compile to free them)"
            )
        if self.left_by_prepare:
            names = self.left_by_prepare
            report.notes.append(
                f"prepare_model left {len(names)} linear(s) unreplaced because they carry diffusers "
                f"hooks (replacing them would lose the hooks): {', '.join(names[:8])}; their weights "
                "are quantized at compile time and the model keeps their original weights"
            )
        if self.on:
            unmatched = [p for p in self.qcfg.ignored_layers if p not in matched]
            if unmatched:
                self.out.unmatched_ignored_layers.extend(unmatched)
        if self.ignored_prepared:
            self.inputs.warn(
                f"fx_fp8: {len(self.ignored_prepared)} linear(s) named by ignored_layers were quantized by "
                f"prepare_model and still run quantized (their original weights are gone): "
                f"{', '.join(self.ignored_prepared[:8])}. Give these patterns to prepare_model's config "
                "(or reload the original weights) to keep them native"
            )
        if self.sensitive_prepared:
            mode = self.qcfg.sensitive
            would = "weight-only (W8A16)" if mode == "weight_only" else "native"
            self.inputs.warn(
                f"fx_fp8: prepare_model quantized {len(self.sensitive_prepared)} linear(s) W8A8 that this "
                f"compile finds sensitive by the graph's structure: {', '.join(self.sensitive_prepared[:8])}; "
                f"with quantization_config.sensitive {mode!r} they would run {would}, but prepared "
                "linears run as prepared (W8A8). Give prepare_model example_inputs (it then finds them by "
                "structure), or list them in quantization_config.ignored_layers when calling prepare_model"
            )
        if self.skipped_prepared:
            self.inputs.warn(
                f"fx_fp8: quantization_config.skip_steps_mode is native but {len(self.skipped_prepared)} "
                f"linear(s) were quantized by prepare_model (their original weights are gone): they run "
                f"weight-only on the skipped steps: {', '.join(self.skipped_prepared[:8])}"
            )
        if disagreeing:
            self.inputs.warn(
                f"fx_fp8: {len(disagreeing)} linear(s) were prepared by prepare_model with another method, "
                f"granularity or activation scheme than this compile's config (or quantization is off); "
                f"they run as prepared: {', '.join(disagreeing[:8])}"
            )
