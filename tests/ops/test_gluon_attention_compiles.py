"""The Gluon FP8 attention candidate (fx_fp8.ops.gluon_fp8_attention) compiles for sm_90a on CPU.

Gluon has no interpreter: this is all that can be checked without a GPU. Compiled with `GluonASTSource`
for sm_90a and assembled by the ptxas Triton ships: no spills, the partitions' register budgets
(setmaxnreg: consumers 232, the producer warp 40) in the PTX, the two consumer warpgroups and the
producer warp (12 warps), its wgmmas (QK^T from shared memory, P @ V with P in registers), and
ptxas's register count at launch, and that ptxas keeps its wgmmas asynchronous. Its numerics and speed wait
for a GPU (benchmarks/attention_kernels.py, cell `gluon`)."""

from __future__ import annotations

import re

import pytest

import triton_compile  # noqa: E402  (tests/ helper; needs triton)

pytestmark = pytest.mark.slow  # ~5 s of compilation a head dim


def compile_gluon_attention(d: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from fx_fp8.ops import gluon_fp8_attention as ga

    ql, kl, vl = ga.shared_layouts(d)
    types = {
        "q_desc": f"tensordesc<fp8e4nv[{ga.BLOCK_M},{d}],{ql!r}>",
        "k_desc": f"tensordesc<fp8e4nv[{ga.BLOCK_N},{d}],{kl!r}>",
        "v_desc": f"tensordesc<fp8e4nv[{d},{ga.BLOCK_N}],{vl!r}>",
        "sq_ptr": "*fp32",
        "sk_ptr": "*fp32",
        "sv_ptr": "*fp32",
        "out_ptr": "*bf16",
        "qk_scale": "fp32",
        "log2_p": "fp32",
    }
    cons = dict(
        D=d,
        BLOCK_M=ga.BLOCK_M,
        BLOCK_N=ga.BLOCK_N,
        STAGES=ga.STAGES,
        NEW_WS_API=ga.new_warp_specialize_api(),
        CONSUMER_REGS=ga.CONSUMER_REGS,
        PRODUCER_REGS=ga.PRODUCER_REGS,
    )
    sig = {n: "constexpr" if n in cons else types.get(n, "i32") for n in ga._attn_fwd_kernel.arg_names}
    return triton.compile(
        GluonASTSource(ga._attn_fwd_kernel, sig, constexprs=cons),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=4),
    )


@pytest.mark.parametrize("d", [128, 64])
def test_gluon_attention_compiles_for_sm90_without_spills(d, tmp_path):
    from fx_fp8.ops import gluon_fp8_attention as ga

    if ga.gluon_reason():
        pytest.fail(ga.gluon_reason())  # Triton >= 3.6 is a test dependency: Gluon must be there
    if triton_compile.ptxas_path() is None:
        pytest.skip("no ptxas in this Triton install")
    kernel = compile_gluon_attention(d)
    report = triton_compile.ptxas_report(kernel, 90, tmp_path)
    assert report is not None, "ptxas could not assemble the Gluon kernel"
    regs, spill = triton_compile.registers_and_spills(report)
    assert spill == 0, report[-800:]
    # 12 warps at launch (2 consumer warpgroups + the producer's, padded): 65536 / 384 threads -> 168 registers
    assert kernel.metadata.num_warps == 12 and regs == 168, (kernel.metadata.num_warps, regs)
    ptx = kernel.asm["ptx"]
    budgets = set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert {str(ga.CONSUMER_REGS), str(ga.PRODUCER_REGS)} <= budgets, budgets
    assert len(re.findall(r"wgmma\.mma_async", ptx)) > 0 and "cp.async.bulk.tensor" in ptx  # wgmma, TMA loads
    # the wgmmas stay asynchronous: ptxas serializes them when an in-flight accumulator crosses the key loop's
    # back edge (C7514: the next tile's QK^T must be waited for inside the iteration) or registers run short (C7512)
    assert triton_compile.WGMMA_SERIALIZED not in report and "C7512" not in report, report[-800:]


def test_gluon_kernel_is_a_candidate_auto_never_picks():
    from fx_fp8.ops import attention_table

    rows = attention_table.load_table()["rows"]  # every shipped tune table's attention rows
    assert rows
    assert not [r for r in rows if "gluon" in r["kernels"]], (
        "a shipped table names the Gluon kernel: auto could pick it unmeasured"
    )
