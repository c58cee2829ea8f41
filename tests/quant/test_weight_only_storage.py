"""Weight-only (W8A16) storage of the sensitive layers: quantization_config.weight_only_method
(fp8 / int8) and weight_only_group_size (per-channel or per-group scales), in the compiled graph
and in prepare_model; validation names the bad value."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import quant


class Toy(nn.Module):
    """A modulation linear (sensitive), a token MLP (quantized W8A8), a final projection (sensitive)."""

    def __init__(self, width=64):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(width, width)
        self.norm1 = nn.Module()
        self.norm1.linear = nn.Linear(width, 2 * width)
        self.proj_out = nn.Linear(width, width)

    def forward(self, x, cond):
        shift, scale = self.norm1.linear(cond).chunk(2, dim=-1)
        return self.proj_out(self.fc(x * (1 + scale[:, None]) + shift[:, None]))


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 8, 64, generator=g), torch.randn(2, 64, generator=g)


def qc(**kw):
    return FP8Config.load(None, quantization_config=kw).quantization_config


def test_defaults_and_validation():
    q = qc()  # the measured weight-only storage (benchmarks/sensitive_modes.py): INT8, one scale per 32 columns
    # the default: sensitive layers weight-only in that storage
    assert (q.sensitive, q.weight_only_method, q.weight_only_group_size) == ("weight_only", "int8", 32)
    q = qc(weight_only_method="FP8", weight_only_group_size=None)
    assert (q.weight_only_method, q.weight_only_group_size) == ("fp8", None)
    with pytest.raises(ValueError, match="invalid quantization_config.weight_only_method 'int4'"):
        qc(weight_only_method="int4")
    for bad in (24, 0, 8, True, "32", 32.0):
        with pytest.raises(ValueError, match=f"invalid quantization_config.weight_only_group_size {bad!r}"):
            qc(weight_only_group_size=bad)


def test_layout():
    assert quant.weight_only_layout(None) == ("channel", None)
    assert quant.weight_only_layout(32) == ("block", (1, 32))


@pytest.mark.parametrize("method,group", [("int8", None), ("int8", 32), ("fp8", 32)])
def test_compiled_sensitive_layer_uses_the_storage(method, group):
    model = Toy().eval()
    x, cond = inputs()
    opts = {
        "quantization": "fp8",
        "diffusion_kv_cache_dtype": None,
        "downstream": "eager",
        "quantization_config": {
            "sensitive": "weight_only",
            "weight_only_method": method,
            "weight_only_group_size": group,
        },
    }
    compiled = torch.compile(model, backend="fp8", options=opts)
    with torch.no_grad():
        out = compiled(x, cond)
        # the same computation by hand: the sensitive linears with the requested storage, unquantized inputs
        gran, block = quant.weight_only_layout(group)

        def weight_only(lin, inp):
            wq, ws = quant.quantize_weight(lin.weight, gran, block, method)
            return inp @ quant.dequantize_weight(wq, ws, gran, block).t() + lin.bias

        shift, scale = weight_only(model.norm1.linear, cond).chunk(2, dim=-1)
        h = (x * (1 + scale[:, None]) + shift[:, None]).reshape(-1, 64)
        hq, hs = quant.quantize_per_row(h)
        fq, fs = quant.quantize_weight(model.fc.weight, "channel")
        want = weight_only(model.proj_out, (hq.float() * hs) @ (fq.float() * fs).t() + model.fc.bias)
        want = want.reshape(2, 8, 64)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)
    rows = {e.module: e for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == "linear"}
    assert rows["norm1.linear"].action == rows["proj_out"].action == "weight-only" and rows["fc"].action == "fp8"
    # the scales' bytes count: [N, 64 / group] fp32 scales of the weight-only layers, [64, 1] of fc
    report = fx_fp8.get_reports(compiled)[-1]
    n_scales = (128 + 64) * (64 // group if group else 1) + 64
    assert report.weights["quantized_linear_bytes_after"] == 128 * 64 + 2 * 64 * 64 + 4 * n_scales


def test_int8_storage_is_closer_than_fp8():
    """What the storage is for: at equal bytes, INT8 codes with per-channel scales carry about
    4x less weight error than e4m3 codes (3 mantissa bits) on Gaussian-like weights."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    errs = {}
    for method in ("fp8", "int8"):
        wq, ws = quant.quantize_weight(w, "channel", None, method)
        errs[method] = ((quant.dequantize_weight(wq, ws, "channel") - w).norm() / w.norm()).item()
    assert errs["int8"] < errs["fp8"] / 3, errs


@pytest.mark.parametrize("group", [None, 32])
def test_prepare_model_stores_the_requested_layout(group):
    model = Toy().eval()
    x, cond = inputs()
    cfg = {
        "quantization": "fp8",
        "diffusion_kv_cache_dtype": None,
        "quantization_config": {
            "sensitive": "weight_only",
            "weight_only_method": "int8",
            "weight_only_group_size": group,
        },
    }
    with torch.no_grad():  # the same config compiled on the original weights: prepare_model must agree
        ref = torch.compile(Toy().eval(), backend="fp8", options={**cfg, "downstream": "eager"})(x, cond)
    res = fx_fp8.prepare_model(model, cfg)
    assert sorted(res["weight_only"]) == ["norm1.linear", "proj_out"]
    layer = model.norm1.linear
    assert layer.weight.dtype == torch.int8 and layer.weight_granularity == ("block" if group else "channel")
    assert tuple(layer.weight_scale.shape) == ((128, 2) if group else (128, 1))
    compiled = torch.compile(model, backend="fp8", options={**cfg, "downstream": "eager"})
    with torch.no_grad():
        out = compiled(x, cond)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
