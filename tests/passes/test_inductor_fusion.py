"""Activation quantization the downstream compiler can fuse: on CPU and CUDA the
linear pass writes the quantization as plain torch ops, once per group of linears that read
the same tensor, and Inductor fuses it into the producer (norm + modulation) instead of adding
a separate pass over the activation. Counted in Inductor's CPU output code."""
import re

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import fx_fp8


class ModulatedBlock(nn.Module):
    """A DiT block's front: adaLN modulation of a LayerNorm output feeding q, k, v and an MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(128, elementwise_affine=False)
        self.mod = nn.Linear(128, 256)
        self.to_q, self.to_k, self.to_v = (nn.Linear(128, 128) for _ in range(3))
        self.mlp = nn.Linear(128, 512)

    def forward(self, x, t):
        shift, scale = self.mod(t).chunk(2, -1)
        h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        return self.to_q(h) + self.to_k(h) + self.to_v(h), self.mlp(h)


def kernels(options):
    m, x, t = ModulatedBlock().eval(), torch.randn(1, 256, 128), torch.randn(1, 128)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="fp8", options={"diffusion_kv_cache_dtype": None, "downstream": "inductor",
                                                       **options})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x, t)
    names = sorted(set(re.findall(r"cpp_fused_\w+", "\n".join(codes))))
    return names, fx_fp8.get_reports(compiled)[0], out, m(x, t)


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
