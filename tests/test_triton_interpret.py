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

SCRIPT = r"""
import json, math
import torch
import torch.nn.functional as F
from fx_fp8.ops import quant
from fx_fp8.ops import triton_quant as tq
from fx_fp8.ops.cuda import LOWERING as C
from fx_fp8.ops.reference import LOWERING as R

torch.manual_seed(0)
res = {}
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

# per-row activation quantization over five decades of magnitude
x = torch.cat([torch.randn(64, 300) * s for s in (1e-3, 0.05, 1.0, 40.0, 300.0)]).bfloat16()
xq, xs = tq.quantize_rows_fp8(x)
rq, rs = quant.quantize_per_row(x)
res["rows_code_mismatch"] = int((xq.float() != rq.float()).sum())
res["rows_scale_equal"] = bool(torch.equal(xs, rs))

# Q/K/V block quantization: transposed (non-contiguous) Q, smoothed K with an outlier channel
b, h, s, d = 1, 2, 300, 64
q = torch.randn(b, s, h, d).bfloat16().transpose(1, 2)
k = torch.randn(b, h, s, d) * 2 + 0.5
k[..., 5] *= 20
k, v = k.bfloat16(), torch.randn(b, h, s, d).bfloat16()
qq, sq, kq, sk, vt, sv = tq.prepare_qkv_blocks(q, k, v, q_block=128, kv_block=256, hadamard=True, smooth_k=True)
ref = quant.prepare_qkv(q, k, v, granularity="block", q_block=128, kv_block=256, hadamard=True, smooth_k=True)
ours = (qq[:, :, :s], sq, kq[:, :, :s], sk, vt[..., :s].transpose(-1, -2), sv)
res["qkv_code_mismatch"] = [int((a.float() != r.float()).sum()) for a, r in zip(ours[0::2], ref[0::2])]
res["qkv_scale_rel"] = max(((a - r).abs() / r).max().item() for a, r in zip(ours[1::2], ref[1::2]))
res["qkv_padding_absmax"] = max(qq[:, :, s:].float().abs().max().item(), kq[:, :, s:].float().abs().max().item(),
                                vt[..., s:].float().abs().max().item())

def attn(name, bq, hq, sq_, sk_, d_, gran, quant_p, mask=None, kv_block=256):
    q = torch.randn(bq, hq, sq_, d_).bfloat16()
    k = torch.randn(bq, hq, sk_, d_).bfloat16()
    v = torch.randn(bq, hq, sk_, d_).bfloat16()
    kw = dict(attn_mask=mask, softmax_scale=1 / math.sqrt(d_), granularity=gran, q_block=128, kv_block=kv_block,
              hadamard=True, smooth_k=True, quantize_p=quant_p, p_scale=448.0)
    out, r = C.attention(q, k, v, **kw), R.attention(q, k, v, **kw)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    res[name] = {"vs_reference": rel(out, r), "err": rel(out, exact), "ref_err": rel(r, exact),
                 "shape": list(out.shape), "finite": bool(torch.isfinite(out).all())}

# one key tile: the running max is the final max, so the kernel is the reference up to exp2 / bf16 rounding
attn("one_tile", 1, 2, 100, 64, 64, "block", True, kv_block=64)
attn("multi_tile", 1, 2, 200, 300, 64, "block", True)
keep = torch.ones(2, 1, 1, 300, dtype=torch.bool)
keep[0, ..., -70:] = False
keep[1, ..., :140] = False  # whole leading key tiles masked: must not turn into NaN
attn("key_padding", 2, 1, 130, 300, 64, "block", True, mask=keep)
attn("head_scales_fp16_p", 1, 2, 130, 260, 64, "head", False)
attn("head_dim_128", 1, 1, 64, 128, 128, "tensor", True)
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_row_quantization_is_bit_exact(results):
    assert results["rows_code_mismatch"] == 0
    assert results["rows_scale_equal"]


def test_qkv_block_quantization_matches_reference(results):
    # same FP8 codes; scales differ at most by fp32 summation order of the smoothing mean
    assert results["qkv_code_mismatch"] == [0, 0, 0]
    assert results["qkv_scale_rel"] < 1e-6
    assert results["qkv_padding_absmax"] == 0.0


def test_attention_single_tile_equals_reference(results):
    r = results["one_tile"]
    assert r["shape"] == [1, 2, 100, 64]
    assert r["vs_reference"] < 5e-3, r


@pytest.mark.parametrize("case", ["multi_tile", "key_padding", "head_dim_128"])
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
