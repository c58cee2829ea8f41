"""The CUDA lowering's Triton kernels run on CPU in Triton's interpreter, against the reference numerics.

TRITON_INTERPRET is read when kernels are decorated, so the checks run in one
subprocess with the variable set (the kernels of this process stay GPU kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import triton  # noqa: F401,E402  a test dependency (pyproject [test]): fail, never skip, if missing

pytestmark = pytest.mark.slow  # Triton's CPU interpreter is slow: the whole file runs in the full suite (CI)

SCRIPT = r"""
import json, math
import torch
import torch.nn.functional as F
from fx_fp8.ops import quant
from fx_fp8.ops import triton_quant as tq
from fx_fp8.ops import triton_fp8_attention as ta
from fx_fp8.ops.cuda import LOWERING as C
from fx_fp8.ops.reference import LOWERING as R

torch.manual_seed(0)
res = {}
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

def code_diff(a, r):
    # mismatching e4m3 codes, and the largest distance in e4m3 steps (codes of one sign are ordered)
    a8, r8 = a.contiguous().view(torch.uint8).int(), r.contiguous().view(torch.uint8).int()
    return int((a8 != r8).sum()), int((a8 - r8).abs().max()) if a8.numel() else 0

# -- Q/K/V quantization: transposed (non-contiguous) Q, smoothed K with an outlier channel --------
b, h, s, d = 1, 2, 300, 64
q = torch.randn(b, s, h, d).bfloat16().transpose(1, 2)
k = torch.randn(b, h, s, d) * 2 + 0.5
k[..., 5] *= 20
k, v = k.bfloat16(), torch.randn(b, h, s, d).bfloat16()
for gran in ("block", "head", "tensor"):
    qq, sq, kq, sk, vt, sv, shift = tq.prepare_qkv(q, k, v, granularity=gran, q_block=128, kv_block=256,
                                                   hadamard=True, smooth_k=True, lse_shift=True)
    ref = quant.prepare_qkv(q, k, v, granularity=gran, q_block=128, kv_block=256, hadamard=True, smooth_k=True)
    ours = (qq[:, :, :s], sq, kq[:, :, :s], sk, vt[..., :s].transpose(-1, -2), sv)
    res[f"qkv_{gran}"] = {
        "codes": [code_diff(a, r) for a, r in zip(ours[0::2], ref[0::2])],
        "n": q.numel(),
        "scale_shapes": [list(a.shape) == list(r.shape) for a, r in zip(ours[1::2], ref[1::2])],
        "scale_rel": max(((a - r).abs() / r).max().item() for a, r in zip(ours[1::2], ref[1::2])),
        "padding_absmax": max(qq[:, :, s:].float().abs().max().item(), kq[:, :, s:].float().abs().max().item(),
                              vt[..., s:].float().abs().max().item()),
        "shift_rel": rel(shift, quant.smoothing_lse_shift(q, k, 1.0)),
    }
# unpadded, untransposed layouts (the cuDNN path)
qq, sq, kq, sk, vq, sv, _ = tq.prepare_qkv(q, k, v, granularity="tensor", q_block=1, kv_block=1, hadamard=True,
                                           smooth_k=True, pad=False, transpose_v=False)
ref = quant.prepare_qkv(q, k, v, granularity="tensor", q_block=1, kv_block=1, hadamard=True, smooth_k=True)
res["qkv_unpadded"] = {"shapes": [list(t.shape) for t in (qq, kq, vq)],
                       "codes": [code_diff(a, r) for a, r in zip((qq, kq, vq), ref[0::2])]}
# a block too large to hold in registers (512 x 128): the two-pass path
k2 = (torch.randn(1, 1, 700, 128) * 3).bfloat16()
kq2, sk2, _ = tq.quantize_heads(k2, granularity="block", block=512, mean=tq.token_mean(k2), hadamard=True)
rk2, rs2 = quant.quantize_rows_in_blocks(quant.hadamard_rotate(k2.float() - k2.float().mean(2, keepdim=True)),
                                          "block", 512)
res["two_pass"] = {"one_pass": tq._launch_config(512, 128, True)[1], "codes": code_diff(kq2[:, :, :700], rk2),
                   "n": k2.numel(), "scale_rel": ((sk2 - rs2).abs() / rs2).max().item()}

# -- attention --------------------------------------------------------------------------------
def attn(name, bq, hq, sq_, sk_, d_, gran, quant_p, mask=None, kv_block=256, lse=False):
    q = torch.randn(bq, hq, sq_, d_).bfloat16()
    k = torch.randn(bq, hq, sk_, d_).bfloat16()
    v = (torch.randn(bq, hq, sk_, d_) + 0.5).bfloat16()
    kw = dict(attn_mask=mask, softmax_scale=1 / math.sqrt(d_), granularity=gran, q_block=128, kv_block=kv_block,
              hadamard=True, smooth_k=True, quantize_p=quant_p, p_scale=448.0, kernel="auto", return_lse=lse)
    out, r = C.attention(q, k, v, **kw), R.attention(q, k, v, **kw)
    entry = {}
    if lse:
        (out, l), (r, rl) = out, r
        fin = torch.isfinite(rl)
        entry.update(lse_maxabs=(l[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0,
                     lse_inf_match=bool(torch.equal(torch.isneginf(l), torch.isneginf(rl))),
                     lse_shape=list(l.shape), lse_dtype=str(l.dtype))
    exact_mask = mask.double() if mask is not None and mask.dtype != torch.bool else mask  # SDPA wants one dtype
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=exact_mask)
    exact = torch.nan_to_num(exact)  # SDPA gives NaN for fully masked rows; the FP8 ops give 0
    entry.update(vs_reference=rel(out, r), err=rel(out, exact), ref_err=rel(r, exact), shape=list(out.shape),
                 finite=bool(torch.isfinite(out).all()), dtype=str(out.dtype))
    res[name] = entry
    return out, r

# one key tile: the running max is the final max, so the kernel is the reference up to exp2 / bf16 rounding
attn("one_tile", 1, 2, 100, 64, 64, "block", True, kv_block=64)
attn("multi_tile", 1, 2, 200, 300, 64, "block", True, lse=True)
keep = torch.ones(2, 1, 1, 300, dtype=torch.bool)
keep[0, ..., -70:] = False
keep[1, ..., :140] = False  # whole leading key tiles masked: must not turn into NaN
attn("key_padding", 2, 1, 130, 300, 64, "block", True, mask=keep, lse=True)
attn("head_scales_fp16_p", 1, 2, 130, 260, 64, "head", False, lse=True)
attn("head_dim_128", 1, 1, 64, 128, 128, "tensor", True, lse=True)
# a batch whose keys are all masked: O = 0 and lse = -inf, as the reference
none = torch.ones(2, 1, 1, 200, dtype=torch.bool)
none[1] = False
out, r = attn("fully_masked", 2, 2, 70, 200, 64, "block", True, mask=none, lse=True)
res["fully_masked"]["masked_rows_zero"] = bool((out[1] == 0).all()) and bool((r[1] == 0).all())
# an additive float key mask with -inf entries, as SDPA takes it
fmask = torch.zeros(1, 1, 1, 200)
fmask[..., 150:] = float("-inf")
fmask[..., :50] = -2.0
attn("float_key_mask", 1, 2, 90, 200, 64, "block", True, mask=fmask, lse=True)

# through the custom ops, as the attention pass emits them (lowering "cuda")
import fx_fp8  # noqa: F401  registers torch.ops.fx_fp8

q, k, v = (torch.randn(1, 2, 150, 64).bfloat16() for _ in range(3))
opkw = dict(granularity="block", q_block=128, kv_block=256, hadamard=True, smooth_k=True, quantize_p=True,
            p_scale=448.0, attention_kernel="triton")
o, l = torch.ops.fx_fp8.fp8_attention_lse(q, k, v, None, 0.125, lowering="cuda", **opkw)
ro, rl = torch.ops.fx_fp8.fp8_attention_lse(q, k, v, None, 0.125, lowering="reference", **opkw)
o1 = torch.ops.fx_fp8.fp8_attention(q, k, v, None, 0.125, lowering="cuda", **opkw)
res["custom_ops"] = {"vs_reference": rel(o, ro), "lse_maxabs": (l - rl).abs().max().item(),
                     "same_without_lse": bool(torch.equal(o, o1)), "lse_shape": list(l.shape)}

# every autotune config's (BLOCK_M, BLOCK_N) once, with the LSE, through both load paths
torch.manual_seed(1)
q, k, v = (torch.randn(1, 2, 260, 128).bfloat16() for _ in range(3))
v = v + 0.5
kw = dict(granularity="block", q_block=128, kv_block=256, hadamard=True, smooth_k=False)
pre = tq.prepare_qkv(q, k, v, **kw)
ref_out, ref_lse = R.attention(q, k, v, attn_mask=None, softmax_scale=1 / math.sqrt(128), quantize_p=True,
                               p_scale=448.0, kernel="auto", return_lse=True, **kw)
exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
res["configs"] = {}
for i, (bm, bn, w, st) in enumerate(ta.CONFIGS):
    o, l = ta.fp8_flash_attention(*pre[:6], s_q=260, s_k=260, softmax_scale=1 / math.sqrt(128), q_block=128,
                                  kv_block=256, return_lse=True, config=(bm, bn, w, 1), use_tma=i % 2 == 0)
    res["configs"][f"{bm}x{bn}"] = {"vs_reference": rel(o, ref_out), "err": rel(o, exact),
                                    "ref_err": rel(ref_out, exact), "lse_maxabs": (l - ref_lse).abs().max().item(),
                                    "tma": i % 2 == 0}

# -- INT8 GEMM: torch._int_mm + the fused rescale (also below _int_mm's 17 rows) --------------------
for m in (5, 40):
    x = torch.randn(m, 256) * 3
    w = torch.randn(96, 256) / 16
    bias = torch.randn(96).bfloat16()
    xq, xs = quant.quantize_per_row(x, "int8")
    wq, ws = quant.quantize_weight(w, "channel", method="int8")
    kw = dict(method="int8", weight_granularity="channel", weight_block=None, out_dtype=torch.bfloat16)
    ours = C.scaled_mm(xq, xs, wq, ws, None, **kw)
    ref = R.scaled_mm(xq, xs, wq, ws, None, **kw)
    ours_b = C.scaled_mm(xq, xs, wq, ws, bias, **kw)
    ref_b = R.scaled_mm(xq, xs, wq, ws, bias, **kw)
    # in units of 2^-7 x the largest of product, bias and sum (one to two bf16 steps): the reference rounds
    # the product, then the sum; the fused epilogue rounds once
    ulp = (torch.maximum(torch.maximum(ref.float().abs(), bias.float().abs()), ref_b.float().abs())
           * 2 ** -7).clamp_min(1e-6)
    res[f"int8_m{m}"] = {"exact_no_bias": bool(torch.equal(ours, ref)), "shape": list(ours.shape),
                         "bias_max_ulps": ((ours_b.float() - ref_b.float()).abs() / ulp).max().item()}
xq, xs = quant.quantize_per_tensor(torch.randn(40, 256), "int8")
wq, ws = quant.quantize_weight(torch.randn(64, 256), "tensor", method="int8")
kw = dict(method="int8", weight_granularity="tensor", weight_block=None, out_dtype=torch.float32)
res["int8_scalar_scales_exact"] = bool(torch.equal(C.scaled_mm(xq, xs, wq, ws, None, **kw),
                                                   R.scaled_mm(xq, xs, wq, ws, None, **kw)))

# -- weight-only (W8A16): the fused dequant + GEMM kernel, through the lowering ----------------------
import warnings
torch.manual_seed(2)
wo_cases = [("fp8", "channel", None, 5, torch.bfloat16, True), ("fp8", "tensor", None, 40, torch.bfloat16, False),
            ("fp8", "block", (1, 32), 5, torch.bfloat16, True), ("fp8", "block", (128, 128), 70, torch.float16, True),
            ("int8", "channel", None, 70, torch.float16, False), ("int8", "block", (1, 32), 1, torch.bfloat16, True)]
for method, gran, blk, m, dt, with_bias in wo_cases:
    x = (torch.randn(m, 2 * 200) * 2).to(dt)[:, ::2]  # K = 200 (not a tile multiple), strided rows
    w = torch.randn(96, 200) / 8
    w[3] *= 50  # a loud channel: per-channel / per-group scales must not leak into the others
    bias = torch.randn(96).to(dt) if with_bias else None
    wq, ws = quant.quantize_weight(w, gran, blk, method)
    kw = dict(method=method, weight_granularity=gran, weight_block=blk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = C.weight_only_linear(x, wq, ws, bias, **kw)
    ref = R.weight_only_linear(x, wq, ws, bias, **kw)
    exact = x.double() @ quant.dequantize_weight(wq, ws, gran, blk).double().t()
    if bias is not None:
        exact = exact + bias.double()
    res[f"wo_{method}_{gran}_{blk[1] if blk else 0}_m{m}"] = {
        "fused": not any("unfused" in str(c.message) for c in caught), "shape": list(ours.shape),
        "dtype": str(ours.dtype), "want_dtype": str(dt), "vs_reference": rel(ours, ref), "err": rel(ours, exact),
        "ref_err": rel(ref, exact)}

# -- weight-only, few rows: every candidate the GPU autotuner may pick (both forms) --------------------
from fx_fp8.ops import triton_w8a16 as tw
for method, gran, blk in [("int8", "block", (1, 32)), ("fp8", "channel", None), ("fp8", "block", (128, 128)),
                          ("fp8", "tensor", None)]:
    for m in (1, 3):
        x = (torch.randn(m, 2 * 200) * 2).bfloat16()[:, ::2]
        w = torch.randn(96, 200) / 8
        w[3] *= 50
        bias = torch.randn(96).bfloat16()
        wq, ws = quant.quantize_weight(w, gran, blk, method)
        exact = x.double() @ quant.dequantize_weight(wq, ws, gran, blk).double().t() + bias.double()
        bc = blk[1] if blk else None
        kw = dict(weight_granularity=gran, weight_block=blk)
        old = tw.w8a16_linear(x, wq, ws, bias, config=tw.full_config(None, m, bc), **kw)
        res[f"small_m_{method}_{gran}_m{m}"] = {
            "old_err": rel(old, exact),
            "candidates": {"x".join(str(int(v)) for v in c): rel(tw.w8a16_linear(x, wq, ws, bias, config=c, **kw), exact)
                           for c in tw.small_m_candidates(m, bc)}}

# -- the small-M autotuner end to end: prune, key, timing, the picked config's launch -----------------------
tuned = tw._w8a16_small_m_tuned
timed = []


def fake_bench(fn, quantiles):  # runs each candidate once (interpreter); later candidates "time" faster
    fn()
    timed.append(1)
    return [10.0 - len(timed)] * 3


tuned.__dict__["do_bench"] = fake_bench  # instead of CUDA-event timing (the cached property's slot)
real_uses = tw.uses_autotuner
tw.uses_autotuner = lambda m, **kw: True
xt = (torch.randn(1, 2 * 200) * 2).bfloat16()[:, ::2]
wt = torch.randn(96, 200) / 8
wqt, wst = quant.quantize_weight(wt, "block", (1, 32), "int8")
bt = torch.randn(96).bfloat16()
kwt = dict(weight_granularity="block", weight_block=(1, 32))
yt = tw.w8a16_linear(xt, wqt, wst, bt, **kwt)
exact_t = xt.double() @ quant.dequantize_weight(wqt, wst, "block", (1, 32)).double().t() + bt.double()
best = tuned.best_config
n_timed = len(timed)
tw.w8a16_linear(xt, wqt, wst, bt, **kwt)  # the same key: no new timing
tw.uses_autotuner = real_uses
res["autotuned"] = {"timed": n_timed, "timed_again": len(timed) - n_timed,
                    "candidates": ["x".join(str(int(v)) for v in c) for c in tw.small_m_candidates(1, 32)],
                    "best": "x".join(str(int(v)) for v in tw.candidate_of(best)),
                    "err": rel(yt, exact_t)}

# -- block scales: Q, K and V in one launch, bit for bit what three per-tensor launches write ----------
fused_same = []
for (bb, hh, sqq, skk, dd) in [(1, 2, 300, 300, 64), (2, 1, 130, 700, 128), (1, 2, 5, 260, 64)]:
    q3 = torch.randn(bb, sqq, hh, dd).bfloat16().transpose(1, 2)
    k3 = (torch.randn(bb, hh, skk, dd) * 2 + 0.5).bfloat16()
    v3 = torch.randn(bb, hh, skk, dd).bfloat16()
    for tv, pad in ((True, True), (False, False)):
        for had, smooth, lse in ((True, True, True), (False, False, False), (True, False, True)):
            fused = tq.prepare_qkv(q3, k3, v3, granularity="block", q_block=128, kv_block=256, hadamard=had,
                                   smooth_k=smooth, lse_shift=lse, transpose_v=tv, pad=pad, one_launch=True)
            mean = tq.token_mean(k3) if smooth else None
            kw3 = dict(granularity="block", pad=pad)
            qq3, sq3, sh3 = tq.quantize_heads(q3, block=128, hadamard=had, row_dot=mean if lse and smooth else None,
                                              **kw3)
            kq3, sk3, _ = tq.quantize_heads(k3, block=256, mean=mean, hadamard=had, **kw3)
            vq3, sv3, _ = tq.quantize_heads(v3, block=256, transpose=tv, **kw3)
            for a, c in zip(fused, (qq3, sq3, kq3, sk3, vq3, sv3, sh3)):
                if a is None or c is None:
                    fused_same.append(a is None and c is None)
                else:
                    fused_same.append(a.shape == c.shape and torch.equal(a.view(torch.uint8) if a.dtype == quant.FP8_DTYPE
                                                                         else a, c.view(torch.uint8)
                                                                         if c.dtype == quant.FP8_DTYPE else c))
res["qkv_one_launch_same"] = fused_same
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("gran", ["block", "head", "tensor"])
def test_qkv_quantization_matches_reference(results, gran):
    r = results[f"qkv_{gran}"]
    # the same FP8 codes up to fp32 summation order (the rotation's dot products): a rare value may sit on
    # a rounding boundary and move by one e4m3 step
    for mismatches, max_steps in r["codes"]:
        assert mismatches <= 1e-4 * r["n"] and max_steps <= 1, r
    assert all(r["scale_shapes"]), r
    assert r["scale_rel"] < 1e-6, r
    assert r["padding_absmax"] == 0.0
    assert r["shift_rel"] < 1e-6, r  # q . mean(K): the LSE term K smoothing removed


def test_unpadded_layouts_for_cudnn(results):
    r = results["qkv_unpadded"]
    assert r["shapes"] == [[1, 2, 300, 64]] * 3
    assert all(m <= 2 and steps <= 1 for m, steps in r["codes"]), r


def test_blocks_too_large_for_registers_take_the_two_pass_path(results):
    r = results["two_pass"]
    assert r["one_pass"] is False
    mismatches, steps = r["codes"]
    assert mismatches <= 1e-4 * r["n"] and steps <= 1, r
    assert r["scale_rel"] < 1e-6, r


def test_attention_single_tile_equals_reference(results):
    r = results["one_tile"]
    assert r["shape"] == [1, 2, 100, 64] and r["dtype"] == "torch.bfloat16"
    assert r["vs_reference"] < 5e-3, r


@pytest.mark.parametrize("case", ["multi_tile", "key_padding", "head_dim_128", "fully_masked", "float_key_mask"])
def test_attention_quantized_p_close_to_reference(results, case):
    r = results[case]
    assert r["finite"]
    # running-max P quantization differs from the reference's final-max quantization by ~2%,
    # and is not less accurate than it against exact attention
    assert r["vs_reference"] < 3e-2, r
    assert r["err"] < 1.05 * r["ref_err"] + 1e-3, r


def test_attention_unquantized_p_matches_reference(results):
    r = results["head_scales_fp16_p"]
    assert r["vs_reference"] < 6e-3, r


@pytest.mark.parametrize(
    "case", ["multi_tile", "key_padding", "head_scales_fp16_p", "head_dim_128", "fully_masked", "float_key_mask"]
)
def test_lse_matches_reference(results, case):
    r = results[case]
    assert r["lse_shape"][-1] > 0 and r["lse_dtype"] == "torch.float32"
    assert r["lse_inf_match"], r  # -inf exactly on the fully masked rows
    # natural-log LSE: the kernel's row sum is the reference's (unquantized P), up to exp2 and fp32 order
    assert r["lse_maxabs"] < 1e-3, r


def test_custom_ops_reach_the_cuda_lowering(results):
    r = results["custom_ops"]
    assert r["vs_reference"] < 3e-2 and r["lse_maxabs"] < 1e-3 and r["lse_shape"] == [1, 2, 150], r
    assert r["same_without_lse"], r  # the LSE output changes nothing else


def test_fully_masked_rows_give_zero(results):
    assert results["fully_masked"]["masked_rows_zero"]


def test_every_autotune_config_runs(results):
    from fx_fp8.ops.triton_fp8_attention import CONFIGS

    assert set(results["configs"]) == {f"{m}x{n}" for m, n, _, _ in CONFIGS}
    assert any(r["tma"] for r in results["configs"].values()) and not all(r["tma"] for r in results["configs"].values())
    for name, r in results["configs"].items():
        assert r["vs_reference"] < 3e-2, (name, r)
        assert r["err"] < 1.05 * r["ref_err"] + 1e-3, (name, r)
        assert r["lse_maxabs"] < 1e-3, (name, r)


@pytest.mark.parametrize("m", [5, 40])
def test_int8_gemm_with_fused_rescale(results, m):
    r = results[f"int8_m{m}"]
    assert r["shape"] == [m, 96]
    assert r["exact_no_bias"]  # exact int32 products, the reference's fp32 rescale order
    assert r["bias_max_ulps"] <= 2.0, r  # bias added in fp32 before the one rounding (reference: after)


def test_int8_gemm_scalar_scales(results):
    assert results["int8_scalar_scales_exact"]


WO_CASES = [
    "wo_fp8_channel_0_m5",
    "wo_fp8_tensor_0_m40",
    "wo_fp8_block_32_m5",
    "wo_fp8_block_128_m70",
    "wo_int8_channel_0_m70",
    "wo_int8_block_32_m1",
]


@pytest.mark.parametrize("case", WO_CASES)
def test_fused_weight_only_kernel(results, case):
    r = results[case]
    assert r["fused"], r  # the Triton kernel ran, not the unfused fallback
    assert r["shape"][1] == 96 and r["dtype"] == r["want_dtype"], r
    # the kernel widens the codes exactly and rounds once (bf16: 2^-9 relative, fp16: 2^-12); the
    # reference also rounds each dequantized weight first: both are that close to the fp64 product
    bound = 4e-3 if r["dtype"] == "torch.bfloat16" else 6e-4
    assert r["err"] < bound and r["vs_reference"] < 2 * bound, r
    assert r["err"] <= 1.05 * r["ref_err"] + 1e-5, r


@pytest.mark.parametrize(
    "case",
    [
        "small_m_int8_block_m1",
        "small_m_int8_block_m3",
        "small_m_fp8_channel_m1",
        "small_m_fp8_channel_m3",
        "small_m_fp8_block_m1",
        "small_m_fp8_tensor_m3",
    ],
)
def test_every_small_m_candidate_is_as_exact_as_the_old_tile(results, case):
    """Both forms (tensor-core dot on raw codes; FMA on the dequantized tile, K steps spanning several
    32-column scale groups) round once to bf16: every candidate within 5 % of the old tile's error."""
    r = results[case]
    fma = [name for name in r["candidates"] if name.split("x")[3] == "1"]
    assert fma and len(r["candidates"]) > len(fma), r  # both forms were run
    for name, err in r["candidates"].items():
        assert err < 4e-3 and err <= 1.05 * r["old_err"] + 1e-5, (name, r)


def test_block_scales_in_one_launch_write_what_three_launches_write(results):
    same = results["qkv_one_launch_same"]
    assert len(same) == 3 * 2 * 3 * 7 and all(same), same


def test_the_small_m_autotuner_times_every_candidate_once_and_runs_the_fastest(results):
    """The GPU path's autotuner, run in the interpreter with a stand-in timer: the prune keeps exactly
    small_m_candidates, each is timed once per key, the fastest (here the last) runs, and the result is right."""
    r = results["autotuned"]
    assert r["timed"] == len(r["candidates"]) == 8 and r["timed_again"] == 0, r
    assert r["best"] == r["candidates"][-1] and r["best"].split("x")[3] == "1", r  # an FMA tile won
    assert r["err"] < 4e-3, r
