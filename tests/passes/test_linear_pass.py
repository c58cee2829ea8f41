"""The linear pass: which linears become FP8/INT8 W8A8, which stay native and why; activation-quant
groups; per-layer numerics."""

import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import quant
from fx_fp8.ops.reference import ReferenceLowering
from fx_fp8.config.patterns import first_match
from fx_fp8.quant.rules import SENSITIVE_LAYER_PATTERNS

from checks import big_enough, decisions
from graph_capture import compile_stored, graph_module_of, run_pass, traced
from toy_models import TwoLinears


def rel_err(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_defaults_quantize_every_eligible_linear(family):
    report, out, native, linears = run_pass(family)
    got = decisions(report)
    assert set(got) == set(linears)
    assert report.count("attention", "fp8") == 0
    for name, lin in linears.items():
        hit = first_match(SENSITIVE_LAYER_PATTERNS, name)
        e = got[name]
        if hit is not None and big_enough(lin):
            # the structural reason (fx_fp8/graph/sensitive.py) wins over the name pattern where both apply;
            # the default runs sensitive layers weight-only (W8A16)
            assert e.action == "weight-only" and e.reason.startswith(
                (
                    f"known sensitive layer (pattern {hit!r})",
                    "timestep conditioning",
                    "adaLN modulation",
                    "final projection",
                )
            ), (name, e.reason)
            assert "weight-only (sensitive: weight_only)" in e.reason
        elif not big_enough(lin):
            assert e.action == "native" and ("min_features" in e.reason or "multiples of 16" in e.reason), (
                name,
                e.reason,
            )
        else:
            assert e.action == "fp8", (name, e.reason)
            assert e.reason.startswith("reference: FP8 W8A8, channel weight scales, dynamic per-token activations")
    # the sensitive layers of every family are among the unquantized-activation ones (weight-only, or
    # native where too small)
    kept = [n for n, e in got.items() if e.action in ("native", "weight-only")]
    assert any("embed" in n or n in ("img_in", "txt_in") for n in kept)
    assert any("proj_out" == n or "final_layer" in n for n in kept)
    assert report.count("linear", "fp8") >= 15 and report.count("linear", "weight-only") >= 3
    err = rel_err(out, native)
    assert 1e-4 < err < 0.05, err
    assert report.weights["original_copy_kept"] is True
    assert any("prepare_model" in note for note in report.notes)


def test_none_and_empty_ignored_layers_mean_no_extra_patterns(family):
    default, _, _, _ = run_pass(family)
    for value in ([], None):
        report, _, _, _ = run_pass(family, ignored_layers=value)
        assert {n: e.action for n, e in decisions(report).items()} == {
            n: e.action for n, e in decisions(default).items()
        }


def test_quantize_sensitive_quantizes_all_eligible(family):
    report, out, native, linears = run_pass(family, quantization_config={"quantize_sensitive": True})
    got = decisions(report)
    eligible = {n for n, lin in linears.items() if big_enough(lin)}
    assert {n for n, e in got.items() if e.action == "fp8"} == eligible
    default, _, _, _ = run_pass(family)
    assert report.count("linear", "fp8") > default.count("linear", "fp8")
    assert rel_err(out, native) > 1e-4


def test_qwen_ignored_img_mlp_adds_to_the_sensitive_layers():
    # pinned to native sensitive layers: the test is about which layers stay native
    report, out, native, linears = run_pass(
        "qwen-image", ignored_layers=["img_mlp"], quantization_config={"sensitive": "native"}
    )
    got = decisions(report)
    img_mlp = {n for n in linears if ".img_mlp." in n}
    assert len(img_mlp) == 4  # 2 blocks x (net.0.proj, net.2)
    native = {n for n, e in got.items() if e.action == "native"}
    small = {n for n, lin in linears.items() if not big_enough(lin)}  # img_in / proj_out: 16 features here
    sensitive = {n for n in linears if first_match(SENSITIVE_LAYER_PATTERNS, n)}
    # vLLM-Omni's recommended setting never quietly quantizes img_in / txt_in / modulation / proj_out
    assert native == img_mlp | small | sensitive
    assert {n for n, e in got.items() if "ignored_layers" in e.reason} == img_mlp
    assert all(
        got[n].reason
        == "ignored_layers pattern 'img_mlp' (remove it from quantization_config.ignored_layers to quantize this layer)"
        for n in img_mlp
    )
    assert got["txt_in"].action == "native" and {"txt_in", "norm_out.linear"} <= sensitive
    # "@defaults" (older configs) changes nothing: the sensitive layers are always kept
    report2, _, _, _ = run_pass(
        "qwen-image", ignored_layers=["img_mlp", "@defaults"], quantization_config={"sensitive": "native"}
    )
    assert {n for n, e in decisions(report2).items() if e.action == "native"} == native
    # the default: the same list, the sensitive layers weight-only instead of native
    got = decisions(run_pass("qwen-image", ignored_layers=["img_mlp"])[0])
    assert {n for n, e in got.items() if e.action == "native"} == img_mlp | small
    assert {n for n, e in got.items() if e.action == "weight-only"} == sensitive - small


def test_flux_qkv_share_one_activation_quantization():
    report, _, _, linears = run_pass("flux", quantization_config={"quantize_sensitive": True})
    got = decisions(report)
    for blk in ("transformer_blocks.0", "transformer_blocks.1"):
        groups = {got[f"{blk}.attn.{p}"].act_quant_group for p in ("to_q", "to_k", "to_v")}
        added = {got[f"{blk}.attn.{p}"].act_quant_group for p in ("add_q_proj", "add_k_proj", "add_v_proj")}
        assert len(groups) == 1 and len(added) == 1 and groups != added and "" not in groups
    # single blocks: proj_mlp reads the same normed input as to_q / to_k / to_v
    single = {
        got[f"single_transformer_blocks.0.{p}"].act_quant_group
        for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    }
    assert len(single) == 1
    # the graph holds exactly one quantization (one amax over rows) per group
    model, gm, inputs, native, _ = traced("flux")
    cfg = FP8Config.from_kwargs(quantization="fp8", quantization_config={"quantize_sensitive": True})
    fn, report = compile_stored(
        gm,
        inputs,
        cfg,
    )
    n_groups = len({e.act_quant_group for e in report.entries if e.op == "linear" and e.action == "fp8"})
    code = graph_module_of(fn).code
    assert code.count(".amax(") == n_groups < report.count("linear", "fp8")


@pytest.mark.parametrize("family", ["flux", "wan", "sd3"])
def test_int8_end_to_end_close(family):
    report, out, native, _ = run_pass(family, quantization="int8")
    assert report.count("linear", "int8") >= 10 and report.count("linear", "fp8") == 0
    assert all(e.reason.startswith("reference: INT8 W8A8") for e in report.entries if e.action == "int8")
    err = rel_err(out, native)
    assert 1e-5 < err < 0.05, err


class _Sizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(64, 64)
        self.odd = nn.Linear(64, 72)  # 72 is not a multiple of 16
        self.narrow = nn.Linear(72, 16)  # feeds from odd; both reasons possible, 16 < min_features
        self.small = nn.Linear(16, 64)

    def forward(self, x):
        return self.ok(x).sum() + self.narrow(self.odd(x)).sum() + self.small(x[..., :16]).sum()


def test_small_and_misaligned_layers_stay_native():
    m = _Sizes().eval()
    torch.compile(m, backend="fp8", options={"quantization": "fp8"})(torch.randn(8, 64))
    (report,) = fx_fp8.get_reports()
    got = {e.module: (e.action, e.reason) for e in report.entries}
    assert got["ok"][0] == "fp8"
    assert got["odd"] == (
        "native",
        "features 64->72 not multiples of 16 (FP8 matmul tiles; the layer's shape, no setting changes it)",
    )
    assert got["narrow"] == (
        "native",
        "features 72->16 not multiples of 16 (FP8 matmul tiles; the layer's shape, no setting changes it)",
    )
    assert got["small"] == (
        "native",
        (
            "small layer (16->64, below min_features=32): FP8 only costs time (lower "
            "quantization_config.min_features to quantize it)"
        ),
    )
    assert all(e.name_resolved for e in report.entries)
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    torch.compile(m, backend="fp8", options={"quantization": "fp8", "quantization_config": {"min_features": 0}})(
        torch.randn(8, 64)
    )
    (report,) = fx_fp8.get_reports()
    assert {e.module: e.action for e in report.entries}["small"] == "fp8"


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize(
    "granularity, block", [("tensor", None), ("channel", None), ("block", [128, 128]), ("block", [64, 32])]
)
@pytest.mark.parametrize("act", ["token", "tensor"])
@pytest.mark.parametrize("shape", [(256, 256), (512, 128), (192, 768)])
def test_quantized_linear_relative_mse(method, granularity, block, act, shape):
    in_f, out_f = shape
    g = torch.Generator().manual_seed(in_f + out_f)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)
    x = torch.randn(4, 77, in_f, generator=g)
    wq, ws = quant.quantize_weight(lin.weight.detach(), granularity, block, method)
    y = torch.ops.fx_fp8.quantized_linear(
        x,
        wq,
        ws,
        lin.bias.detach(),
        None,
        method=method,
        weight_granularity=granularity,
        weight_block=block or [],
        act_granularity="group" if block else act,
        lowering="reference",
    )
    ref = lin(x).detach()
    mse = float(((y - ref) ** 2).mean() / (ref**2).mean())
    assert y.shape == ref.shape and 1e-7 < mse < 0.002, mse


def test_static_input_scale_in_op():
    lin = nn.Linear(64, 64)
    x = torch.randn(10, 64)
    wq, ws = quant.quantize_weight(lin.weight.detach(), "channel")
    scale = torch.tensor(float(x.abs().max()) / 448.0)

    def run(s):
        return torch.ops.fx_fp8.quantized_linear(
            x,
            wq,
            ws,
            lin.bias.detach(),
            s,
            method="fp8",
            weight_granularity="channel",
            weight_block=[],
            act_granularity="token",
            lowering="reference",
        )

    assert rel_err(run(scale), lin(x).detach()) < 0.05
    # a too small static scale clips: the error grows, proving the scale is used
    assert rel_err(run(scale / 20), lin(x).detach()) > 0.3


def test_weight_only_fallback_warns_once(monkeypatch):
    calls = []

    def weight_only(self, weight, qcfg):
        calls.append(tuple(weight.shape))
        return "test device has no FP8 matrix units"

    monkeypatch.setattr(ReferenceLowering, "weight_only", weight_only)
    m, x = TwoLinears(hidden=128).eval(), torch.randn(8, 64)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compiled = torch.compile(m, backend="fp8", options={"quantization": "fp8"})
        out = compiled(x)
    msgs = [str(i.message) for i in w if "weight-only" in str(i.message)]
    assert msgs == [
        "fx_fp8: test device has no FP8 matrix units: fp8 linears use weight-only quantization "
        "(quantized storage, native matmul)"
    ]
    assert len(calls) == 2
    (report,) = fx_fp8.get_reports(compiled)
    assert [e.reason for e in report.entries] == [
        "reference: weight-only FP8 (channel scales), weights quantized at compile"
    ] * 2
    assert all(e.act_quant_group == "" for e in report.entries)
    ref = m(x).detach()
    assert 1e-5 < rel_err(out, ref) < 0.05
    # weight-only keeps activations unquantized: closer than W8A8
    torch._dynamo.reset()
    monkeypatch.undo()
    assert rel_err(torch.compile(m, backend="fp8", options={"quantization": "fp8"})(x), ref) > rel_err(out, ref)
