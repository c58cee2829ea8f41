"""Activation quantization the downstream compiler can fuse: on CPU and CUDA the
linear pass writes the quantization as plain torch ops, once per group of linears that read
the same tensor, and Inductor fuses it into the producer (norm + modulation) instead of adding
a separate pass over the activation. Counted in Inductor's CPU output code."""

import pytest

from inductor_code import kernels


@pytest.mark.slow
def test_quantization_fuses_into_the_producer():
    native, _, _, _ = kernels({"quantization": None})
    fp8, report, out, ref = kernels({"quantization": "fp8", "quantization_config": {"quantize_sensitive": True}})
    groups = {e.act_quant_group for e in report.entries if e.op == "linear" and e.action == "fp8"}
    assert len(groups) == 2  # t (for the modulation) and h (for q, k, v, mlp: one quantization for four)
    quantizing = [k for k in fp8 if "amax" in k]
    assert len(quantizing) == len(groups)
    # h's quantization lives in the kernel that computes h (norm + modulation): no extra pass over h
    assert any("native_layer_norm" in k for k in quantizing), fp8
    # the only kernel FP8 adds is t's quantization: t is a graph input, no producer to fuse into
    assert len(fp8) == len(native) + 1, (native, fp8)
    for a, b in zip(out, ref):
        assert float((a - b).norm() / b.norm()) < 0.05
