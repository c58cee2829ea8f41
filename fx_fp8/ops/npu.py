"""Ascend NPU lowering: FP8 attention through MindIE-SD or torch_npu, FP8 / INT8 W8A8 linears.

Attention has three device paths behind the same custom op. `attention_plan`
picks one at compile time from what is importable, the chip and the CANN
release (the report's reason says why none fits when the node stays native):

  mindiesd   MindIE-SD: Q/K rotated and smoothed as the reference does, then
             `fa_block_quant_preprocess` (torch_npu.npu_dynamic_block_quant, per-block
             FP8 e4m3) and MindIE-SD's own fused attention kernel
             (`fused_infer_attention_score_v2`, quant modes 7/7/7, BNSD). What
             vLLM-Omni calls (fx_fp8.ops.mindiesd). Ascend 950, granularity block/head/tensor.
  fia_block  torch_npu.npu_fused_infer_attention_score_v2, per-block FP8 (modes 7/7/7,
             BNSD, fp32 scales [B, N, ceil(S/128 or 256), 1]) on CANN releases that
             still accept mode 7: documented in aclnnFusedInferAttentionScoreV5 up to
             9.0.0-beta.2, refused from 9.0.0-rc.1 on (ops-transformer commit 17e3f5b9d,
             "per-block场景下线": "传入0-6之外的其他值会执行异常"). Never used where the
             installed CANN is newer, or its version cannot be read.
  fia_mx     torch_npu.npu_dynamic_mx_quant + npu_fused_infer_attention_score_v2 MXFP8
             (modes 6/6/8, TND, e8m0 block scales, CANN >= 9.1.0.pre): the case
             CANN recommends instead of mode 7 ("It is recommended to use mxfp8 full
             quantization instead", dequant_checker.cpp) and MindIE-SD's MXFP8
             attention. For `attention.granularity: mx` (fx_fp8.ops.mx is its reference).

Not used: the V5 "GQA full quant" case (modes 3/3/2): paged KV only (block table,
BnNBsD), NTD_TND only, head dim 128 only, and a value scale per head shared by the
whole batch, which none of fx_fp8's granularities (the reference numerics) is.

Linears: `npu_dynamic_quant` (one per group of linears reading the same tensor,
per-token scale) + `npu_quant_matmul` (W^T as x2, per-channel / per-tensor fp32
weight scale, per-token fp32 scale). FP8 on Ascend 950; INT8 on Atlas A2/A3 and
950. FP8 on A2/A3 runs weight-only (FP8 storage, native matmul) and says so.

torch_npu and mindiesd are imported inside the functions that call them,
never when fx_fp8 is imported: installing torch_npu breaks plain torch on
machines without CANN.

This module is the lowering (NPULowering: compile-time choices, run-time
dispatch); npu_platform reads torch_npu, the chip and CANN; npu_attention
chooses and runs the attention paths; npu_calls builds every vendor call's
arguments (the contract tests/helpers/npu_sim checks).
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from fx_fp8.graph.shapes import concrete
from fx_fp8.ops import npu_calls, quant
from fx_fp8.ops.lowering import Lowering
from fx_fp8.ops.npu_attention import KERNELS, RUNNERS, attention_plan
from fx_fp8.ops.npu_calls import KERNEL_OUT_DTYPES, MAX_MATMUL_DIM
from fx_fp8.ops.npu_platform import chip_problem, import_problem, import_torch_npu

# every name this module had before its parts moved out stays importable from here; the lowering
# calls the vendor-call builders through npu_calls, so that is where a test wraps one


class NPULowering(Lowering):
    name = "npu"
    description = (
        "Ascend NPU (torch_npu, MindIE-SD): FP8 attention and FP8 W8A8 on Ascend 950, INT8 W8A8 on Atlas A2/A3 and 950"
    )
    fused_activation_quant = True

    # compile time (FakeTensor metadata) ---------------------------------------------------
    def attention_reason(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> Optional[str]:
        plan = attention_plan(q, k, v, cfg, attn_mask, need_lse=need_lse)
        return plan.detail if plan.kernel is None else None

    def attention_kernel(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> tuple[str, str]:
        """(kernel, description) of the path an FP8 attention node takes: bake `kernel` into the
        op call (run time then follows the compile-time choice) and show the description in the
        report. Only meaningful where attention_reason returned None."""
        plan = attention_plan(q, k, v, cfg, attn_mask, need_lse=need_lse)
        return (plan.kernel or "auto"), plan.detail

    def weight_only(self, weight, qcfg) -> Optional[str]:
        problem = import_problem()
        if problem is not None:
            return problem
        if qcfg.method == "fp8":
            problem = chip_problem()
            if problem is not None:
                return f"{problem}; FP8 W8A8 needs Ascend 950 (quantization: int8 runs W8A8 on Atlas A2/A3)"
        return None

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        if self.weight_only(weight, qcfg) is not None:
            return None  # weight-only runs a native matmul: no kernel constraint applies
        if x.dtype not in KERNEL_OUT_DTYPES:
            return f"input dtype {x.dtype}: npu_quant_matmul outputs fp16/bf16 only (run the model in bf16/fp16)"
        if qcfg.weight_granularity == "block":
            return "block weight scales: npu_quant_matmul takes per-channel or per-tensor weight scales here"
        n, k = (concrete(s) for s in weight.shape)
        if n is None or k is None or k > MAX_MATMUL_DIM or n > MAX_MATMUL_DIM:
            return (
                f"features {weight.shape[1]} -> {weight.shape[0]}: npu_quant_matmul takes dims up to {MAX_MATMUL_DIM}"
            )
        return None

    # run time -------------------------------------------------------------------------------
    def attention(
        self,
        q,
        k,
        v,
        *,
        attn_mask,
        softmax_scale,
        granularity,
        q_block,
        kv_block,
        hadamard,
        smooth_k,
        quantize_p,
        p_scale,
        kernel,
        return_lse,
    ):
        if attn_mask is not None:
            raise ValueError("npu lowering: the FP8 attention kernels take no attention mask")
        if kernel not in KERNELS:  # the pass did not bake a path in: choose it now, as at compile time
            cfg = types.SimpleNamespace(
                granularity=granularity, q_block=q_block, kv_block=kv_block, quantize_p=quantize_p, p_scale=p_scale
            )
            plan = attention_plan(q, k, v, cfg, None, need_lse=return_lse)
            if plan.kernel is None:
                raise RuntimeError(f"npu lowering: no FP8 attention path: {plan.detail}")
            kernel = plan.kernel
        if (kernel == "fia_mx") != (granularity == "mx"):
            raise ValueError(f"npu lowering: kernel {kernel!r} does not run granularity {granularity!r}")
        if return_lse and kernel != "fia_mx":
            raise ValueError(f"npu lowering: kernel {kernel!r} returns no log-sum-exp")
        out, lse = RUNNERS[kernel](
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            granularity=granularity,
            q_block=q_block,
            kv_block=kv_block,
            hadamard=hadamard,
            smooth_k=smooth_k,
            p_scale=p_scale,
            return_lse=return_lse,
        )
        return (out, lse) if return_lse else out

    def quantize_activation(self, x2d, static_scale, *, method, granularity, group=None):
        if static_scale is not None:
            return quant.quantize_activation_static(x2d, static_scale, method)
        if granularity != "token" or x2d.dtype not in KERNEL_OUT_DTYPES:
            return quant.quantize_activation(x2d, granularity, method, group)  # plain torch ops
        torch_npu = import_torch_npu()
        if method == "fp8":
            xq, scale = torch_npu.npu_dynamic_quant(x2d, dst_type=quant.FP8_DTYPE)
        else:  # int8 is the op's default output, as MindIE-SD's W8A8 layers call it
            xq, scale = torch_npu.npu_dynamic_quant(x2d)
        return xq, scale.reshape(-1, 1)

    def scaled_mm(
        self, xq, x_scale, wq, w_scale, bias, *, method, weight_granularity, weight_block, out_dtype, fast_accum=False
    ):
        # prepared QuantizedLinear modules reach here without linear_reason having been asked
        if weight_granularity == "block":
            raise ValueError(
                "npu lowering: block weight scales need weight-only linears on NPU "
                "(npu_quant_matmul takes per-channel or per-tensor scales here)"
            )
        if out_dtype not in KERNEL_OUT_DTYPES:
            raise ValueError(f"npu lowering: output dtype {out_dtype} (npu_quant_matmul outputs fp16/bf16 only)")
        torch_npu = import_torch_npu()
        return torch_npu.npu_quant_matmul(
            **npu_calls.linear_call_kwargs(xq, x_scale, wq, w_scale, bias, out_dtype=out_dtype)
        )

    def weight_only_method(self, method: str) -> str:
        # npu_weight_quant_batchmatmul takes int8 (or int4 packed in int32) weights, not FP8
        return "int8"

    def weight_only_linear(self, x2d, wq, w_scale, bias, *, method, weight_granularity, weight_block):
        group = npu_calls.weight_quant_group(wq, weight_granularity, weight_block)
        if wq.dtype == torch.int8 and group is not None and x2d.dtype in KERNEL_OUT_DTYPES and x2d.shape[0] > 0:
            torch_npu = import_torch_npu()
            kwargs = npu_calls.weight_quant_call_kwargs(x2d, wq, w_scale, bias, group)
            return torch_npu.npu_weight_quant_batchmatmul(**kwargs)
        # FP8 weights, or a block layout outside the op's contract (prepared elsewhere, a W8A8 layer on a
        # skipped step, a group size that is no multiple of 32): dequantize for a native matmul
        return quant.dequantized_linear(x2d, wq, w_scale, bias, weight_granularity, weight_block)


LOWERING = NPULowering()
