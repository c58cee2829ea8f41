"""FP8 W8A8 linears: linear -> fx_fp8::fp8_linear with weights quantized once."""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from fx_fp8.passes.base import FXPass
from fx_fp8.passes.filters import first_match
from fx_fp8.passes.fx_utils import call_args, meta_val, module_name, real_tensor, shape_str
from fx_fp8.weights import quantized_weight, register_static_input_scale

LINEAR_TARGETS = {F.linear, torch._C._nn.linear, torch.ops.aten.linear.default}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WARNED_WEIGHT_ONLY: set = set()


def linear_native_reason(name: str, in_features: int, out_features: int, dtype, qcfg, patterns) -> Optional[str]:
    """Why a linear stays native, or None. Order: ignored_layers pattern, dtype, shape, size."""
    hit = first_match(patterns, name)
    if hit is not None:
        return f"ignored_layers pattern {hit!r}"
    if dtype not in FLOAT_DTYPES:
        return f"weight dtype {dtype} not supported"
    if in_features % 16 or out_features % 16:
        return f"features {in_features}->{out_features} not multiples of 16 (FP8 matmul tiles)"
    if min(in_features, out_features) < qcfg.min_features:
        return f"small layer ({in_features}->{out_features}, below min_features={qcfg.min_features}): FP8 only costs time"
    return None


class FP8LinearPass(FXPass):
    """Rewrites eligible linear nodes and re-targets prepared FP8Linear calls.

    Decision order: quantization off -> ignored_layers -> unsupported weight or
    shape -> no static scale -> what the lowering cannot take -> fp8 (W8A8, or
    weight-only where the device has no FP8 matrix units).
    """

    name = "fp8_linear"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.qcfg = ctx.config.quantization_config
        self.on = ctx.config.linear_enabled
        self.patterns, self.user_patterns = self.qcfg.effective_ignored_layers()
        self.scales = None
        if self.on and self.qcfg.activation_scheme == "static":
            from fx_fp8.calibration import load_activation_scales

            self.scales = load_activation_scales(self.qcfg.activation_scales)

    def _weight_only(self, weight) -> bool:
        msg = self.ctx.lowering.weight_only(weight)
        if msg and msg not in _WARNED_WEIGHT_ONLY:
            _WARNED_WEIGHT_ONLY.add(msg)
            warnings.warn(f"fx_fp8: {msg}: linears use weight-only FP8 (FP8 storage, native matmul)", stacklevel=2)
        return bool(msg)

    def run(self, gm: torch.fx.GraphModule) -> int:
        changed = 0
        weights = self.ctx.report.weights
        weights.setdefault("quantized_linear_bytes_before", 0)
        weights.setdefault("quantized_linear_bytes_after", 0)
        weights.setdefault("original_copy_kept", False)
        matched_patterns: set[str] = set()
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            # Dynamo records FP8Linear's call as the op packet, not the .default overload
            if node.target in (torch.ops.fx_fp8.fp8_linear.default, torch.ops.fx_fp8.fp8_linear):
                changed += self._retarget_prepared(node)
                continue
            if node.target not in LINEAR_TARGETS:
                continue
            args = call_args(node, ["input", "weight", "bias"], {"bias": None})
            module = module_name(node)
            x, w = meta_val(args["input"]), meta_val(args["weight"])
            shapes = f"{shape_str(x)} -> {shape_str(w)}"
            hit = first_match(self.patterns, module)
            if hit is not None:
                matched_patterns.add(hit)
            reason = self._reason(args, module, x, w)
            if reason is not None:
                self.record(node, op="linear", module=module, action="native", reason=reason, shapes=shapes)
                continue
            real_w = real_tensor(args["weight"], gm, self.ctx.example_inputs, self.ctx.placeholders)
            # Quantize now, once; the op finds this copy again by the weight's identity.
            wq, ws = quantized_weight(real_w, self.qcfg.weight_granularity, self.qcfg.weight_block_size)
            act = self.qcfg.activation_granularity
            if self.scales is not None:
                register_static_input_scale(real_w, self.scales[module])
                act = "static"
            weight_only = self._weight_only(w)
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(
                    torch.ops.fx_fp8.fp8_linear.default,
                    (args["input"], args["weight"], None, args["bias"], None, self.qcfg.weight_granularity,
                     list(self.qcfg.weight_block_size or []), act, weight_only, self.ctx.lowering.name),
                )
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            weights["quantized_linear_bytes_before"] += real_w.numel() * real_w.element_size()
            weights["quantized_linear_bytes_after"] += wq.numel() * wq.element_size() + ws.numel() * ws.element_size()
            weights["original_copy_kept"] = True
            self.record(new, op="linear", module=module, action="fp8", reason=self._describe(weight_only), shapes=shapes)
            changed += 1
        if weights["original_copy_kept"]:
            self.ctx.report.notes.append(
                "FP8 weights were made at compile time; the model still holds its original weights "
                "(call fx_fp8.prepare_model(model, config) before torch.compile to free them)"
            )
        if self.on and self.user_patterns:
            self.ctx.extras["unmatched_ignored_layers"] = [
                p for p in self.patterns if p not in matched_patterns and p not in _default_set()
            ]
        return changed

    def _describe(self, weight_only: bool, prepared: bool = False) -> str:
        q = self.qcfg
        w = f"{q.weight_granularity}" + (f" {list(q.weight_block_size)}" if q.weight_granularity == "block" else "")
        act = "weight-only" if weight_only else f"{q.activation_scheme} per-{q.activation_granularity} activations"
        src = "prepared FP8 weights" if prepared else "weights quantized at compile"
        return f"{self.ctx.lowering.name}: W8A8 {w} weight scales, {act}, {src}" if not weight_only else \
            f"{self.ctx.lowering.name}: weight-only FP8 ({w} scales), {src}"

    def _reason(self, args, module, x, w) -> Optional[str]:
        if not self.on:
            return "linear quantization off (quantization=None)"
        if x is None or w is None:
            return "input/weight shapes unknown at compile time"
        if w.dim() != 2:
            return f"weight of rank {w.dim()}"
        reason = linear_native_reason(module, w.shape[1], w.shape[0], w.dtype, self.qcfg, self.patterns)
        if reason is not None:
            return reason
        if x.dtype not in FLOAT_DTYPES:
            return f"input dtype {x.dtype} not supported"
        if real_tensor(args["weight"], self.ctx.gm, self.ctx.example_inputs, self.ctx.placeholders) is None:
            return "weight is computed inside the graph (not a parameter), cannot pre-quantize"
        if self.scales is not None and module not in self.scales:
            return "no static activation scale for this layer (recalibrate)"
        return self.ctx.lowering.linear_reason(x, w, self.qcfg)

    def _retarget_prepared(self, node: torch.fx.Node) -> int:
        """FP8Linear modules (prepare_model) already call fx_fp8::fp8_linear: point it at our lowering."""
        module = module_name(node)
        x, w = meta_val(node.args[0]), meta_val(node.args[1])
        shapes = f"{shape_str(x)} -> {shape_str(w)}"
        weight_only = self._weight_only(w)
        args = list(node.args)
        args[8], args[9] = weight_only, self.ctx.lowering.name
        node.args = tuple(args)
        self.record(node, op="linear", module=module, action="fp8", reason=self._describe(weight_only, prepared=True), shapes=shapes)
        return 1


def _default_set():
    from fx_fp8.config import DEFAULT_IGNORED_LAYERS

    return set(DEFAULT_IGNORED_LAYERS)
