"""CUDA lowering (sm89 / sm90): torch._scaled_mm / torch._int_mm linears, Triton or cuDNN FP8 attention.

Linears (W8A8). The linear pass writes the activation quantization into the
graph as plain torch ops (`fused_activation_quant = False`), so Inductor fuses
it into the producer (norm, modulation, GELU); this lowering runs the GEMM:
* FP8, tensor / channel weight scales: `torch._scaled_mm` with tensor-wise or
  row-wise scales (bf16 output for row-wise, bias fused), `use_fast_accum`
  from quantization_config.fast_accum.
* FP8, 128 x 128 block weight scales (activations per token and per 128
  columns) on sm90: `torch._scaled_mm`'s blockwise scaling (1x128 activation
  x 128x128 weight blocks, cuBLASLt >= 12.9): scale_a [M, K/128]
  outer-dim-major, scale_b = w_scale^T [K/128, N/128]; ceil(K/128) must be a
  multiple of 4 (16-byte aligned scale rows). Anything else with block scales
  (other blocks, sm89, an older cuBLASLt) dequantizes both operands to bf16
  for a bf16 matmul, and says so once per lowering object with a warning.
* INT8: `torch._int_mm` (exact int32 accumulation; M <= 16 is zero-padded to
  17 rows, K and N must be multiples of 8), then one fused Triton rescale
  (activation scale x weight scale + bias, one rounding). Block weights: the
  bf16 dequant fallback.
GPUs without FP8 tensor cores (before sm89) run FP8 linears weight-only (FP8
storage, dequantize + native matmul); before sm80, INT8 linears too.

Weight-only (W8A16) linears (sensitive: weight_only, skipped steps, the GPUs
above): the fused Triton kernel of `triton_w8a16` (FP8 e4m3 or INT8 weights,
tensor / channel / block scales, bf16 or fp16 activations; the weight is
widened in the GEMM's tile loop, never written out in bf16). Without Triton,
with fp32 activations, FP8 weights before sm89 or block columns that are not
a multiple of 16, the whole weight is dequantized for F.linear, with a
one-time warning naming the reason.

Attention (attention.kernel):
* "auto" / "triton": Q/K/V smoothed, rotated and quantized as
  `quant.prepare_qkv` by the kernels of `triton_quant`, then the Triton FP8
  flash kernel of `triton_fp8_attention` (head dims 64 and 128, key-padding
  masks, optional LSE).
* "cudnn": cuDNN's FP8 SDPA through nvidia-cudnn-frontend (`cudnn_attention`),
  per-tensor scales only, an explicit opt-in by default (its emulated SQNR is
  below the block recipe's bar, see cudnn_attention).
* "gluon": the same pre-pass, then the FA3-style Gluon kernel of
  `gluon_fp8_attention` (sm90, head dims 64 / 128, no mask, no LSE): a candidate
  for a GPU run to measure, numerically unverified, never chosen by "auto".
"auto" resolves at compile time by the measured table of this GPU (`tune_table`: the
user's `fx-fp8 tune` table, else a shipped one; `attention_table` reads its rows:
GPU, head dim, mask, key length -> the fastest kernel within 1.5x of the
reference's error that this node can run), else to AUTO_KERNEL; the report
row names the kernel and the measurement.
Imports Triton and cuDNN lazily: the module loads on machines without them,
and every reason method reports what is missing instead of failing.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from fx_fp8.graph.shapes import broadcasts_to, concrete, size_str
from fx_fp8.ops import quant
from fx_fp8.ops.cuda_graph_gemms import blockwise_gemm, rowwise_gemm, tensorwise_gemm
from fx_fp8.ops.formats import FLOAT_DTYPES
from fx_fp8.ops.lowering import Lowering

HEAD_DIMS = (64, 128)
KEY_TILE = 64  # kv_block must be a multiple of it: every autotune config list has a key tile (BLOCK_N) dividing 64
#: attention.kernel "auto" resolves to this kernel where the measured table (attention_table) has no row
#: for the GPU / head dim / length, or none whose pick the node can run (see cudnn_attention for the
#: SQNR measurement behind the default)
AUTO_KERNEL = "triton"
#: torch._int_mm on CUDA needs more than 16 rows
INT_MM_MIN_ROWS = 17
#: the blockwise torch._scaled_mm recipe: 1 x 128 activation groups, 128 x 128 weight blocks
SCALED_MM_BLOCK = (128, 128)


def triton_reason() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install must show up as a reason, not a crash at compile time
        return f"triton not importable ({type(e).__name__}: {e})"
    return None


def capability(device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def device_reason(t, need: tuple[int, int] = (8, 9), what: str = "FP8 tensor cores") -> Optional[str]:
    """None when `t` lives on a CUDA GPU of compute capability `need` or newer."""
    if t.device.type != "cuda":
        return f"the CUDA lowering needs CUDA tensors (got device {t.device.type!r})"
    major, minor = capability(t.device)
    if (major, minor) < need:
        return f"GPU sm{major}{minor} has no {what} (needs sm{need[0]}{need[1]} or newer)"
    return None


def is_key_padding_mask(shape, b, h, s_k) -> bool:
    """True for masks broadcastable to (B, H, 1, Sk) for every value of the symbols: one row of
    keys for all queries. Never guards on symbolic sizes."""
    return len(shape) <= 4 and broadcasts_to(tuple(shape), (b, h, 1, s_k))


def resolve_kernel(kernel: str) -> str:
    """attention.kernel -> the kernel that runs ("triton", "cudnn" or "gluon")."""
    if kernel == "auto":
        return AUTO_KERNEL
    if kernel not in ("triton", "cudnn", "gluon"):
        raise ValueError(f"unknown attention kernel {kernel!r}: expected 'auto', 'triton', 'cudnn' or 'gluon'")
    return kernel


class CudaLowering(Lowering):
    name = "cuda"
    description = "CUDA sm89+/sm90: torch._scaled_mm / _int_mm linears, Triton (or cuDNN) FP8 flash attention"
    fused_activation_quant = False

    def __init__(self):
        self._warned: set[str] = set()
        self._blockwise_failed: dict[str, str] = {}  # device -> why blockwise _scaled_mm failed
        self._cudnn = None  # cudnn_attention.CudnnFP8Attention, made on first use (owns the cuDNN graphs)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- compile time (FakeTensor metadata; never specialises symbolic sizes) ------------------
    def attention_reason(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> Optional[str]:
        reason = device_reason(q)
        if reason:
            return reason
        if resolve_kernel(cfg.kernel) == "cudnn":
            from fx_fp8.ops import cudnn_attention

            reason = cudnn_attention.attention_reason(q, k, v, cfg, attn_mask, need_lse=need_lse)
            return f"attention.kernel=cudnn: {reason}" if reason else None
        reason = triton_reason()
        if reason:
            return reason
        d, dv = concrete(q.shape[-1]), concrete(v.shape[-1])
        if d not in HEAD_DIMS or dv != d:
            return (
                f"head dim {size_str(q.shape[-1])} (value {size_str(v.shape[-1])}) not supported by the "
                f"Triton FP8 kernel (needs {' or '.join(map(str, HEAD_DIMS))})"
            )
        if q.dtype not in FLOAT_DTYPES:
            return f"dtype {q.dtype} not supported by the Triton FP8 kernel"
        if cfg.granularity not in ("tensor", "head", "block"):
            return (
                f"attention.granularity {cfg.granularity!r} has no CUDA kernel (the Triton kernel takes "
                "tensor, head or block scales)"
            )
        if cfg.granularity == "block" and cfg.kv_block % KEY_TILE:
            return f"kv_block={cfg.kv_block} is not a multiple of {KEY_TILE} (the Triton kernel's key tile)"
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
                return f"attention mask dtype {attn_mask.dtype} not supported"
            if not is_key_padding_mask(attn_mask.shape, q.shape[0], q.shape[1], k.shape[2]):
                shape = ", ".join(size_str(s) for s in attn_mask.shape)
                return (
                    f"mask not supported by the Triton FP8 kernel (shape ({shape}); "
                    "only key-padding masks broadcastable to (B, H, 1, Sk))"
                )
        if cfg.kernel == "gluon":
            return self._gluon_reason(q, cfg, attn_mask, need_lse)
        if cfg.kernel == "auto":
            kernel, why = self._auto_kernel(q, k, v, cfg, attn_mask, need_lse)
            if kernel == "native":  # the measured table: native BF16 attention is faster here, and exact
                return (
                    f"attention.kernel auto: native attention is faster here ({why}); "
                    "attention.kernel: triton runs FP8 anyway"
                )
        return None  # need_lse: the kernel writes the LSE when asked

    @staticmethod
    def _gluon_reason(q, cfg, attn_mask, need_lse) -> Optional[str]:
        """What keeps a node the Triton kernel accepts from the Gluon candidate (sm90, no mask, no LSE, FP8 P,
        128-key tiles inside the K / V blocks)."""
        from fx_fp8.ops import gluon_fp8_attention

        reason = device_reason(q, (9, 0), "TMA and wgmma for the Gluon FP8 attention kernel")
        if reason:
            return f"attention.kernel=gluon: {reason}"
        reason = gluon_fp8_attention.attention_reason(
            concrete(q.shape[-1]), masked=attn_mask is not None, need_lse=need_lse
        )
        if reason is None and not cfg.quantize_p:
            reason = "the Gluon FP8 attention kernel quantizes P (attention.quantize_p: false needs triton)"
        if reason is None and cfg.granularity == "block" and cfg.kv_block % gluon_fp8_attention.BLOCK_N:
            reason = (
                f"kv_block={cfg.kv_block} is not a multiple of the Gluon kernel's "
                f"{gluon_fp8_attention.BLOCK_N}-key tile"
            )
        return f"attention.kernel=gluon: {reason}" if reason else None

    def _auto_kernel(self, q, k, v, cfg, attn_mask, need_lse) -> tuple[str, str]:
        """attention.kernel "auto" by the measured table (attention_table): (kernel or "native", why)."""
        from fx_fp8.ops import attention_table

        def runnable(name: str) -> bool:  # attention_reason checked the default (Triton) kernel already
            if name in (AUTO_KERNEL, "native"):
                return True
            if name == "cudnn":
                from fx_fp8.ops import cudnn_attention

                return cudnn_attention.attention_reason(q, k, v, cfg, attn_mask, need_lse=need_lse) is None
            return False

        table = attention_table.rows_for(q.device)  # the user's tune table, else the shipped one of this GPU
        if table is None and concrete(k.shape[2]) is not None:  # a symbolic length runs the default anyway
            from fx_fp8.ops.tune_table import UNMEASURED

            return AUTO_KERNEL, f"{UNMEASURED}: {AUTO_KERNEL} by default"
        return attention_table.auto_kernel(
            attention_table.gpu_name(q.device),
            concrete(q.shape[-1]),
            concrete(k.shape[2]),
            attn_mask is not None,
            AUTO_KERNEL,
            runnable,
            table or {"rows": []},
        )

    def attention_kernel(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> tuple[str, str]:
        """(kernel baked into the op, report text) for a node attention_reason accepted: "auto"
        resolves here, at compile time, by the measured table (attention_table), else to AUTO_KERNEL."""
        kernel, why = resolve_kernel(cfg.kernel), ""
        if cfg.kernel == "auto":
            kernel, why = self._auto_kernel(q, k, v, cfg, attn_mask, need_lse)
        how = {
            "cudnn": "cuDNN FP8 SDPA, per-tensor scales, FP8 output",
            "gluon": "Gluon FA3-style FP8 kernel (a candidate: numerically unverified)",
        }.get(kernel, "Triton FP8 kernel")
        if cfg.kernel == "auto":
            how += f" (attention.kernel: auto; {why})"
        return kernel, how + (", LSE" if need_lse else "")

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        if x.device.type != "cuda":
            return f"the CUDA lowering needs CUDA tensors (got device {x.device.type!r})"
        if self.weight_only(weight, qcfg) is not None:
            return None  # weight-only runs a native matmul: no GEMM constraint applies
        n, k = (concrete(s) for s in weight.shape)
        if n is None or k is None:
            return f"symbolic weight shape {size_str(weight.shape[0])}x{size_str(weight.shape[1])}"
        if x.dtype not in FLOAT_DTYPES:
            return f"input dtype {x.dtype} not supported"
        if qcfg.method == "int8":
            if k % 8 or n % 8:
                return f"features {k}->{n} not multiples of 8 (torch._int_mm)"
            return triton_reason()  # the fused INT8 rescale is a Triton kernel
        if k % 16 or n % 16:
            return f"features {k}->{n} not multiples of 16 (torch._scaled_mm)"
        return None

    def weight_only(self, weight, qcfg) -> Optional[str]:
        if weight.device.type != "cuda":
            return None  # linear_reason keeps it native
        if qcfg.method == "int8":
            return device_reason(weight, (8, 0), "INT8 tensor cores for torch._int_mm")
        return device_reason(weight, (8, 9), "FP8 tensor cores")

    # -- run time: attention -------------------------------------------------------------
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
        if resolve_kernel(kernel) == "cudnn":
            return self.cudnn_attention().attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                softmax_scale=softmax_scale,
                granularity=granularity,
                hadamard=hadamard,
                smooth_k=smooth_k,
                quantize_p=quantize_p,
                p_scale=p_scale,
                return_lse=return_lse,
            )
        from fx_fp8.ops import triton_quant
        from fx_fp8.ops.triton_fp8_attention import fp8_flash_attention, key_bias

        if q.device.type != "cuda" and not triton_quant.interpreting():
            raise RuntimeError(f"fx_fp8 CUDA lowering got tensors on {q.device}; use lowering='reference' off-GPU")
        qq, sq, kq, sk, vt, sv, shift = triton_quant.prepare_qkv(
            q,
            k,
            v,
            granularity=granularity,
            q_block=q_block,
            kv_block=kv_block,
            hadamard=hadamard,
            smooth_k=smooth_k,
            lse_shift=return_lse,
        )
        if resolve_kernel(kernel) == "gluon":  # attention_reason let only maskless, LSE-free FP8-P nodes through
            from fx_fp8.ops import gluon_fp8_attention

            return gluon_fp8_attention.fp8_flash_attention(
                qq,
                sq,
                kq,
                sk,
                vt,
                sv,
                s_q=q.shape[2],
                s_k=k.shape[2],
                softmax_scale=softmax_scale,
                q_block=q_block,
                kv_block=kv_block,
                p_scale=p_scale,
                out_dtype=q.dtype,
            )
        b, h, s_q, _ = q.shape
        bias = key_bias(attn_mask, b, h, k.shape[2])
        res = fp8_flash_attention(
            qq,
            sq,
            kq,
            sk,
            vt,
            sv,
            s_q=s_q,
            s_k=k.shape[2],
            softmax_scale=softmax_scale,
            q_block=q_block,
            kv_block=kv_block,
            quantize_p=quantize_p,
            p_scale=p_scale,
            out_dtype=q.dtype,
            bias=bias,
            return_lse=return_lse,
        )
        return add_smoothing_shift(res, shift, softmax_scale) if return_lse else res

    def cudnn_attention(self):
        if self._cudnn is None:
            from fx_fp8.ops.cudnn_attention import CudnnFP8Attention

            self._cudnn = CudnnFP8Attention()
        return self._cudnn

    # -- run time: linears ---------------------------------------------------------------
    def scaled_mm(
        self, xq, x_scale, wq, w_scale, bias, *, method, weight_granularity, weight_block, out_dtype, fast_accum=False
    ):
        if method == "int8":
            if weight_granularity == "block":
                self._warn_once(
                    "int8-block",
                    "fx_fp8 CUDA: INT8 linears with block weight scales have no "
                    "torch._int_mm path; they dequantize to bf16 and run a bf16 matmul (slow)",
                )
                return block_fallback_matmul(xq, x_scale, wq, w_scale, weight_block, bias, out_dtype)
            return int8_matmul(xq, x_scale, wq, w_scale, bias, out_dtype)
        if weight_granularity == "block":
            return self._block_scaled_mm(xq, x_scale, wq, w_scale, weight_block, bias, out_dtype)
        return scaled_mm(xq, x_scale, wq, w_scale, bias, out_dtype, fast_accum=fast_accum)

    # -- compile time: FP8 GEMMs written into the graph as aten ops ------------------------------
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
        form = self._graph_gemm(
            method, weight_granularity, weight_block, out_dtype, fast_accum, act, weight_val, bias is not None
        )
        if form is None:  # INT8, or block scales torch's block-wise GEMM cannot take: the opaque op
            return super().emit_gemm(
                graph,
                xq,
                xs,
                wq,
                ws,
                bias,
                method=method,
                weight_granularity=weight_granularity,
                weight_block=weight_block,
                out_dtype=out_dtype,
                fast_accum=fast_accum,
                lowering=lowering,
                meta=meta,
            )
        from fx_fp8.graph.fx_utils import insert_function

        args = (xq, xs, wq, ws) + ((bias,) if bias is not None else ())
        return insert_function(graph, form, args, meta)

    def _graph_gemm(self, method, weight_granularity, weight_block, out_dtype, fast_accum, act, weight_val, has_bias):
        if method != "fp8":
            return None
        if weight_granularity == "block":
            k = weight_val.shape[1] if weight_val is not None else None
            device = weight_val.device if weight_val is not None else None
            if act != "group" or k is None or self.blockwise_reason(device, weight_block, int(k)) is not None:
                return None
            return blockwise_gemm(has_bias, out_dtype)
        xs_scalar = act in ("static", "tensor")
        ws_scalar = weight_granularity == "tensor"
        return _scale_shape_gemm(xs_scalar, ws_scalar, has_bias, out_dtype, fast_accum)

    def gemm_description(
        self, method, weight_granularity, weight_block, fast_accum, act="token", weight_val=None
    ) -> str:
        form = self._graph_gemm(
            method, weight_granularity, weight_block, torch.bfloat16, fast_accum, act, weight_val, False
        )
        if form is None:
            return (
                "torch._int_mm + fused rescale (opaque op)"
                if method == "int8"
                else "block-scaled GEMM through the opaque op (torch's block-wise _scaled_mm cannot take it)"
            )
        if weight_granularity == "block":
            return "cuBLASLt block-wise torch._scaled_mm in the graph (fast accumulation off: torch refuses it there)"
        scales = "tensor-wise" if act in ("static", "tensor") and weight_granularity == "tensor" else "row-wise"
        return (
            f"cuBLASLt torch._scaled_mm in the graph ({scales} scales, "
            f"{'fast' if fast_accum else 'exact'} accumulation)"
        )

    def blockwise_reason(self, device, weight_block, k: int) -> Optional[str]:
        """None when torch._scaled_mm's blockwise scaling (1x128 x 128x128) can run this GEMM, else why not."""
        if tuple(weight_block) != SCALED_MM_BLOCK:
            return (
                f"weight_block_size {list(weight_block)} (blockwise torch._scaled_mm takes "
                f"{SCALED_MM_BLOCK[0]}x{SCALED_MM_BLOCK[1]} weight blocks)"
            )
        major, minor = capability(device)
        if major != 9:
            return f"GPU sm{major}{minor} (blockwise torch._scaled_mm runs on sm90 only)"
        k_blocks = -(-k // 128)
        if k_blocks % 4:
            return f"in_features {k}: ceil(K / 128) = {k_blocks} is not a multiple of 4 (16-byte aligned scale rows)"
        return self._blockwise_failed.get(str(device))

    def _block_scaled_mm(self, xq, xs, wq, ws, weight_block, bias, out_dtype):
        reason = self.blockwise_reason(xq.device, weight_block, xq.shape[1])
        if reason is None and xs.numel() == 1:  # a static per-tensor scale: the same scale for every 1x128 group
            xs = xs.reshape(1, 1).expand(xq.shape[0], -(-xq.shape[1] // SCALED_MM_BLOCK[1]))
        if reason is None:
            try:
                return blockwise_scaled_mm(xq, xs, wq, ws, bias, out_dtype)
            except (RuntimeError, NotImplementedError) as e:  # e.g. cuBLASLt < 12.9: remember, fall back
                if torch.cuda.is_current_stream_capturing():
                    raise  # never change paths inside a CUDA graph capture (eager warm-up runs first)
                reason = f"torch._scaled_mm blockwise failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                self._blockwise_failed[str(xq.device)] = reason
        if reason is not None:
            self._warn_once(
                f"block-fallback:{reason}",
                f"fx_fp8 CUDA: FP8 linears with block weight scales run a bf16 dequant fallback "
                f"(slow, numerically exact) because of {reason}",
            )
        return block_fallback_matmul(xq, xs, wq, ws, weight_block, bias, out_dtype)

    def fused_weight_only_reason(self, x2d, wq, weight_granularity, weight_block) -> Optional[str]:
        """None when the fused W8A16 Triton kernel (triton_w8a16) runs this weight-only linear, else why not."""
        reason = triton_reason()
        if reason:
            return reason
        from fx_fp8.ops import triton_quant, triton_w8a16

        if x2d.device.type != "cuda":
            if not triton_quant.interpreting():
                return f"tensors on {x2d.device.type} (the fused W8A16 kernel runs on CUDA)"
        else:
            need = (8, 9) if wq.dtype == torch.float8_e4m3fn else (8, 0) if x2d.dtype == torch.bfloat16 else (7, 0)
            major, minor = capability(x2d.device)
            if (major, minor) < need:
                return (
                    f"GPU sm{major}{minor} (the fused W8A16 kernel needs sm{need[0]}{need[1]} for "
                    f"{wq.dtype} weights and {x2d.dtype} activations)"
                )
        return triton_w8a16.fit_reason(x2d, wq, weight_granularity, weight_block)

    def weight_only_linear(self, x2d, wq, w_scale, bias, *, method, weight_granularity, weight_block):
        reason = self.fused_weight_only_reason(x2d, wq, weight_granularity, weight_block)
        if reason is None:
            from fx_fp8.ops.triton_w8a16 import w8a16_linear

            return w8a16_linear(
                x2d, wq, w_scale, bias, weight_granularity=weight_granularity, weight_block=weight_block
            )
        self._warn_once(
            f"w8a16:{reason}",
            "fx_fp8 CUDA: weight-only linears run unfused (the whole weight "
            f"dequantized, then a native matmul: more memory traffic) because of {reason}",
        )
        return unfused_weight_only_linear(x2d, wq, w_scale, bias, weight_granularity, weight_block)


def add_smoothing_shift(res, shift, softmax_scale: float):
    """(out, lse) with what K smoothing took from the scores added back to the lse (as the reference's
    quant.smoothing_lse_shift): the lse of the unsmoothed scores, what ring attention merges."""
    out, lse = res
    if shift is not None:
        lse = lse + shift * softmax_scale
    return out, lse


# -- GEMMs ---------------------------------------------------------------------------------
def _scale_shape_gemm(xs_scalar: bool, ws_scalar: bool, has_bias: bool, out_dtype, fast_accum: bool):
    """The tensor-wise GEMM when both scales are scalars, else the row-wise one."""
    if xs_scalar and ws_scalar:
        return tensorwise_gemm(has_bias, out_dtype, fast_accum)
    return rowwise_gemm(xs_scalar, ws_scalar, has_bias, out_dtype, fast_accum)


def scaled_mm(xq, xs, wq, ws, bias, out_dtype, *, fast_accum: bool = True):
    """torch._scaled_mm for tensor / channel weight scales with per-token ([M, 1]) or scalar ([])
    activation scales: the graph's forms (fx_fp8.ops.cuda_graph_gemms) run eagerly."""
    gemm = _scale_shape_gemm(xs.numel() == 1, ws.numel() == 1, bias is not None, out_dtype, fast_accum)
    return gemm(xq, xs, wq, ws) if bias is None else gemm(xq, xs, wq, ws, bias)


def blockwise_scaled_mm(xq, xs, wq, ws, bias, out_dtype):
    """FP8 x FP8 with 1x128 activation and 128x128 weight block scales in one cuBLASLt call (sm90),
    without fast accumulation (torch's block-wise path refuses it): the graph's form run eagerly."""
    gemm = blockwise_gemm(bias is not None, out_dtype)
    return gemm(xq, xs, wq, ws) if bias is None else gemm(xq, xs, wq, ws, bias)


def int8_matmul(xq, xs, wq, ws, bias, out_dtype):
    """int8 x int8 -> int32 on tensor cores (torch._int_mm, exact), then one fused rescale:
    (acc * x_scale) * w_scale + bias, rounded once to out_dtype. _int_mm needs more than 16 rows:
    fewer are zero-padded (exact)."""
    from fx_fp8.ops.triton_quant import int8_rescale

    m = xq.shape[0]
    a = xq.contiguous()
    if m < INT_MM_MIN_ROWS:
        a = F.pad(a, (0, 0, 0, INT_MM_MIN_ROWS - m))
    acc = torch._int_mm(a, wq.t())  # wq [N, K] row-major: its transpose is the column-major operand cuBLASLt wants
    if m < INT_MM_MIN_ROWS:
        acc = acc[:m]
    return int8_rescale(acc, xs, ws, bias, out_dtype)


def unfused_weight_only_linear(x2d, wq, w_scale, bias, weight_granularity, weight_block):
    """The fallback of the fused W8A16 kernel: dequantize the whole weight to x's dtype, F.linear."""
    w = quant.dequantize_weight(wq, w_scale, weight_granularity, weight_block).to(x2d.dtype)
    return F.linear(x2d, w, bias.to(x2d.dtype) if bias is not None else None)


def block_fallback_matmul(xq, xs, wq, ws, weight_block, bias, out_dtype):
    """Block weight scales without a blockwise GEMM: both operands dequantized to bf16 (activations
    per token and per group of weight_block[1] columns), a bf16 matmul with fp32 accumulation.
    Matches the reference up to bf16 rounding of the dequantized values (2^-9), far below the
    quantization error; a numerics-correct slow path, not a speed path."""
    x = quant.dequantize_activation(xq, xs, group=weight_block[1]).to(torch.bfloat16)
    w = quant.dequantize_weight(wq, ws, "block", weight_block).to(torch.bfloat16)
    out = F.linear(x, w, bias.to(torch.bfloat16) if bias is not None else None)
    return out.to(out_dtype)


LOWERING = CudaLowering()
