"""What the CUDA lowering's attention launches, pinned fast: the custom op the attention pass emits
(`torch.ops.fx_fp8.fp8_attention`, lowering "cuda", the attention config's defaults) is called with the
pre-pass and the kernel replaced by recorders, so no Triton kernel runs; the test reads the arguments
they receive, with the kernel entry's own defaults filled in.

test_attention_shipped_numerics.py (slow: Triton's interpreter) runs the same call for real under the
Hopper-accumulation emulation and holds its error to the GPU test's bound; this file fails at once when a
shipped choice is reverted: the two-level P @ V accumulation (the in-place form measured 11.5 % error at
16k keys on an H200), the Hadamard rotation of Q and K (outlier channels cost 10 dB without it), K
smoothing, P's fixed scale, the 128 / 256-row block scales.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

pytest.importorskip("triton")  # the lowering's kernels are Triton's (Linux test installs carry it)

import fx_fp8  # noqa: F401  registers torch.ops.fx_fp8
from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.ops import triton_fp8_attention, triton_quant


def _launched(monkeypatch, d: int = 64, s: int = 256) -> tuple[dict, dict]:
    """(the pre-pass's arguments, the kernel entry's arguments with its defaults) of one lowering call."""
    seen = {}

    def prepass(q, k, v, **kw):
        seen["prepass"] = kw
        return q, None, k, None, v, None, None

    def kernel(*args, **kw):
        bound = inspect.signature(real_kernel).bind(*args, **kw)
        bound.apply_defaults()
        seen["kernel"] = dict(bound.arguments)
        return torch.zeros_like(args[0])

    real_kernel = triton_fp8_attention.fp8_flash_attention
    monkeypatch.setattr(triton_quant, "interpreting", lambda: True)  # CPU tensors reach the lowering's launch
    monkeypatch.setattr(triton_quant, "prepare_qkv", prepass)
    monkeypatch.setattr(triton_fp8_attention, "fp8_flash_attention", kernel)
    cfg = AttentionQuantConfig()  # the shipped defaults
    q, k, v = (torch.randn(1, 2, s, d, dtype=torch.bfloat16) for _ in range(3))
    torch.ops.fx_fp8.fp8_attention(
        q,
        k,
        v,
        None,
        1 / math.sqrt(d),
        lowering="cuda",
        granularity=cfg.granularity,
        q_block=cfg.q_block,
        kv_block=cfg.kv_block,
        hadamard=cfg.hadamard,
        smooth_k=cfg.smooth_k,
        quantize_p=cfg.quantize_p,
        p_scale=cfg.p_scale,
        attention_kernel="triton",
    )
    return seen["prepass"], seen["kernel"]


def test_the_shipped_defaults_are_the_measured_recipe():
    cfg = AttentionQuantConfig()
    assert (cfg.granularity, cfg.q_block, cfg.kv_block) == ("block", 128, 256)
    assert (cfg.hadamard, cfg.smooth_k, cfg.quantize_p, cfg.p_scale) == (True, True, True, 448.0)


def test_the_prepass_rotates_smooths_and_scales_blocks_as_shipped(monkeypatch):
    prepass, _ = _launched(monkeypatch)
    assert prepass["granularity"] == "block" and (prepass["q_block"], prepass["kv_block"]) == (128, 256)
    assert prepass["hadamard"] is True and prepass["smooth_k"] is True


@pytest.mark.parametrize("d", [64, 128])
def test_the_kernel_accumulates_p_v_in_two_levels_with_p_quantized_at_its_scale(monkeypatch, d):
    _, kernel = _launched(monkeypatch, d=d)
    assert kernel["two_level"] is True  # a fresh P @ V accumulator per key group, added in fp32
    assert kernel["pv_keys"] in (None, 128)  # None: the tile's default, 128-key dots (1.02x the reference's error)
    assert kernel["quantize_p"] is True and kernel["p_scale"] == 448.0
    assert (kernel["q_block"], kernel["kv_block"]) == (128, 256)
    assert kernel["tile"] is None  # the autotuned default tiles, not a candidate under measurement
