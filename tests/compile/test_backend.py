"""The fp8 / fp8_npu Dynamo backends: entry points, options, feature switches, downstream compilers."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config

from toy_models import AttentionBlock


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture
def block():
    torch.manual_seed(0)
    return AttentionBlock().eval(), torch.randn(2, 64, 64)


ENTRY_POINT_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_qkv = nn.Linear(64, 192)
            self.to_out = nn.Linear(64, 64)
            self.proj_out = nn.Linear(64, 64)
        def forward(self, x):
            q, k, v = self.to_qkv(x).view(2, 64, 3, 2, 32).permute(2, 0, 3, 1, 4)
            o = self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 64, 64))
            return self.proj_out(torch.relu(o))
    torch.manual_seed(0)
    x = torch.randn(2, 64, 64)
    result = {"imported_before": "fx_fp8" in sys.modules}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for backend in ("fp8", "fp8_npu", "fp8_npu"):
            torch._dynamo.reset()
            m = Block().eval()
            with torch.no_grad():
                ref, out = m(x), torch.compile(m, backend=backend)(x)
            result[backend] = float((out - ref).norm() / ref.norm())
    result["npu_warnings"] = [str(i.message) for i in w if "fp8_npu" in str(i.message)]
    import fx_fp8
    result["reports"] = [(r.backend, r.lowering, r.summary()) for r in fx_fp8.get_reports()]
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_entry_points_without_importing_fx_fp8():
    proc = subprocess.run([sys.executable, "-c", ENTRY_POINT_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["imported_before"] is False
    for backend in ("fp8", "fp8_npu"):
        assert 1e-4 < res[backend] < 0.05
    # no NPU here: a warning per compiled model (two fp8_npu models) that names the fallback
    assert len(res["npu_warnings"]) == 2 and all("'reference'" in w for w in res["npu_warnings"])
    assert [r[:2] for r in res["reports"]] == [["fp8", "reference"], ["fp8_npu", "reference"], ["fp8_npu", "reference"]]
    for _, _, summary in res["reports"]:
        assert summary == {"attention": {"fp8": 1, "native": 0}, "linear": {"fp8": 2, "native": 0, "weight-only": 1}}


def summary_for(block, **compile_kw):
    m, x = block
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    with torch.no_grad():
        compiled = torch.compile(m, backend="fp8", **compile_kw)
        out = compiled(x)
    (report,) = fx_fp8.get_reports(compiled)
    assert fx_fp8.get_reports()[-1] is report  # the recent-compiles log has it too
    return report, out


def test_no_options_applies_both(block):
    report, out = summary_for(block)
    # the default runs the sensitive final projection weight-only
    assert report.summary() == {
        "attention": {"fp8": 1, "native": 0},
        "linear": {"fp8": 2, "native": 0, "weight-only": 1},
    }
    assert (report.backend, report.lowering, report.downstream) == ("fp8", "reference", "eager")
    assert 1e-4 < rel_err(out, block[0](block[1]).detach()) < 0.05


@pytest.mark.parametrize(
    "options, attention, linear",
    [
        ({"diffusion_kv_cache_dtype": None}, 0, 2),
        ({"diffusion_kv_cache_dtype": "auto"}, 0, 2),
        ({"quantization": None}, 1, 0),
        ({"quantization": None, "diffusion_kv_cache_dtype": None}, 0, 0),
        ({"kv_cache_dtype": "fp8"}, 1, 0),  # legacy key: attention-only opt-in
        ({"config": FP8Config.from_kwargs(quantization=None)}, 1, 0),
        ({"config": {"diffusion_kv_cache_dtype": None}}, 0, 2),
    ],
)
def test_feature_switches_through_options(block, options, attention, linear):
    report, out = summary_for(block, options=options)
    assert report.count("attention", "fp8") == attention and report.count("linear", "fp8") == linear
    assert report.count("attention") == 1 and report.count("linear") == 3
    if attention == linear == 0:
        torch.testing.assert_close(out, block[0](block[1]).detach())  # nothing quantized: exact


def test_config_yaml_path_option(block, tmp_path):
    path = tmp_path / "fp8.yaml"
    FP8Config.from_kwargs(diffusion_kv_cache_dtype="fp8", attention={"granularity": "head", "hadamard": False}).to_yaml(
        path
    )
    report, _ = summary_for(block, options={"config": str(path)})
    (entry,) = [e for e in report.entries if e.op == "attention"]
    assert entry.action == "fp8" and entry.reason == "reference: head scales"
    assert report.count("linear", "fp8") == 0


def test_any_config_key_through_options(block):
    report, _ = summary_for(
        block, options={"quantization_config": {"weight_block_size": [64, 64]}, "ignored_layers": ["to_out"]}
    )
    got = {e.module: (e.action, e.reason) for e in report.entries if e.op == "linear"}
    assert got["to_out"] == (
        "native",
        "ignored_layers pattern 'to_out' (remove it from quantization_config.ignored_layers to quantize this layer)",
    )
    assert got["to_qkv"][0] == "fp8" and "block [64, 64]" in got["to_qkv"][1]


def test_unknown_option_did_you_mean(block):
    m, x = block
    with pytest.raises(
        Exception,
        match=r"unknown config key 'diffusion_kv_cache_skip_step' \(did you mean 'diffusion_kv_cache_skip_steps'\?\)",
    ):
        torch.compile(m, backend="fp8", options={"diffusion_kv_cache_skip_step": "0"})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"invalid diffusion_kv_cache_dtype 'fp16'"):
        torch.compile(m, backend="fp8", options={"diffusion_kv_cache_dtype": "fp16"})(x)


def test_dump_graphs_option(block):
    report, _ = summary_for(block, options={"dump_graphs": True})
    stages = list(report.graphs)
    assert stages == ["before", "after_fp8_attention", "after_prequantized_linear", "after_quantized_linear"]
    assert (
        "fp8_attention" not in report.graphs["before"]
        and "fx_fp8.fp8_attention" in report.graphs["after_fp8_attention"]
    )


def test_report_serialises(block):
    report, _ = summary_for(block)
    d = json.loads(report.to_json())
    assert d["summary"]["linear"]["fp8"] == 2 and len(d["entries"]) == 4
    assert any(e["reason"].startswith("final projection") for e in d["entries"])
    assert "to_qkv" in report.table() and "action" in report.table()


@pytest.mark.parametrize("downstream", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_downstream_compilers(block, downstream):
    report, out = summary_for(block, options={"downstream": downstream})
    assert report.downstream == downstream
    assert report.summary() == {
        "attention": {"fp8": 1, "native": 0},
        "linear": {"fp8": 2, "native": 0, "weight-only": 1},
    }
    if downstream == "inductor":
        _, eager_out = summary_for(block, options={"downstream": "eager"})
        # same custom ops, opaque to Inductor: the numerics match the eager downstream
        torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
