"""The FP8 attention the CUDA lowering ships, run from the lowering's own call under Hopper's accumulation.

test_attention_accumulation.py shows that the two P @ V structures behave differently when it launches
each of them itself; this file pins what the product launches. In Triton's CPU interpreter, with
`fp8_mma_emulation` making the FP8 dots accumulate as an H100 / H200 does, the custom op the attention
pass emits (`torch.ops.fx_fp8.fp8_attention`, lowering "cuda", the attention config's defaults) runs the
lowering's pre-pass and kernel with the tile, accumulation structure and scales it would use on Hopper
(the TMA path, the autotuner's first candidate: `triton_fp8_attention.interpreter_config`), and its
error against float64 attention must stay within the bound the GPU test asserts
(test_cuda_lowering.py::test_attention_error_stays_within_1_5x_of_the_reference_at_every_length: 1.5x
the reference lowering's). Every other key tile the GPU's autotuner may pick runs on the same inputs.

Reverting the accumulation to the old in-place form (`acc = tl.dot(P, V, acc)`) gives 2.9x at 2048
keys under the emulation (11.5 % error, 41x, at 16384 keys on an H200). Not pinned here: the Hadamard
rotation, K smoothing and P scale (a lowering that drops them stays within the bound on these Gaussian
inputs, as it would in the GPU test; tests/ops/test_triton_interpret.py compares the pre-pass with the
reference code for code).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import fp8_mma_emulation as emu

#: the GPU test's bound: the kernel's error at most this times the reference lowering's
GPU_BOUND = 1.5

SCRIPT = r"""
import json, math
import torch
import fp8_mma_emulation as emu
import fx_fp8  # registers torch.ops.fx_fp8
from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.ops import triton_fp8_attention as ta

emu.install()  # the calibrated Hopper accumulation for every FP8 x FP8 -> fp32 dot
cfg = AttentionQuantConfig()  # the shipped defaults: block scales, Hadamard, smoothing, P scale
kw = dict(granularity=cfg.granularity, q_block=cfg.q_block, kv_block=cfg.kv_block, hadamard=cfg.hadamard,
          smooth_k=cfg.smooth_k, quantize_p=cfg.quantize_p, p_scale=cfg.p_scale, attention_kernel=cfg.kernel)
launches, kernel_args = [], {}
real = ta._attn_fwd_kernel


class Recorder:  # what the lowering launches, then the launch itself
    def __getitem__(self, grid):
        def launch(*args, **flags):
            launches.append({n: flags[n] for n in ("BLOCK_M", "BLOCK_N", "num_warps", "TWO_LEVEL", "PV_KEYS",
                                                   "USE_TMA", "QUANT_P")})
            return real[grid](*args, **flags)
        return launch


ta._attn_fwd_kernel = Recorder()
real_fa = ta.fp8_flash_attention


def keep_args(*args, **kwargs):  # the prepared inputs, to run the other key tiles on
    kernel_args["args"], kernel_args["kwargs"] = args, kwargs
    return real_fa(*args, **kwargs)


ta.fp8_flash_attention = keep_args
res = {}
S = 2048  # 32 key tiles of 64: the in-place form is 2.9x the reference's error here, two-level 1.04x
for name, d in (("d64", 64), ("d128", 128)):
    torch.manual_seed(0)
    q = torch.randn(1, 1, 64, d)  # 64 queries: every one sees every key tile
    k = torch.randn(1, 1, S, d)
    v = torch.randn(1, 1, S, d) + 0.5  # as the GPU test: a mean makes accumulation loss visible
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = 1 / math.sqrt(d)
    launches.clear()
    out = torch.ops.fx_fp8.fp8_attention(q, k, v, None, scale, lowering="cuda", **kw)
    ref = torch.ops.fx_fp8.fp8_attention(q, k, v, None, scale, lowering="reference", **kw)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    rel = lambda a: ((a.double() - exact).norm() / exact.norm()).item()
    entry = {"launches": list(launches), "err": rel(out), "ref_err": rel(ref), "other_tiles": {}}
    use_tma = launches[-1]["USE_TMA"]
    for bm, bn, warps, _ in ta.launch_candidates(d, cfg.kv_block, use_tma):
        if bn != launches[-1]["BLOCK_N"] and str(bn) not in entry["other_tiles"]:
            o = real_fa(*kernel_args["args"], **dict(kernel_args["kwargs"], config=(bm, bn, warps, 1)))
            entry["other_tiles"][str(bn)] = rel(o)
    # Q through a TMA descriptor (a candidate): the same kernel output, bit for bit
    pointer_q = real_fa(*kernel_args["args"], **kernel_args["kwargs"])
    tma_q = real_fa(*kernel_args["args"], **dict(kernel_args["kwargs"], q_tma=True))
    entry["q_tma_same"] = bool(torch.equal(pointer_q, tma_q)) and bool(torch.equal(pointer_q, out))
    # the candidate tiles a GPU run measures against the default (never launched unless named)
    entry["candidate_tiles"] = {t: rel(real_fa(*kernel_args["args"], **dict(kernel_args["kwargs"], tile=t)))
                                for t in ta.TILE_CANDIDATES}
    res[name] = entry
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def shipped():  # ~15 s: the interpreter runs 2048 keys at two head dims
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(emu.__file__), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT") :])


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_the_lowering_launches_the_hopper_kernel_it_ships(shipped, d):
    from fx_fp8.ops.triton_fp8_attention import PV_KEYS, TMA_CONFIGS

    (launch,) = shipped[f"d{d}"]["launches"]  # one kernel launch a call
    assert launch["USE_TMA"] and launch["QUANT_P"], launch
    assert launch["TWO_LEVEL"] and launch["PV_KEYS"] == PV_KEYS, launch
    assert (launch["BLOCK_M"], launch["BLOCK_N"], launch["num_warps"]) in {c[:3] for c in TMA_CONFIGS[d]}, launch


@pytest.mark.slow
@pytest.mark.parametrize("case", ["d64", "d128"])
def test_shipped_attention_stays_within_the_gpu_bound_under_hopper_accumulation(shipped, case):
    r = shipped[case]
    assert r["ref_err"] > 0, r
    assert r["err"] <= GPU_BOUND * r["ref_err"], r
    for bn, err in r["other_tiles"].items():  # whichever key tile the GPU's autotuner picks
        assert err <= GPU_BOUND * r["ref_err"], (bn, r)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["d64", "d128"])
def test_q_through_tma_gives_the_same_output(shipped, case):
    assert shipped[case]["q_tma_same"], shipped[case]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["d64", "d128"])
def test_candidate_tiles_stay_within_the_gpu_bound_under_hopper_accumulation(shipped, case):
    from fx_fp8.ops.triton_fp8_attention import TILE_CANDIDATES

    r = shipped[case]
    assert set(r["candidate_tiles"]) == set(TILE_CANDIDATES) and r["candidate_tiles"], r
    for tile, err in r["candidate_tiles"].items():
        assert err <= GPU_BOUND * r["ref_err"], (tile, r)
