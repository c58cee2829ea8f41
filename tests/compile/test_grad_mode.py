"""Grad mode: models straight from from_pretrained have parameters that require grad. Compiling
and running them with grad enabled works with every downstream compiler (the FP8 nodes are
inference-only); only an actual .backward() through a quantized node is an error, and it says so."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.to_qkv = nn.Linear(64, 192)
        self.ff = nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.to_qkv(x).view(1, -1, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return self.ff(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, -1, 64))


@pytest.mark.parametrize("downstream", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiles_and_runs_with_grad_enabled(downstream):
    m, x = Block(), torch.randn(1, 64, 64)
    assert all(p.requires_grad for p in m.parameters()) and torch.is_grad_enabled()
    compiled = torch.compile(
        m,
        backend="fp8",
        options={
            "downstream": downstream,
            "diffusion_kv_cache_dtype": "fp8",
            "quantization": "fp8",
            "quantization_config": {"quantize_sensitive": True},
        },
    )
    out = compiled(x)
    ref = m(x)
    assert float((out - ref).norm() / ref.norm()) < 0.05
    (report,) = fx_fp8.get_reports(compiled)
    assert report.count("attention", "fp8") == 1 and report.count("linear", "fp8") == 2
    with pytest.raises(RuntimeError, match="inference-only: .backward\\(\\) reached a quantized node"):
        out.sum().backward()
