"""Reports carry shapes and FLOPs as numbers (dims, flops), and the tools read those numbers."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8.report import CompileReport, ReportEntry, dims_of, node_flops


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(64, 3 * 64)
        self.narrow = nn.Linear(64, 16)  # below min_features: native, still with its numbers

    def forward(self, x):
        q, k, v = self.to_qkv(x).unflatten(-1, (3, 2, 32)).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.narrow(o.transpose(1, 2).flatten(2))


def test_entries_carry_dims_and_flops_from_the_graph():
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    model = _Block()
    compiled = torch.compile(
        model, backend="fp8", options={"diffusion_kv_cache_dtype": "fp8", "quantization": "fp8", "downstream": "eager"}
    )
    with torch.no_grad():
        compiled(torch.randn(2, 40, 64))
    entries = {(e.op, e.module): e for r in fx_fp8.get_reports(compiled) for e in r.entries}
    qkv, narrow = entries[("linear", "to_qkv")], entries[("linear", "narrow")]
    assert qkv.action == "fp8" and qkv.dims == [[2, 40, 64], [192, 64]]
    assert qkv.flops == 2.0 * 2 * 40 * 192 * 64
    assert narrow.action == "native" and narrow.flops == 2.0 * 2 * 40 * 16 * 64
    (att,) = [e for e in entries.values() if e.op == "attention"]
    assert att.dims == [[2, 2, 40, 32]] * 3
    assert att.flops == 2.0 * 2 * 2 * 40 * 40 * (32 + 32)  # QK^T and PV
    # the numbers are data in the JSON report, next to the display string
    d = fx_fp8.get_reports(compiled)[0].to_dict()
    assert {e["module"]: e["flops"] for e in d["entries"]}["to_qkv"] == qkv.flops
    assert fx_fp8.get_reports(compiled)[0].flops(("fp8",)) == qkv.flops + att.flops


def test_node_flops_unknown_sizes_and_bad_op():
    assert node_flops("linear", [[None, 64], [8, 64]]) is None  # symbolic tokens: no number, not a guess
    assert node_flops("attention", [[1, 2, 8, 4], None, [1, 2, 8, 4]]) is None
    assert node_flops("linear", []) is None
    with pytest.raises(ValueError, match="'conv'"):
        node_flops("conv", [[1, 2], [2, 2]])
    assert dims_of(torch.empty(3, 4), 1.0) == [[3, 4], None]
    e = ReportEntry("linear", "m", None, "fp8", "", dims=[[5, 8], [4, 8]])
    assert e.flops == 2.0 * 5 * 4 * 8
    r = CompileReport(
        "fp8",
        "cpu",
        "inductor",
        None,
        entries=[e, ReportEntry("linear", "n", None, "native", "", dims=[[5, 8], [4, 8]])],
    )
    assert r.flops() == e.flops and math.isclose(r.flops(("fp8", "native")), 2 * e.flops)


def test_sensitivity_and_tiny_quality_read_the_numbers_not_the_strings():
    import fx_fp8.tools.sensitivity as sens
    from fx_fp8.tools.sensitivity_items import items_from_reports as _items
    from fx_fp8.config.fp8_config import FP8Config

    assert not hasattr(sens, "_flops")  # no parser of the display strings left
    # an entry whose display string says nothing: the work comes from its numbers alone
    r = CompileReport(
        "fp8",
        "cpu",
        "inductor",
        None,
        entries=[
            ReportEntry("linear", "blocks.0.ff", 0, "fp8", "", shapes="?", dims=[[1, 10, 8], [16, 8]]),
            ReportEntry("attention", "blocks.0.attn", 0, "fp8", "", shapes="?", dims=[[1, 2, 10, 4]] * 3),
        ],
    )
    items = {(i.kind, i.index): i.work for i in _items([r], FP8Config(), steps=2)}
    assert items[("linears_block", 0)] == 2.0 * 10 * 16 * 8
    assert items[("attention_layer", 0)] == 2.0 * 2 * 10 * 10 * 8
