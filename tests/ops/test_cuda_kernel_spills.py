"""Every autotune config of the FP8 attention kernel compiles for sm_90a (and the pointer path for sm_89)
without register spills and without ptxas serializing its wgmmas, checked on CPU: Triton compiles for a
GPU target without a GPU, and the ptxas Triton ships reports registers, spill stores and serialization
(`ptxas -v`). The measurements behind the config lists are in triton_fp8_attention's comment; this keeps
them true as the kernel changes."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import triton_compile  # noqa: E402  (tests/ helper; needs triton)

pytestmark = pytest.mark.slow  # ~2-3 s of compilation a config


def _ptxas():
    return triton_compile.ptxas_path()


def _spills(kernel, arch, tmp_path) -> tuple[int, int]:
    report = triton_compile.ptxas_report(kernel, arch, tmp_path)
    if report is None:
        pytest.skip("ptxas cannot assemble this PTX")
    assert triton_compile.WGMMA_SERIALIZED not in report, f"ptxas serialized the kernel's wgmmas: {report[:400]}"
    return triton_compile.registers_and_spills(report)


def _cases():
    from fx_fp8.ops.triton_fp8_attention import POINTER_CONFIGS, TILE_CANDIDATES, TMA_CONFIGS

    out = []
    for d, configs in TMA_CONFIGS.items():
        out += [pytest.param(d, c, 90, True, None, id=f"tma-sm90-d{d}-{'x'.join(map(str, c))}") for c in configs]
        # Q through a TMA descriptor too (fp8_flash_attention(q_tma=True), a candidate)
        out += [pytest.param(d, c, 90, "q", None, id=f"qtma-sm90-d{d}-{'x'.join(map(str, c))}") for c in configs]
    for d, configs in POINTER_CONFIGS.items():  # the pointer path serves sm89 (sm90 loads through TMA)
        out += [pytest.param(d, c, 89, False, None, id=f"ptr-sm89-d{d}-{'x'.join(map(str, c))}") for c in configs]
    for name, (table, pv_keys) in TILE_CANDIDATES.items():  # the tiles a GPU run measures against the default
        out += [
            pytest.param(d, c, 90, True, pv_keys, id=f"{name}-sm90-d{d}-{'x'.join(map(str, c))}")
            for d, configs in table.items()
            for c in configs
        ]
    return out


@pytest.mark.parametrize("d,config,arch,tma,pv_keys", _cases())
def test_autotune_config_does_not_spill(d, config, arch, tma, pv_keys, tmp_path):
    if _ptxas() is None:
        pytest.skip("no ptxas in this Triton install")
    bm, bn, warps, stages = config
    for flags in (dict(lse=False), dict(), dict(bias=True, lse=False), dict(bias=True)):  # every flag combination
        kernel = triton_compile.compile_attention(
            d, bm, bn, warps, stages, arch=arch, tma=bool(tma), pv_keys=pv_keys, q_tma=tma == "q", **flags
        )
        regs, spill = _spills(kernel, arch, tmp_path)
        assert spill == 0, (
            f"{config} at D={d} on sm{arch} ({'TMA' if tma else 'pointers'}, {flags}): "
            f"{regs} registers, {spill} bytes of spill stores"
        )


def _quant_cases():
    # (block rows, head dim, mode, smooth, hadamard, dot, transpose): what prepare_qkv launches for the defaults
    # (q_block 128, kv_block 256) at both head dims, and the per-head / per-tensor passes
    cases = []
    for d in (128, 64):
        cases += [
            (128, d, 0, False, True, True, False),  # Q, block scales, with the LSE smoothing term
            (256, d, 0, True, True, False, False),  # K, smoothed and rotated
            (256, d, 0, False, False, False, True),  # V, transposed
            (128, d, 1, True, True, False, False),  # amax pass (per-head / per-tensor)
            (128, d, 2, False, True, True, False),  # cast pass
            (128, d, 2, False, False, False, True),
        ]
    return [pytest.param(*c, id="-".join(map(str, c))) for c in cases]


@pytest.mark.parametrize("block,d,mode,smooth,hadamard,dot,transpose", _quant_cases())
def test_quantization_kernel_does_not_spill(block, d, mode, smooth, hadamard, dot, transpose, tmp_path):
    if _ptxas() is None:
        pytest.skip("no ptxas in this Triton install")
    from fx_fp8.ops.triton_quant import _launch_config, _quant_kernel

    rows, one_pass, warps = _launch_config(block, d, hadamard, dot=dot)
    cons = dict(
        D=d,
        ROWS=rows,
        MODE=mode,
        ONE_PASS=one_pass,
        SMOOTH=smooth,
        HADAMARD=hadamard,
        DOT=dot,
        TRANSPOSE=transpose,
        EXACT_CAST=False,
        stride_d=1,
    )  # the JIT specialises a unit stride
    types = {
        "x_ptr": "*bf16",
        "mean_ptr": "*fp32",
        "had_ptr": "*fp16",
        "out_ptr": "*fp8e4nv",
        "scale_ptr": "*fp32",
        "amax_ptr": "*fp32",
        "dvec_ptr": "*fp32",
        "dot_ptr": "*fp32",
    }
    kernel = triton_compile.compile_for_sm90(_quant_kernel, cons, types, num_warps=warps)
    regs, spill = _spills(kernel, 90, tmp_path)
    assert spill == 0, (
        f"{rows} rows x {d} ({'one pass' if one_pass else 'two passes'}, {warps} warps): "
        f"{regs} registers, {spill} bytes of spill stores"
    )


def _w8a16_cases():
    # every small-M autotune candidate, for the default weight-only storage (INT8, 1 x 32 groups) and FP8
    # per-channel scales; tile_config's larger-M tiles too
    from fx_fp8.ops.triton_w8a16 import SMALL_M_CONFIGS, full_config

    configs = sorted(set(SMALL_M_CONFIGS) | {full_config(None, m, bc) for m in (64, 300) for bc in (None, 32)})
    return [pytest.param(c, id="x".join(str(int(v)) for v in c)) for c in configs]


@pytest.mark.parametrize("config", _w8a16_cases())
def test_weight_only_kernel_does_not_spill(config, tmp_path):
    """Every W8A16 tile compiles for sm_90a without spills; the FMA form reads its weight tiles in vectors,
    never byte by byte (its speed is the weight bytes it streams)."""
    if _ptxas() is None:
        pytest.skip("no ptxas in this Triton install")
    import re

    bm, bn, bk, fma, warps, stages = config
    for int8_groups in (True, False):
        if int8_groups and not fma and 32 % bk:
            continue  # the tensor-core form's K step lies in one 32-column group
        kernel = triton_compile.compile_w8a16(config, int8_groups=int8_groups)
        regs, spill = _spills(kernel, 90, tmp_path)
        storage = "INT8, 1x32 groups" if int8_groups else "FP8, channel scales"
        assert spill == 0, f"{config} ({storage}): {regs} registers, {spill} bytes of spill stores"
        if fma:
            ptx = kernel.asm["ptx"]
            assert not re.search(r"ld\.global(\.\w+)*\.[bu]8\b", ptx), (
                f"{config} ({storage}): weights read byte by byte"
            )
            assert re.search(r"ld\.global(\.\w+)*\.v[24]\.b32", ptx), f"{config} ({storage}): no vector loads"


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize(
    "hadamard,smooth,dot,transpose",
    [(True, True, True, True), (True, True, False, True), (False, False, False, True), (True, False, True, False)],
)
def test_qkv_one_launch_kernel_does_not_spill(d, hadamard, smooth, dot, transpose, tmp_path):
    """The one-launch Q / K / V quantization (block scales, the default 128-row Q and 256-row K / V blocks)
    holds its largest branch without spills at the warps prepare_qkv launches it with."""
    if _ptxas() is None:
        pytest.skip("no ptxas in this Triton install")
    from fx_fp8.ops.triton_quant import QKV_WARPS, _launch_config, _qkv_block_kernel

    q_rows, q_one, _ = _launch_config(128, d, hadamard, False)  # the one launch takes 32-row steps
    k_rows, k_one, _ = _launch_config(256, d, hadamard, False)
    v_rows, v_one, _ = _launch_config(256, d, False, False)
    cons = dict(
        D=d,
        Q_ROWS=q_rows,
        Q_ONE_PASS=q_one,
        K_ROWS=k_rows,
        K_ONE_PASS=k_one,
        V_ROWS=v_rows,
        V_ONE_PASS=v_one,
        SMOOTH_K=smooth,
        HADAMARD=hadamard,
        DOT=dot,
        TRANSPOSE_V=transpose,
        EXACT_CAST=False,
        q_sd=1,
        k_sd=1,
        v_sd=1,
    )  # the JIT specialises unit strides
    types = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "mean_ptr": "*fp32",
        "had_ptr": "*fp16",
        "qo_ptr": "*fp8e4nv",
        "ko_ptr": "*fp8e4nv",
        "vo_ptr": "*fp8e4nv",
        "sq_ptr": "*fp32",
        "sk_ptr": "*fp32",
        "sv_ptr": "*fp32",
        "dvec_ptr": "*fp32",
        "dot_ptr": "*fp32",
    }
    kernel = triton_compile.compile_for_sm90(_qkv_block_kernel, cons, types, num_warps=QKV_WARPS)
    regs, spill = _spills(kernel, 90, tmp_path)
    assert spill == 0, f"D {d} ({cons}): {regs} registers, {spill} bytes of spill stores"
