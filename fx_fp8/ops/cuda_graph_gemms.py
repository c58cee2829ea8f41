"""The CUDA lowering's FP8 GEMMs as plain aten ops written into the graph.

Inductor then sees `aten._scaled_mm` itself (cuBLASLt, the field's FP8 GEMM): its bias and
output join Inductor's epilogues, the activation quantization before it fuses into its
producer, nothing opaque runs Python per linear per call, and CUDA graphs capture it. Each form
is a plain function of graph nodes (traced once by fx_fp8.graph.fx_utils.insert_function),
made per static choice (scale shapes, bias, output dtype, fast accumulation); the eager CUDA
lowering (fx_fp8.ops.cuda) calls the same forms:

* row-wise: activation scale per token [M, 1] (a static scalar broadcast to it), weight scale
  per output channel [N, 1] viewed as [1, N] (a per-tensor scalar broadcast to it); bf16
  output from the GEMM (cuBLASLt's row-wise kernels write bf16), bias fused;
* tensor-wise: both scales scalars (static activations, per-tensor weights); output in the
  activation dtype with the bias fused where cuBLASLt takes one (bf16 / fp16 output);
* block-wise: 1x128 activation groups x 128x128 weight blocks (sm90), rows zero-padded to a
  multiple of 4 for the scale layout; torch's block-wise path refuses fast accumulation (torch
  2.11), so it runs without.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_MM = torch.ops.aten._scaled_mm.default
ROWWISE_OUT = torch.bfloat16


@functools.lru_cache(maxsize=None)
def rowwise_gemm(xs_scalar: bool, ws_scalar: bool, has_bias: bool, out_dtype: torch.dtype, fast_accum: bool):
    """(xq, xs, wq, ws[, bias]) -> [M, N] out_dtype, one row-wise scaled cuBLASLt GEMM."""

    def scales(xq, xs, wq, ws):
        sa = xs.reshape(1, 1).expand(xq.shape[0], 1).contiguous() if xs_scalar else xs.reshape(-1, 1)
        sb = ws.reshape(1, 1).expand(1, wq.shape[0]).contiguous() if ws_scalar else ws.reshape(1, -1)
        return sa.float(), sb.float()

    def finish(out):
        return out if out_dtype == ROWWISE_OUT else out.to(out_dtype)

    if has_bias:

        def gemm(xq, xs, wq, ws, bias):
            sa, sb = scales(xq, xs, wq, ws)
            return finish(_MM(xq, wq.t(), sa, sb, bias.to(ROWWISE_OUT), None, ROWWISE_OUT, fast_accum))
    else:

        def gemm(xq, xs, wq, ws):
            sa, sb = scales(xq, xs, wq, ws)
            return finish(_MM(xq, wq.t(), sa, sb, None, None, ROWWISE_OUT, fast_accum))

    return gemm


@functools.lru_cache(maxsize=None)
def tensorwise_gemm(has_bias: bool, out_dtype: torch.dtype, fast_accum: bool):
    """(xq, xs [], wq, ws []) [+ bias] -> [M, N] out_dtype, one tensor-wise scaled GEMM."""
    fused = out_dtype in (torch.bfloat16, torch.float16)  # cuBLASLt takes no bias with fp32 output

    if has_bias:

        def gemm(xq, xs, wq, ws, bias):
            sa, sb = xs.float().reshape(1, 1), ws.float().reshape(1, 1)
            if fused:
                return _MM(xq, wq.t(), sa, sb, bias.to(out_dtype), None, out_dtype, fast_accum)
            return _MM(xq, wq.t(), sa, sb, None, None, out_dtype, fast_accum) + bias.to(out_dtype)
    else:

        def gemm(xq, xs, wq, ws):
            return _MM(
                xq, wq.t(), xs.float().reshape(1, 1), ws.float().reshape(1, 1), None, None, out_dtype, fast_accum
            )

    return gemm


def blockwise_scale_args(xs: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_a, scale_b) of torch._scaled_mm's (BlockWise1x128, BlockWise128x128) recipe from
    per-group activation scales xs [M, ceil(K/128)] and block weight scales ws [ceil(N/128), ceil(K/128)]:
    scale_a outer-dim-major (strides (1, M)), scale_b = ws^T (so that scale_b^T is ws, row-major)."""
    scale_a = xs.float().t().contiguous().t()
    scale_b = ws.float().contiguous().t()
    return scale_a, scale_b


@functools.lru_cache(maxsize=None)
def blockwise_gemm(has_bias: bool, out_dtype: torch.dtype):
    """(xq, xs [M, K/128], wq, ws [N/128, K/128][, bias]) -> [M, N] out_dtype: cuBLASLt's
    BlockWise1x128 x BlockWise128x128 recipe (scale_a outer-dim-major, scale_b = ws^T)."""
    mm_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    def core(xq, xs, wq, ws):
        m = xq.shape[0]
        pad = (-m) % 4  # the activation scales' leading dimension must be 16-byte aligned: zero rows are exact
        xq_p = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
        scale_a, scale_b = blockwise_scale_args(F.pad(xs.float(), (0, 0, 0, pad), value=1.0), ws)
        out = _MM(xq_p, wq.t(), scale_a, scale_b, None, None, mm_dtype, False)
        return out[:m].to(out_dtype)

    if has_bias:

        def gemm(xq, xs, wq, ws, bias):
            return core(xq, xs, wq, ws) + bias.to(out_dtype)
    else:

        def gemm(xq, xs, wq, ws):
            return core(xq, xs, wq, ws)

    return gemm
