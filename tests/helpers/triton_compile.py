"""Compile fx_fp8's Triton attention kernel for a GPU target on a machine without one, and read what
the compiler made of it: Triton compiles for any target without a device, and the ptxas it ships
reports registers, spills and wgmma serialization (`ptxas -v`)."""

from __future__ import annotations

import os
import re
import subprocess

import triton

#: ptxas's warning when it serializes every wgmma of a kernel (an accumulator read before its wait)
WGMMA_SERIALIZED = "C7514"


def ptxas_path():
    """A ptxas that accepts the PTX this Triton writes (Triton 3.9 writes PTX 9.x: the bundled
    ptxas-blackwell, CUDA 13, reads it), or None."""
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(base, name)
        if os.path.exists(path):
            return path
    return None


def compile_attention(
    d, bm, bn, warps, stages, *, arch=90, tma=True, bias=False, lse=True, two_level=True, pv_keys=None, q_tma=False
):
    """fx_fp8.ops.triton_fp8_attention's kernel for sm_<arch>, as the lowering launches it (FP8 P, bf16 out)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fx_fp8.ops.triton_fp8_attention import PV_KEYS, _attn_fwd_kernel

    pv_keys = PV_KEYS if pv_keys is None else pv_keys
    cons = dict(
        D=d,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_BIAS=bias,
        QUANT_P=True,
        EXACT_CAST=False,
        RETURN_LSE=lse,
        USE_TMA=tma,
        ROUND_BF16=False,
        TWO_LEVEL=two_level,
        PV_KEYS=pv_keys,
        Q_TMA=q_tma,
    )
    types = {
        "Q": "*fp8e4nv",
        "K": "*fp8e4nv",
        "VT": "*fp8e4nv",
        "SQ": "*fp32",
        "SK": "*fp32",
        "SV": "*fp32",
        "BIAS": "*fp32",
        "OUT": "*bf16",
        "LSE": "*fp32",
    }
    if tma:
        types.update(K=f"tensordesc<fp8e4nv[{bn}, {d}]>", VT=f"tensordesc<fp8e4nv[{d}, {min(bn, pv_keys)}]>")
    if q_tma:
        types.update(Q=f"tensordesc<fp8e4nv[{bm}, {d}]>")
    floats = {"qk_scale", "log2_p"}
    sig = {
        n: "constexpr" if n in cons else types.get(n, "fp32" if n in floats else "i32")
        for n in _attn_fwd_kernel.arg_names
    }
    return triton.compile(
        ASTSource(_attn_fwd_kernel, sig, constexprs=cons),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )


def compile_for_sm90(
    kernel, constexprs: dict, types: dict, *, num_warps: int, num_stages: int = 1, floats=("inv_sqrt_d",)
):
    """`kernel` for sm_90a: the named constexprs, pointer types from `types`, the other arguments
    fp32 (`floats`) or i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        n: "constexpr" if n in constexprs else types.get(n, "fp32" if n in floats else "i32") for n in kernel.arg_names
    }
    return triton.compile(
        ASTSource(kernel, sig, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )


def compile_w8a16(config, *, int8_groups: bool, arch=90):
    """fx_fp8.ops.triton_w8a16's kernel for sm_<arch> with a (BLOCK_M, BLOCK_N, BLOCK_K, FMA, warps, stages)
    config, as the JIT specialises a launch at Flux's sizes (unit K strides; pointers, N, K and row strides
    divisible by 16): INT8 codes with 1 x 32 group scales, or FP8 codes (bytes) with per-channel scales."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fx_fp8.ops.triton_w8a16 import _w8a16_kernel

    bm, bn, bk, fma, warps, stages = config
    cons = dict(
        BLOCK_ROWS=1,
        BLOCK_COLS=32 if int8_groups else 1,
        SCALE_MODE=2 if int8_groups else 1,
        W_FP8=not int8_groups,
        HAS_BIAS=True,
        DOT_F32=False,
        ROUND_BF16=False,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        FMA=bool(fma),
        stride_xk=1,
        stride_wk=1,
    )
    types = {
        "x_ptr": "*bf16",
        "w_ptr": "*i8" if int8_groups else "*u8",
        "s_ptr": "*fp32",
        "b_ptr": "*bf16",
        "out_ptr": "*bf16",
    }
    names = _w8a16_kernel.arg_names
    sig = {n: "constexpr" if n in cons else types.get(n, "i32") for n in names}
    divisible = (
        "x_ptr",
        "w_ptr",
        "s_ptr",
        "b_ptr",
        "out_ptr",
        "N",
        "K",
        "stride_xm",
        "stride_wn",
        "stride_om",
        "stride_sn",
    )
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(
        ASTSource(_w8a16_kernel, sig, constexprs=cons, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )


def ptxas_report(kernel, arch, tmp_path) -> str | None:
    """`ptxas -v`'s report (stderr) on the kernel's PTX; None when ptxas cannot assemble it."""
    ptx = tmp_path / "k.ptx"
    ptx.write_text(kernel.asm["ptx"])
    gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
    proc = subprocess.run(
        [ptxas_path(), "-v", f"--gpu-name={gpu}", str(ptx), "-o", os.devnull], capture_output=True, text=True
    )
    return proc.stderr if proc.returncode == 0 else None


def registers_and_spills(report: str) -> tuple[int, int]:
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return regs, spill
