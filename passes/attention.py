"""FP8 attention: scaled_dot_product_attention -> fx_fp8::fp8_attention."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from fx_fp8.passes.base import FXPass
from fx_fp8.passes.fx_utils import call_args, meta_val, module_name, shape_str

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                torch.ops.aten.scaled_dot_product_attention.default}
SDPA_PARAMS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _broadcastable(shape, target) -> bool:
    shape = (1,) * (len(target) - len(shape)) + tuple(shape)
    return all(int(a) == 1 or int(a) == int(b) for a, b in zip(shape, target))


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


class FP8AttentionPass(FXPass):
    """Rewrites eligible SDPA nodes; records a decision for every SDPA node.

    Order of the checks (the first that applies is the recorded reason):
    attention quantization off -> unsupported call (dropout, causal, dtype,
    rank, GQA, a mask that does not broadcast to (B, H, Sq, Sk)) -> cross-attention -> skipped layer -> skipped step ->
    what the lowering cannot take -> fp8.
    """

    name = "fp8_attention"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cfg = ctx.config.attention           # config slice this pass keeps
        self.skip_layers = ctx.config.diffusion_kv_cache_skip_layers
        self.on = ctx.config.attention_enabled

    def reason_native(self, args: dict, module: str) -> Optional[str]:
        if not self.on:
            return f"attention quantization off (diffusion_kv_cache_dtype={self.ctx.config.diffusion_kv_cache_dtype!r})"
        q, k, v = (meta_val(args[n]) for n in ("query", "key", "value"))
        if q is None or k is None or v is None:
            return "query/key/value shapes unknown at compile time"
        if isinstance(args["dropout_p"], torch.fx.Node) or args["dropout_p"] != 0.0:
            return f"dropout_p={args['dropout_p']} (FP8 attention is inference-only)"
        if args["is_causal"] is not False:
            return "is_causal=True not supported by the FP8 kernels"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return f"expected 4-D (B, H, S, D) inputs, got ranks {q.dim()}/{k.dim()}/{v.dim()}"
        if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            return f"dtype {q.dtype}/{k.dtype}/{v.dtype} not supported (need one of fp32/bf16/fp16)"
        if q.shape[1] != k.shape[1]:
            return f"grouped-query attention ({q.shape[1]} query heads, {k.shape[1]} kv heads) not supported"
        if q.shape[-1] != k.shape[-1] or k.shape[2] != v.shape[2]:
            return "query/key head dims or key/value lengths differ"
        mask = args["attn_mask"]
        if mask is not None:
            m = meta_val(mask)
            if m is None or m.dim() > 4 or not _broadcastable(m.shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2])):
                return f"attention mask of shape {tuple(m.shape) if m is not None else '?'} not broadcastable to (B, H, Sq, Sk)"
            if m.dtype != torch.bool and m.dtype not in FLOAT_DTYPES:
                return f"attention mask dtype {m.dtype} not supported"
        if q.shape[2] != k.shape[2] and not self.cfg.cross_attention:
            return f"cross-attention (query length {q.shape[2]} != key length {k.shape[2]}); set attention.cross_attention: true to quantize it"
        layer = self.ctx.layer_map.layer_of(module)
        if layer is not None and layer in self.skip_layers:
            return f"layer {layer} in diffusion_kv_cache_skip_layers"
        if self.ctx.step_variant == "native":
            return "skipped step variant (diffusion_kv_cache_skip_steps)"
        return self.ctx.lowering.attention_reason(q, k, v, self.cfg, meta_val(args["attn_mask"]))

    def run(self, gm: torch.fx.GraphModule) -> int:
        changed = 0
        lowering = self.ctx.lowering.name
        for node in list(gm.graph.nodes):
            if not is_sdpa(node):
                continue
            args = call_args(node, SDPA_PARAMS, SDPA_DEFAULTS)
            module = module_name(node)
            q, k, v = (meta_val(args[n]) for n in ("query", "key", "value"))
            shapes = shape_str(q, k, v)
            reason = self.reason_native(args, module)
            if reason is not None:
                self.record(node, op="attention", module=module, action="native", reason=reason, shapes=shapes)
                continue
            scale = args["scale"]
            softmax_scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            c = self.cfg
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(
                    torch.ops.fx_fp8.fp8_attention.default,
                    (args["query"], args["key"], args["value"], args["attn_mask"], softmax_scale, c.granularity, c.q_block,
                     c.kv_block, c.hadamard, c.smooth_k, c.quantize_p, float(c.p_scale), lowering),
                )
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            desc = f"{c.granularity} scales" + (f" (q {c.q_block} / kv {c.kv_block} rows)" if c.granularity == "block" else "")
            desc += ", Hadamard Q/K" if c.hadamard else ""
            self.record(new, op="attention", module=module, action="fp8", reason=f"{lowering}: {desc}", shapes=shapes)
            changed += 1
        return changed
