"""The lowering registry: which implementation runs behind the custom ops.

The passes pick a lowering name at compile time and bake it into each custom
op call, so the NPU lowering can also run on CPU tensors under the contract
simulator in the tests. Device modules are imported only when asked for.

A lowering answers two kinds of question:
* at compile time, on FakeTensor metadata: can this node run here, and if not
  why (`attention_reason`, `linear_reason`, `weight_only`); it must not
  specialise symbolic sizes (use fx_fp8.graph.shapes);
* at run time, on real tensors: the kernels (`attention`, `quantize_activation`,
  `scaled_mm`, `weight_only_linear`).

Activation quantization: when `fused_activation_quant` is False (CPU reference,
CUDA) the linear pass writes the quantization into the graph as plain torch
ops (fx_fp8.ops.quant), so the downstream compiler fuses it into the producer
(norm, modulation, GELU); when True (NPU) it emits one opaque
`fx_fp8::quantize_activation` call, which runs the device's fused kernel.
Either way one quantization serves every linear that reads the same tensor.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

_MODULES = {
    "reference": "fx_fp8.ops.reference",
    "cuda": "fx_fp8.ops.cuda",
    "npu": "fx_fp8.ops.npu",
}


class Lowering:
    """Interface of a lowering module's `LOWERING` object.

    Conventions shared by every lowering (the CPU reference defines the numerics):
    * attention inputs are (B, H, S, D); `return_lse` asks for the natural-log
      log-sum-exp of the scaled scores too, fp32 (B, H, Sq), -inf for a fully
      masked row (whose output is 0);
    * `method` is "fp8" (float8_e4m3fn) or "int8" (symmetric int8);
    * activation scales are fp32 [M, 1] (per token), [] (per tensor / static) or
      [M, ceil(K / weight_block[1])] (per group, with block weight scales);
      weight scales fp32 [N, 1] (channel), [] (tensor) or [ceil(N/br), ceil(K/bc)] (block).
    """

    name = "base"
    description = ""
    fused_activation_quant = False

    # -- compile time -------------------------------------------------------------------
    def attention_reason(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> Optional[str]:
        return None

    def attention_kernel(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> tuple[str, str]:
        """(kernel, description) for an attention node attention_reason accepted: the kernel name
        is baked into the op call (so the choice is made once, at compile time) and the
        description goes into the report row ("" when there is nothing to add)."""
        return cfg.kernel, ""

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        return None

    def weight_only(self, weight, qcfg) -> Optional[str]:
        """A message when linears of this method must be weight-only on this device, else None."""
        return None

    def weight_only_method(self, method: str) -> str:
        """The storage ("fp8" / "int8") of a weight-only (W8A16) layer of a `method` config: the
        one this device's weight-only matmul takes."""
        return method

    # -- run time -----------------------------------------------------------------------
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
        raise NotImplementedError

    def quantize_activation(self, x2d, static_scale, *, method, granularity, group=None):
        """(xq [M, K], scale): only called when fused_activation_quant is True. granularity
        "token" / "tensor" / "group" (per token and per `group` columns, for block weights)."""
        raise NotImplementedError

    def scaled_mm(
        self, xq, x_scale, wq, w_scale, bias, *, method, weight_granularity, weight_block, out_dtype, fast_accum=False
    ):
        """xq [M, K] x wq [N, K]^T with scales -> [M, N] out_dtype (+ bias). Block weights come
        with per-group activation scales [M, ceil(K / weight_block[1])]. fast_accum: the
        CUDA FP8 GEMM's faster, less exact accumulation (ignored where it does not exist)."""
        raise NotImplementedError

    def weight_only_linear(self, x2d, wq, w_scale, bias, *, method, weight_granularity, weight_block):
        raise NotImplementedError

    # -- compile time: the GEMM written into the graph ------------------------------------------
    def emit_gemm(
        self,
        graph,
        xq,
        xs,
        wq,
        ws,
        bias,
        *,
        method,
        weight_granularity,
        weight_block,
        out_dtype,
        fast_accum,
        lowering,
        meta,
        act="token",
        weight_val=None,
    ):
        """The [M, N] node computing xq (quantized [M, K], scale xs) x wq ([N, K], scale ws) + bias
        at the graph's insert point (`act`: the activation scales' granularity, "static" for a
        calibrated scalar; `weight_val`: wq's value or fake value, for its shape and device). By default the opaque fx_fp8::scaled_mm op, which runs this
        lowering's `scaled_mm`; a lowering whose GEMM the downstream compiler should see writes
        plain (aten) ops instead."""
        node = graph.call_function(
            torch.ops.fx_fp8.scaled_mm.default,
            (xq, xs, wq, ws, bias),
            dict(
                method=method,
                weight_granularity=weight_granularity,
                weight_block=weight_block,
                out_dtype=out_dtype,
                fast_accum=fast_accum,
                lowering=lowering,
            ),
        )
        node.meta.update(meta)
        return node

    def gemm_description(
        self, method: str, weight_granularity: str, weight_block, fast_accum: bool, act="token", weight_val=None
    ) -> str:
        """What runs the GEMM emit_gemm writes, for the report ("" when nothing worth saying)."""
        return ""


def get_lowering(name: str) -> Lowering:
    """The LOWERING object of a lowering module (imported on first use; Python caches modules)."""
    if name not in _MODULES:
        raise ValueError(f"unknown lowering {name!r}: expected one of {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[name]).LOWERING


def npu_available() -> bool:
    """True when torch_npu is importable and a device is present. Never imports it eagerly at module load."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False
    try:
        return bool(npu.is_available())
    except Exception:  # a half-installed torch_npu must not break the CPU path
        return False


def resolve_lowering_name(requested: str, device: torch.device | None) -> str:
    """'auto' -> by device type of the graph's tensors; otherwise as requested."""
    if requested != "auto":
        return requested
    dev = device.type if device is not None else "cpu"
    if dev == "cuda":
        return "cuda"
    if dev in ("npu", "privateuseone"):
        return "npu"
    return "reference"
