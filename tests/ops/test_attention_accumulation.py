"""How the FP8 attention kernel accumulates P @ V, checked without a GPU.

Hopper's FP8 tensor cores add with about 14 bits, so a P @ V product accumulated in place across
every key tile (`acc = tl.dot(Pq, Vq, acc)`) loses a little at each tile: on an H200 the old kernel
had 3.2 % error at 4608 keys and 11.5 % at 16384, against 0.36 / 0.28 % for the reference lowering.
The interpreter computes dots exactly, so it cannot see that; here

* `fp8_mma_emulation` makes the interpreter's FP8 dots truncate their running sum as the hardware
  does (calibrated to that measurement), and the real kernel runs both ways: in place (the old
  structure, kept as a measurement-only flag) its error grows with length; two-level (each P @ V
  dot of at most PV_KEYS keys starts from zero, its result is added to an fp32 accumulator on the
  CUDA cores) it stays close to the reference;
* the kernel compiled for sm90 is read back: its P @ V dots start from a zero accumulator and are
  not folded back into an in-place dot (Triton folds `dot(a, b, 0) + c` into `dot(a, b, c)` unless
  the dot has imprecise accumulation), ptxas does not serialize its wgmmas, and its K / V loads are
  still multi-buffered (a loop-carried prefetch once broke Triton's pipelining silently).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fp8_mma_emulation as emu


# -- the emulation itself (fast) ----------------------------------------------------------------------
def test_truncation_keeps_the_leading_bits_toward_zero():
    x = np.array([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-11, -(3.0 + 2.0**-9), 0.0, 2048.0 + 1.0, 6.0])
    got = emu.truncate(x, 11)
    # 11 significant bits: 1 + 2^-10 is kept, 1 + 2^-11 is not; negative values move toward zero too
    assert got.tolist() == [1.0, 1.0 + 2.0**-10, 1.0, -(3.0 + 2.0**-9), 0.0, 2048.0, 6.0]
    r = np.random.default_rng(0).standard_normal(10_000) * 1e3
    loss = (r - emu.truncate(r, 11)) / r
    assert (loss >= 0).all() and loss.max() < 2.0**-10  # toward zero, less than one unit in the 11th bit


def test_emulated_dot_truncates_the_running_sum_per_chunk():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 8, (4, 256)).astype(np.float64), rng.integers(0, 8, (256, 3)).astype(np.float64)
    c = rng.standard_normal((4, 3)) * 1e4
    assert np.allclose(emu.emulated_dot(a, b, c, bits=52), a @ b + c, rtol=1e-7)  # wide enough: exact
    # by hand: the C input joins the first chunk's sum, then one truncation per 32 columns
    acc = c
    for k0 in range(0, 256, 32):
        acc = emu.truncate(acc + a[:, k0 : k0 + 32] @ b[k0 : k0 + 32], 11)
    assert np.array_equal(emu.emulated_dot(a, b, c, bits=11), acc.astype(np.float32))
    # a long in-place sum of positive terms loses in proportion to its length; fresh partial sums do not
    ones = np.ones((1, 32 * 512))
    vals = np.full((32 * 512, 1), 1.0 + 2.0**-9)
    in_place = emu.emulated_dot(ones, vals, np.zeros((1, 1)), bits=11)[0, 0]
    two_level = sum(
        emu.emulated_dot(ones[:, i : i + 64], vals[i : i + 64], np.zeros((1, 1)), bits=11)[0, 0]
        for i in range(0, ones.shape[1], 64)
    )
    exact = float((ones @ vals)[0, 0])
    assert (exact - in_place) / exact > 1e-3 and abs(exact - two_level) / exact < 1e-5


# -- the kernel under the emulation (Triton interpreter, one subprocess) ----------------------------------
SCRIPT = r"""
import json, math, sys
import torch
import fp8_mma_emulation as emu
from fx_fp8.ops import quant
from fx_fp8.ops import triton_fp8_attention as ta
from fx_fp8.ops.triton_quant import padded_len

def pad_rows(x, n):  # (B, H, S, D) fp8 -> S padded with zero rows to n
    return torch.nn.functional.pad(x.view(torch.uint8), (0, 0, 0, n - x.shape[2])).view(x.dtype)

res = {}
for bits in (52, emu.BITS):  # 52: exact dots (what the interpreter does anyway); BITS: Hopper's accumulation
    emu.install(bits)
    for d, s_k in ((128, 1024), (128, 4608), (128, 16384), (64, 16384)):
        if bits == 52 and s_k != 4608:
            continue
        torch.manual_seed(0)
        m = 64  # one program's query rows: each of them sees every key tile
        q, k = torch.randn(1, 1, m, d), torch.randn(1, 1, s_k, d)
        v = torch.randn(1, 1, s_k, d) + 0.5  # the issue's distribution: a mean makes the loss visible
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(q, k, v, granularity="block", q_block=128, kv_block=256,
                                                   hadamard=True, smooth_k=True)
        scale = 1 / math.sqrt(d)
        exact = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1) @ v.double()
        ref = quant.attention_from_fp8(qq, sq, kq, sk, vq, sv, softmax_scale=scale, q_block=128, kv_block=256,
                                       quantize_p=True, p_scale=448.0, out_dtype=torch.float64)
        rel = lambda a: ((a.double() - exact).norm() / exact.norm()).item()
        args = (pad_rows(qq, padded_len(m)), sq, pad_rows(kq, padded_len(s_k)), sk,
                pad_rows(vq, padded_len(s_k)).transpose(-1, -2).contiguous(), sv)
        entry = {"ref": rel(ref)}
        for name, two_level in (("two_level", True), ("in_place", False)):
            out = ta.fp8_flash_attention(*args, s_q=m, s_k=s_k, softmax_scale=scale, q_block=128, kv_block=256,
                                         out_dtype=torch.float32, config=(64, 128, 4, 1), two_level=two_level)
            entry[name] = rel(out)
        res[f"bits{bits}_d{d}_s{s_k}"] = entry
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def emulated():  # ~30 s on a quiet 2-core machine: the interpreter runs 16k keys several times
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(emu.__file__), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT") :])
    print(
        "\nerror vs fp64 attention (%):",
        json.dumps({k: {n: round(100 * e, 3) for n, e in r.items()} for k, r in res.items()}),
    )
    return res


@pytest.mark.slow
def test_with_exact_dots_both_structures_are_the_reference(emulated):
    r = emulated["bits52_d128_s4608"]
    assert r["two_level"] < 1.05 * r["ref"] and r["in_place"] < 1.05 * r["ref"], r


@pytest.mark.slow
def test_in_place_accumulation_error_grows_with_length(emulated):
    e = {s: emulated[f"bits{emu.BITS}_d128_s{s}"] for s in (1024, 4608, 16384)}
    # the emulation is calibrated to the H200's 3.2 % / 11.5 % (it gives about 2.7 / 8.7 %)
    assert e[16384]["in_place"] > 2.5 * e[4608]["in_place"] > 5 * e[1024]["in_place"] - 1e-9, e
    assert e[16384]["in_place"] > 0.06 and e[4608]["in_place"] > 0.02, e
    assert e[16384]["in_place"] > 20 * e[16384]["ref"], e


@pytest.mark.slow
@pytest.mark.parametrize("case", ["d128_s1024", "d128_s4608", "d128_s16384", "d64_s16384"])
def test_two_level_accumulation_stays_near_the_reference(emulated, case):
    r = emulated[f"bits{emu.BITS}_{case}"]
    # the GPU bar is 1.5x the reference; the emulation runs ~25 % below the H200's loss, so keep margin
    assert r["two_level"] < 1.25 * r["ref"], r


# -- the compiled kernel's structure (sm90, read back from Triton's IR and ptxas) ------------------
def _pv_dots(ttgir: str):
    """(C operand, maxNumImpreciseAcc, K) of every wgmma whose A operand is in registers (P @ V; Q @ K^T
    reads both operands from shared memory)."""
    dots = []
    for m in re.finditer(
        r"ttng\.warp_group_dot (%[\w.#]+), (%[\w.#]+), (%[\w.#]+)(?:, %[\w.#]+)? \{([^}]*)\} : "
        r"tensor<(\d+)x(\d+)x\w+, #ttg\.dot_op",
        ttgir,
    ):
        imprecise = int(re.search(r"maxNumImpreciseAcc = (\d+)", m.group(4)).group(1))
        dots.append((m.group(3), imprecise, int(m.group(6))))
    return dots


def _zero_constants(ttgir: str) -> set[str]:
    return set(re.findall(r"(%[\w.#]+) = arith\.constant dense<0\.000000e\+00> : tensor<\d+x\d+xf32", ttgir))


def _multi_buffered(ttgir: str, rows: int, cols: int) -> bool:
    """A shared-memory ring of at least two (rows x cols) FP8 tiles: the pipeliner's K / V buffers."""
    return any(int(n) >= 2 for n in re.findall(rf"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x{rows}x{cols}xf8", ttgir))


def structure(ttgir: str) -> dict:
    pv = _pv_dots(ttgir)
    zeros = _zero_constants(ttgir)
    return {
        "pv_dots": len(pv),
        "from_zero": all(c in zeros for c, _, _ in pv),
        "promoted_in_dot": any(imprecise <= k for _, imprecise, k in pv),
    }


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    triton_compile = pytest.importorskip("triton_compile")
    from fx_fp8.ops.triton_fp8_attention import PV_KEYS

    tmp = tmp_path_factory.mktemp("ptx")
    out = {}
    for name, two_level in (("two_level", True), ("in_place", False)):
        kernel = triton_compile.compile_attention(128, 128, 128, 8, 3, two_level=two_level)
        out[name] = {"ttgir": kernel.asm["ttgir"], "ptxas": triton_compile.ptxas_report(kernel, 90, tmp)}
    out["pv_keys"] = PV_KEYS
    return out


@pytest.mark.slow
def test_compiled_pv_dots_start_from_zero(compiled):
    from fx_fp8.ops.triton_fp8_attention import PV_KEYS

    new, old = structure(compiled["two_level"]["ttgir"]), structure(compiled["in_place"]["ttgir"])
    # two loops (full key tiles, the partial last one), 128 / PV_KEYS dots each
    assert new["pv_dots"] == 2 * max(1, 128 // PV_KEYS) and new["from_zero"], new
    assert not new["promoted_in_dot"], new  # promotion inside the dot makes ptxas serialize (see below)
    assert old["pv_dots"] == new["pv_dots"] and not old["from_zero"], old  # it sees the in-place structure


@pytest.mark.slow
def test_compiled_kernel_keeps_async_wgmma_and_pipelined_loads(compiled):
    from fx_fp8.ops.triton_fp8_attention import PV_KEYS

    report = compiled["two_level"]["ptxas"]
    if report is None:
        pytest.skip("ptxas cannot assemble this PTX")
    assert "C7514" not in report, report[:500]
    ttgir = compiled["two_level"]["ttgir"]
    assert _multi_buffered(ttgir, 128, 128), "K tiles are not multi-buffered: the loop lost its pipelining"
    assert _multi_buffered(ttgir, 128, min(128, PV_KEYS)), "V tiles are not multi-buffered"
