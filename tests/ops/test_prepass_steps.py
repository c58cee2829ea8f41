"""The Q/K/V pre-pass's two-pass blocks walk in wide steps (triton_quant.WIDE_STEPS: the largest tile one
pass holds) instead of 32-row steps: half the steps and Hadamard dots of 64 rows, the same output bit for bit.
Checked in Triton's interpreter, in one subprocess (TRITON_INTERPRET is read when kernels are decorated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, torch
from fx_fp8.ops import triton_quant as tq

def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(bits(a), bits(b)))

torch.manual_seed(0)
res = {"steps": {}, "same": {}}
for d, rotated in ((128, True), (128, False)):  # what prepare_qkv's default 128-row Q / 256-row K, V blocks walk
    res["steps"][f"d{d}_{'rotated' if rotated else 'plain'}"] = [tq._launch_config(256, d, rotated, False)[:2],
                                                                  tq._launch_config(256, d, rotated)[:2]]
res["steps"]["d128_rotated_lse"] = [tq._launch_config(128, 128, True, dot=True)[:2]]
s, d = 300, 128
q = torch.randn(1, 2, s, d).bfloat16()
k = torch.randn(1, 2, s, d) * 2 + 0.5
k[..., 5] *= 20  # an outlier channel: the amax is one element of the block
k, v = k.bfloat16(), torch.randn(1, 2, s, d).bfloat16()
wide_default = tq.prepare_qkv(q, k, v, granularity="block", q_block=128, kv_block=256, hadamard=True, smooth_k=True,
                              lse_shift=True)
for name, kw in {"block_lse": dict(granularity="block", lse_shift=True),
                 "head": dict(granularity="head")}.items():
    narrow, wide = (tq.prepare_qkv(q, k, v, q_block=128, kv_block=256, hadamard=True, smooth_k=True,
                                   wide_steps=w, **kw) for w in (False, None))  # None: the default, wide
    res["same"][name] = [same(a, b) for a, b in zip(narrow, wide)]
# the one-launch candidate (32-row steps: wide ones spill there) against the default three launches
one = tq.prepare_qkv(q, k, v, granularity="block", q_block=128, kv_block=256, hadamard=True, smooth_k=True,
                     lse_shift=True, one_launch=True)
res["same"]["one_launch_vs_wide"] = [same(a, b) for a, b in zip(one, wide_default)]
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT") :])


@pytest.mark.slow
def test_two_pass_blocks_walk_in_wide_steps(results):
    # (rows a step, one pass): 32-row steps before (wide_steps=False); by default 64 rows
    assert results["steps"] == {
        "d128_rotated": [[32, False], [64, False]],
        "d128_plain": [[32, False], [64, False]],
        "d128_rotated_lse": [[32, False]],
    }  # wide, it spills 4 bytes on Triton 3.6


@pytest.mark.slow
@pytest.mark.parametrize("case", ["block_lse", "head", "one_launch_vs_wide"])
def test_wide_steps_write_what_narrow_steps_write(results, case):
    assert results["same"][case] and all(results["same"][case]), results["same"]


def test_one_launch_refuses_wide_steps_by_name():
    import torch

    from fx_fp8.ops import triton_quant as tq

    x = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="wide_steps=True needs one_launch=False"):
        tq.prepare_qkv(
            x,
            x,
            x,
            granularity="block",
            q_block=128,
            kv_block=256,
            hadamard=True,
            smooth_k=True,
            one_launch=True,
            wide_steps=True,
        )
