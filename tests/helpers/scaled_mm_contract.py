"""A CPU stand-in for CUDA's `torch._scaled_mm`: it refuses what the CUDA op refuses and computes
what it computes, so the graphs the CUDA lowering builds run on CPU.

The rules are torch's, read from two places (nothing here comes from fx_fp8):

* `torch/_meta_registrations.py` (`_check_scaled_mm_sizes`, the installed torch): 2-D fp8 operands,
  mat1 row-major and mat2 column-major on CUDA, K and both dims of mat2 multiples of 16, fp32 scales;
  tensor-wise = both scales one element; row-wise = scale_a (M, 1) and scale_b (1, N), contiguous;
  (BlockWise1x128, BlockWise128x128) = scale_a (M, ceil(K/128)), scale_b (ceil(K/128), ceil(N/128)).
* `aten/src/ATen/native/cuda/ScaledBlas.cpp` (`_scaled_mm_out_cuda`, `get_joint_scaling`,
  `is_blockwise_1x128_scaling`, `is_blockwise_128x128_scaling`, `_check_deepseek_support`): the
  strides of the block scales (scale_a outer-dim-major, strides (1, M); scale_b.t() row-major),
  bias of N elements, no bias with fp32 output, bias bf16 / fp16 matching a bf16 / fp16 output,
  no e5m2 x e5m2, scale_result a float scalar, block scales on sm90 only.

Two rules come from cuBLASLt rather than torch's checks, and say so in their message: a block
scale's outer stride must be 16-byte aligned (M a multiple of 4 floats), and cuBLASLt's block-scaled
FP8 GEMM has no fast-accumulation mode (torch 2.11 refused `use_fast_accum=True` there).

Values: the operands dequantized with their scales (float64), multiplied, the bias added, rounded
once to out_dtype. Every call is recorded (`ScaledMM.calls`): which recipe, out_dtype, bias dtype,
use_fast_accum, so a test can check the flags a graph passes, not only its values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK = 128


class ScaledMMContractError(RuntimeError):
    """An argument CUDA's torch._scaled_mm would refuse."""


@dataclass
class Call:
    recipe: str  # "tensorwise", "rowwise" or "block_1x128_128x128"
    m: int
    k: int
    n: int
    out_dtype: torch.dtype
    bias_dtype: torch.dtype | None
    use_fast_accum: bool


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ScaledMMContractError(f"torch._scaled_mm (CUDA) would refuse this call: {message}")


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) > t.stride(1)


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) > 1


def _size_stride(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    """ScaledBlas.cpp's check_size_stride: the stride of a dimension of size 1 is not checked."""
    return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)


def recipe_of(a, b, scale_a, scale_b) -> str:
    """The scaling recipe get_joint_scaling picks for FP8 operands and fp32 scales, or an error."""
    m, k = a.shape
    n = b.shape[1]
    kb, nb = math.ceil(k / BLOCK), math.ceil(n / BLOCK)
    _need(
        scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32,
        f"scales must be float32 for FP8 operands, got {scale_a.dtype} and {scale_b.dtype}",
    )
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    _need(
        scale_a.dim() == 2 and scale_b.dim() == 2,
        f"non-tensor-wise scales must be 2-D, got shapes {tuple(scale_a.shape)} and {tuple(scale_b.shape)}",
    )
    if tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        _need(
            scale_a.is_contiguous() and scale_b.is_contiguous(),
            f"row-wise scales must be contiguous, got strides {scale_a.stride()} and {scale_b.stride()}",
        )
        return "rowwise"
    sbt = scale_b.t()
    if (
        _size_stride(scale_a, 0, m, 1)
        and _size_stride(scale_a, 1, kb, m)
        and _size_stride(sbt, 0, nb, kb)
        and _size_stride(sbt, 1, kb, 1)
    ):
        return "block_1x128_128x128"
    raise ScaledMMContractError(
        "torch._scaled_mm (CUDA) would refuse this call: invalid scaling configuration for "
        f"a {tuple(a.shape)} x {tuple(b.shape)} product: scale_a {tuple(scale_a.shape)} strides {scale_a.stride()}, "
        f"scale_b {tuple(scale_b.shape)} strides {scale_b.stride()} (tensor-wise: both one element; row-wise: "
        f"scale_a ({m}, 1), scale_b (1, {n}); block 1x128 x 128x128: scale_a ({m}, {kb}) strides (1, {m}), "
        f"scale_b ({kb}, {nb}) with scale_b.t() row-major)"
    )


def _dequantized(t: torch.Tensor, scale: torch.Tensor, recipe: str, side: str) -> torch.Tensor:
    x = t.to(torch.float64)
    s = scale.to(torch.float64)
    if recipe == "tensorwise":
        return x * s.reshape(())
    if recipe == "rowwise":
        return x * s  # (M, 1) against a (M, K); (1, N) against a (K, N)
    if side == "a":  # 1x128 groups along K: s [M, K/128]
        return x * s.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    # 128x128 blocks of b [K, N]: s [K/128, N/128]
    full = s.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return x * full[: x.shape[0], : x.shape[1]]


class ScaledMM:
    """Callable with aten._scaled_mm.default's signature; `sm` is the GPU's compute capability."""

    def __init__(self, sm: tuple[int, int] = (9, 0)):
        self.sm = sm
        self.calls: list[Call] = []
        self.__name__ = self.__qualname__ = "scaled_mm_stand_in"  # what torch.fx's codegen names a target by

    def __call__(self, a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        _need(a.dim() == 2 and b.dim() == 2, f"operands must be 2-D, got {a.dim()}-D and {b.dim()}-D")
        _need(a.shape[1] == b.shape[0], f"shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
        _need(a.dtype in FP8 and b.dtype in FP8, f"operands must be float8, got {a.dtype} and {b.dtype}")
        _need(not (a.dtype == b.dtype == torch.float8_e5m2), "two float8_e5m2 operands")
        _need(_row_major(a) or 0 in a.shape, f"mat1 must be row-major, got strides {a.stride()}")
        _need(_col_major(b) or 0 in b.shape, f"mat2 must be column-major, got strides {b.stride()}")
        m, k = a.shape
        n = b.shape[1]
        _need(k % 16 == 0, f"K = {k} must be a multiple of 16")
        _need(b.shape[0] % 16 == 0 and n % 16 == 0, f"mat2 {tuple(b.shape)}: both dims must be multiples of 16")
        _need(
            scale_result is None or (scale_result.numel() == 1 and scale_result.dtype == torch.float32),
            "scale_result must be a float scalar",
        )
        out_dtype = out_dtype or a.dtype
        recipe = recipe_of(a, b, scale_a, scale_b)
        if recipe.startswith("block"):
            _need(self.sm[0] == 9, f"block scales run on sm90 only (this GPU: sm{self.sm[0]}{self.sm[1]})")
            _need(
                m % 4 == 0,
                f"block scale_a's outer stride M = {m} must be a multiple of 4 floats "
                "(cuBLASLt: 16-byte aligned scale rows)",
            )
            _need(
                not use_fast_accum,
                "use_fast_accum=True with block scales (cuBLASLt's block-scaled FP8 "
                "GEMM has no fast accumulation; torch 2.11 refused it)",
            )
        if bias is not None:
            _need(bias.numel() == n, f"bias must have {n} elements, got {bias.numel()}")
            _need(out_dtype != torch.float32, "bias is not supported when out_dtype is float32")
            _need(bias.dtype in (torch.bfloat16, torch.float16), f"bias must be bf16 or fp16, got {bias.dtype}")
            _need(
                out_dtype != torch.bfloat16 or bias.dtype == torch.bfloat16,
                f"bias must be bf16 for bf16 output, got {bias.dtype}",
            )
            _need(
                out_dtype != torch.float16 or bias.dtype == torch.float16,
                f"bias must be fp16 for fp16 output, got {bias.dtype}",
            )
        self.calls.append(Call(recipe, m, k, n, out_dtype, None if bias is None else bias.dtype, bool(use_fast_accum)))
        out = _dequantized(a, scale_a, recipe, "a") @ _dequantized(b, scale_b, recipe, "b")
        if bias is not None:
            out = out + bias.to(torch.float64)
        return out.to(out_dtype)


SCALED_MM = torch.ops.aten._scaled_mm.default


def run_with_stand_in(gm: torch.fx.GraphModule, stand_in: ScaledMM) -> int:
    """Point every aten._scaled_mm node of `gm` at `stand_in` (in place); returns how many."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == SCALED_MM:
            node.target = stand_in
            n += 1
    gm.recompile()
    return n
