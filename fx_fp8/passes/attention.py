"""FP8 attention: every attention form (fx_fp8/graph/forms.py) -> fx_fp8::fp8_attention
(or fp8_attention_lse). Each attention node gets a report row, rewritten or not.

The aten forms return tuples read through getitem: a node is rewritten when
only the output (index 0) is read, or the output and the log-sum-exp (index
1) in a layout fp8_attention_lse can produce; anything else stays native with
the reason.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx

from fx_fp8.config.step_variants import attention_skipped
from fx_fp8.graph.forms import AttentionForm, attention_form
from fx_fp8.graph.fx_utils import call_args, meta_val
from fx_fp8.graph.names import is_resolved, module_name
from fx_fp8.graph.shapes import scalar_value, shape_str
from fx_fp8.passes.base import FXPass
from fx_fp8.passes import attention_remedies as remedies
from fx_fp8.quant.rules import attention_call_reason, short_keys_reason
from fx_fp8.report import dims_of


def _tuple_users(node: torch.fx.Node) -> Optional[dict[int, list[torch.fx.Node]]]:
    """{index: [getitem nodes]} of a tuple-returning node, None if anything else reads it."""
    out: dict[int, list] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        out.setdefault(user.args[1], []).append(user)
    return out


class FP8AttentionPass(FXPass):
    """Rewrites eligible attention nodes; records a decision for every attention node.

    Order of the checks (the first that applies is the recorded reason):
    attention quantization off -> outputs the FP8 op cannot produce -> unsupported
    call (dropout, causal, dtype, rank, GQA, a mask that does not broadcast to
    (B, H, Sq, Sk)) -> short keys (cross-attention) -> skipped layer -> layer
    unknown while layers are skipped -> skipped step -> what the lowering cannot take -> fp8.
    """

    name = "fp8_attention"

    def __init__(self, inputs, out):
        super().__init__(inputs, out)
        self.cfg = inputs.config.attention  # config slice this pass keeps
        self.skip_layers = inputs.config.diffusion_kv_cache_skip_layers
        self.on = inputs.config.attention_enabled
        self.unknown_layer_nodes: list[str] = []

    @classmethod
    def instance_facts(cls, fc, node, module):
        """The layer selector's answer (with the layer itself when it skips: its reason names
        it) and whether the layer is known; the rest of the decision reads the graph and the
        config, the same for every instance."""
        if attention_form(node) is None:
            return None
        layer = fc.layer_map.layer_of(module)
        skipped = layer is not None and layer in fc.config.diffusion_kv_cache_skip_layers
        return ("attention", layer if skipped else None, layer is None, is_resolved(node))

    def _native_reason(self, node, form: AttentionForm, args: dict, module: str, users) -> Optional[str]:
        """Why this node stays native, ending with what the user can set to change it (or that nothing can)."""
        if not self.on:
            resolver = self.inputs.resolver
            model = resolver.model() if resolver is not None else None
            return remedies.attention_off(self.inputs.config.diffusion_kv_cache_dtype, model)
        if form.returns_tuple:
            if users is None or set(users) - {0, 1}:
                return (
                    f"{form.name} attention: outputs other than the result and log-sum-exp are read; "
                    f"{remedies.NOTHING_TO_SET}"
                )
            if 1 in users and form.lse_layout is None:
                return (
                    f"{form.name} attention: its log-sum-exp layout (padded rows) cannot be produced by the FP8 "
                    f"op; {remedies.NOTHING_TO_SET}"
                )
        q, k, v = (meta_val(args[n]) for n in ("query", "key", "value"))
        mask = meta_val(args[form.mask_param]) if form.mask_param else None
        if form.mask_param and args.get(form.mask_param) is not None and mask is None:
            return f"attention mask of unknown shape; {remedies.NOTHING_TO_SET}"
        try:
            dropout_p = scalar_value(args["dropout_p"], 0.0)
            is_causal = bool(scalar_value(args["is_causal"], False))
            scalar_value(args.get("scale"))
        except TypeError as e:
            return f"argument value unknown at compile time ({e}); {remedies.NOTHING_TO_SET}"
        reason = attention_call_reason(
            q,
            k,
            v,
            mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            enable_gqa=bool(scalar_value(args.get("enable_gqa"), False)),
        )
        if reason is not None:
            remedy = remedies.call_remedy(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
            return remedies.with_remedy(reason, remedy)
        reason = short_keys_reason(q, k, self.cfg)  # names attention.cross_attention itself
        if reason is not None:
            return reason
        layer = self.inputs.layer_map.layer_of(module)
        if layer is not None and layer in self.skip_layers:
            return f"layer {layer} in diffusion_kv_cache_skip_layers; drop {layer} from it to quantize this attention"
        if layer is None and self.skip_layers and not is_resolved(node):
            self.unknown_layer_nodes.append(f"{node.name} ({module or 'top level'})")
            return (
                f"layer unknown (module {module!r} could not be resolved to the model's name) while "
                "diffusion_kv_cache_skip_layers is set: kept native rather than guessing; drop "
                "diffusion_kv_cache_skip_layers (or compile the model itself, not a piece of it) to quantize it"
            )
        if attention_skipped(self.inputs.step_variant):
            return (
                "skipped step variant (diffusion_kv_cache_skip_steps); drop the step from "
                "diffusion_kv_cache_skip_steps to quantize this attention there"
            )
        reason = self.inputs.lowering.attention_reason(q, k, v, self.cfg, mask, need_lse=bool(users and 1 in users))
        return (
            None
            if reason is None
            else remedies.with_remedy(reason, remedies.lowering_remedy(self.inputs.lowering.name))
        )

    def run(self, gm: torch.fx.GraphModule) -> int:
        changed = 0
        for node in list(gm.graph.nodes):
            form = attention_form(node)
            if form is None:
                continue
            args = call_args(node, list(form.params), form.defaults)
            module = module_name(node)
            qkv = [meta_val(args[n]) for n in ("query", "key", "value")]
            shapes, dims = shape_str(*qkv), dims_of(*qkv)
            users = _tuple_users(node) if form.returns_tuple else None
            reason = self._native_reason(node, form, args, module, users)
            if reason is not None:
                self.record(
                    node,
                    op="attention",
                    module=module,
                    action="native",
                    reason=reason,
                    shapes=shapes,
                    dims=dims,
                    form=form.name,
                )
                continue
            q, k, v = (meta_val(args[n]) for n in ("query", "key", "value"))
            mask = meta_val(args[form.mask_param]) if form.mask_param else None
            kernel, how = self.inputs.lowering.attention_kernel(
                q, k, v, self.cfg, mask, need_lse=bool(users and 1 in users)
            )
            new = self._rewrite(gm, node, form, args, users, kernel)
            self.record(
                new,
                op="attention",
                module=module,
                action="fp8",
                reason=self._describe() + (f", {how}" if how else ""),
                shapes=shapes,
                dims=dims,
                form=form.name,
            )
            changed += 1
        if self.unknown_layer_nodes:
            self.inputs.warn(
                f"fx_fp8: diffusion_kv_cache_skip_layers cannot be applied to {len(self.unknown_layer_nodes)} "
                f"attention node(s) whose layer is unknown; they were kept native: "
                f"{', '.join(self.unknown_layer_nodes[:8])}"
            )
        return changed

    def _rewrite(self, gm, node, form: AttentionForm, args: dict, users, kernel: str) -> torch.fx.Node:
        q = meta_val(args["query"])
        scale = scalar_value(args.get("scale"))
        softmax_scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        c = self.cfg
        mask = args.get(form.mask_param) if form.mask_param else None
        want_lse = bool(users and 1 in users)
        op = torch.ops.fx_fp8.fp8_attention_lse.default if want_lse else torch.ops.fx_fp8.fp8_attention.default
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                op,
                (args["query"], args["key"], args["value"], mask, softmax_scale),
                dict(
                    granularity=c.granularity,
                    q_block=c.q_block,
                    kv_block=c.kv_block,
                    hadamard=c.hadamard,
                    smooth_k=c.smooth_k,
                    quantize_p=c.quantize_p,
                    p_scale=float(c.p_scale),
                    attention_kernel=kernel,
                    lowering=self.inputs.lowering.name,
                ),
            )
            new.meta.update(node.meta)
            if not form.returns_tuple:
                node.replace_all_uses_with(new)
            else:
                out = gm.graph.call_function(operator.getitem, (new, 0)) if want_lse else new
                for user in users.get(0, []):
                    user.replace_all_uses_with(out)
                    self.erase(gm, user)
                if want_lse:
                    lse = gm.graph.call_function(operator.getitem, (new, 1))
                    if form.lse_layout == "bhs1":
                        lse = gm.graph.call_method("unsqueeze", (lse, -1))
                    for user in users[1]:
                        user.replace_all_uses_with(lse)
                        self.erase(gm, user)
        self.erase(gm, node)
        return new

    def _describe(self) -> str:
        c = self.cfg
        desc = f"{c.granularity} scales" + (
            f" (q {c.q_block} / kv {c.kv_block} rows)" if c.granularity == "block" else ""
        )
        desc += ", Hadamard Q/K" if c.hadamard else ""
        return f"{self.inputs.lowering.name}: {desc}"
