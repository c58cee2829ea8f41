"""INT8 W8A8 numerics and SmoothQuant-style smoothing (quantization_config.smoothing_alpha).

Per-layer relative MSE on Gaussian and outlier-channel activations with and without smoothing; a
calibrated + smoothed tiny Flux end to end (an int8 request never runs FP8: report rows and the
reference lowering's scaled_mm calls); q/k/v keep one shared quantization; 1/s is looked up per
call (a graph shared between model instances uses each instance's own); the quantized-copy
cache keys include the smoothing; prepare_model's per-layer `input_smoothing`; the NPU lowering
multiplies before its fused quantization; errors that name the missing key or the layer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import quant
from fx_fp8.ops.reference import ReferenceLowering
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.quant.weight_state import quantized_copies_of, state_of
from fx_fp8.quant.quantized_linear import QuantizedLinear


def smoothing_of(model, weight, alpha):
    return state_of(model, weight).smoothing[alpha]


from graph_capture import Capture, compile_stored, graph_module_of
from npu_sim import torch_npu_sim  # noqa: F401  (fixture)
from toy_models import TwoLinears

ALPHA = 0.5


def rel_mse(y, ref) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float(((y - ref) ** 2).mean() / (ref**2).mean())


def rel_err(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def activations(kind: str, in_f: int, seed: int, rows: int = 4 * 77) -> torch.Tensor:
    """Gaussian tokens; "outliers": the same with 4 fixed input channels x20 (what SmoothQuant targets)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g)
    if kind == "outliers":
        x[:, outlier_channels(in_f)] *= 20
    return x


def outlier_channels(in_f: int) -> torch.Tensor:
    return torch.arange(4) * (in_f // 4) + 1


def one_linear(in_f: int, out_f: int) -> nn.Module:
    g = torch.Generator().manual_seed(in_f + out_f)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)
    return nn.Sequential(lin).eval()


def options(method="int8", alpha=None, scales=None, scheme="dynamic", **qc):
    qcfg = {"activation_scheme": scheme, "activation_scales": scales, "smoothing_alpha": alpha, **qc}
    if "sensitive" not in qc and "quantize_sensitive" not in qc:
        qcfg["sensitive"] = "native"  # smoothing is about W8A8 layers; weight-only ones (the default's) never smooth
    return {
        "quantization": method,
        "diffusion_kv_cache_dtype": None,
        "quantization_config": qcfg,
        "lowering": "reference",
        "downstream": "eager",
    }


def tiny_flux(dtype=torch.float32, layers=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_transformer("flux", layers=layers, dtype=dtype)


# -- per-layer numerics ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
@pytest.mark.parametrize("shape", [(256, 256), (512, 128), (192, 768)])
def test_int8_layer_relative_mse_with_and_without_smoothing(kind, shape, record_property):
    in_f, out_f = shape
    m = one_linear(in_f, out_f)
    calibration = fx_fp8.calibrate(m, [(activations(kind, in_f, seed),) for seed in range(4)])
    x = activations(kind, in_f, 100)  # held out
    ref = m(x)
    err = {}
    for alpha in (None, ALPHA):
        torch._dynamo.reset()
        with torch.no_grad():
            y = torch.compile(m, backend="fp8", options=options("int8", alpha, calibration, min_features=0))(x)
        (report,) = fx_fp8.get_reports()[-1:]
        assert [e.action for e in report.entries] == ["int8"]
        assert ("smoothed (alpha 0.5)" in report.entries[0].reason) == (alpha is not None)
        err[alpha] = rel_mse(y, ref)
    record_property("relative_mse", {"unsmoothed": err[None], "smoothed": err[ALPHA]})
    print(
        f"\nint8 {in_f}->{out_f} {kind}: relative MSE {err[None]:.2e} unsmoothed, {err[ALPHA]:.2e} smoothed "
        f"(alpha {ALPHA})"
    )
    assert 1e-7 < err[None] < 0.002 and 1e-7 < err[ALPHA] < 0.002, err
    if kind == "outliers":
        assert err[ALPHA] < 0.5 * err[None], err  # measured 5-9x lower
    else:
        assert err[ALPHA] < 1.2 * err[None], err  # nothing to migrate: about the same


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_smoothing_with_both_methods_and_schemes(method, scheme):
    """Static scales combine with smoothing: the scale of x / s follows from the channel maxima."""
    m = one_linear(256, 256)
    calibration = fx_fp8.calibrate(m, [(activations("outliers", 256, seed),) for seed in range(4)])
    x = activations("outliers", 256, 100)
    ref = m(x)
    err = {}
    for alpha in (None, ALPHA):
        torch._dynamo.reset()
        with torch.no_grad():
            y = torch.compile(m, backend="fp8", options=options(method, alpha, calibration, scheme))(x)
        err[alpha] = rel_mse(y, ref)
    assert err[ALPHA] < err[None] < 0.004, err
    weight = m[0].weight
    sm = smoothing_of(m, weight, ALPHA)
    if scheme == "static":
        expected = float((calibration.channel_amax["0"] * sm.inverse).max()) / quant.METHODS[method][1]
        assert float(state_of(m, weight).input_scale) == pytest.approx(expected, rel=1e-6)


def test_smoothing_factors_formula_and_range():
    amax = torch.tensor([4.0, 0.0, 1e12, 9.0])
    wmax = torch.tensor([1.0, 2.0, 1.0, 0.0])
    s = quant.smoothing_factors(amax, wmax, 0.5)
    assert s.dtype == torch.float32
    assert s.tolist() == [2.0, 1.0, quant.SMOOTHING_RANGE[1], 1.0]  # 4^.5/1^.5; dead channel; clamped; no weight
    assert quant.smoothing_factors(torch.tensor([8.0]), torch.tensor([0.5]), 0.0).tolist() == [2.0]  # 1 / w
    assert quant.smoothing_factors(torch.tensor([8.0]), torch.tensor([0.5]), 1.0).tolist() == [8.0]  # a


# -- end to end -----------------------------------------------------------------------------------
@pytest.fixture
def scaled_mm_methods(monkeypatch):
    """Every `method` the reference lowering's scaled_mm is called with."""
    calls = []
    real = ReferenceLowering.scaled_mm

    def spy(self, xq, x_scale, wq, w_scale, bias, *, method, **kw):
        calls.append((method, xq.dtype, wq.dtype))
        return real(self, xq, x_scale, wq, w_scale, bias, method=method, **kw)

    monkeypatch.setattr(ReferenceLowering, "scaled_mm", spy)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_calibrated_smoothed_flux_int8_end_to_end(scheme, scaled_mm_methods):
    model = tiny_flux(layers=2)  # build_tiny_transformer("flux")
    calibration = fx_fp8.calibrate(model, [example_inputs("flux", model, seed=s) for s in (1, 2, 3)])
    kw = example_inputs("flux", model, seed=0)
    with torch.no_grad():
        native = output_tensor(model(**kw))
    outs, reports = {}, {}
    for alpha in (None, ALPHA):
        torch._dynamo.reset()
        scaled_mm_methods.clear()
        with torch.no_grad():
            outs[alpha] = output_tensor(
                torch.compile(model, backend="fp8", options=options("int8", alpha, calibration, scheme))(**kw)
            )
        reports[alpha] = report = fx_fp8.get_reports()[-1]
        rows = [e for e in report.entries if e.op == "linear" and e.action != "native"]
        # an int8 request never runs FP8: the report rows and the kernels actually called
        assert len(rows) >= 20 and {e.action for e in rows} == {"int8"}
        assert all(e.reason.startswith("reference: INT8 W8A8") for e in rows)
        assert all(("smoothed (alpha 0.5)" in e.reason) == (alpha is not None) for e in rows)
        assert len(scaled_mm_methods) == len(rows)  # one call per quantized linear
        assert set(scaled_mm_methods) == {("int8", torch.int8, torch.int8)}
        err = rel_err(outs[alpha], native)
        print(f"\nflux int8 {scheme}, smoothing {alpha}: relative error vs native {err:.4f}")
        assert 1e-5 < err < 0.05, err
    assert not torch.equal(outs[ALPHA], outs[None])
    assert rel_err(outs[ALPHA], outs[None]) > 1e-5
    if scheme == "dynamic":  # the groups are unchanged by smoothing: q/k/v still share one quantization
        groups = {a: {e.module: e.act_quant_group for e in reports[a].entries if e.action == "int8"} for a in reports}
        assert groups[None] == groups[ALPHA]
        qkv = {groups[ALPHA][f"transformer_blocks.0.attn.{p}"] for p in ("to_q", "to_k", "to_v")}
        assert len(qkv) == 1
        # one smoothing vector per group, shared by its members' weights
        ws = [model.get_submodule(f"transformer_blocks.0.attn.{p}").weight for p in ("to_q", "to_k", "to_v")]
        assert (
            smoothing_of(model, ws[0], ALPHA) is smoothing_of(model, ws[1], ALPHA) is smoothing_of(model, ws[2], ALPHA)
        )
        assert smoothing_of(
            model, model.get_submodule("transformer_blocks.0.ff.net.2").weight, ALPHA
        ) is not smoothing_of(model, ws[0], ALPHA)


@pytest.mark.slow
def test_graph_reads_smoothing_as_an_input_and_fuses_into_one_quantization_per_group():
    """1/s reaches the graph as an input fx_fp8 appends (the group's first member's), once per
    group, never as a constant; the graph still holds one quantization (one amax) per group."""
    model = tiny_flux()
    calibration = fx_fp8.calibrate(model, [example_inputs("flux", model, seed=1)])
    kw = example_inputs("flux", model)
    cap = Capture()
    with torch.no_grad():
        torch.compile(model, backend=cap, fullgraph=True)(**kw)
    ((gm, inputs),) = cap.graphs
    cfg = FP8Config.from_kwargs(**options("int8", ALPHA, calibration))
    fn, report = compile_stored(gm, inputs, cfg)
    graph = graph_module_of(fn).graph
    inverses = [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("fx_fp8_inverse_")]
    groups = {e.act_quant_group for e in report.entries if e.op == "linear" and e.action == "int8"}
    assert len(inverses) == len(groups) < report.count("linear", "int8")
    assert all(len(n.users) == 1 for n in inverses)  # each feeds its group's one multiply
    assert not [n for n in graph.nodes if n.op == "get_attr"]  # no tensor constant was added
    assert graph_module_of(fn).code.count(".amax(") == len(groups)
    scaled = [n for n in graph.nodes if n.target is torch.ops.fx_fp8.scaled_mm.default]
    assert scaled  # not vacuous: all() of nothing is True
    assert scaled and all(n.args[2].name.startswith("fx_fp8_wq_") and n.kwargs["method"] == "int8" for n in scaled)


@pytest.mark.slow
def test_inductor_fuses_the_smoothing_multiply_into_the_quantization():
    """Under Inductor, x * (1/s) adds no kernel: it joins the kernel that produces and quantizes x."""
    from inductor_code import kernels
    from toy_models import ModulatedBlock

    m = ModulatedBlock().eval()
    calibration = fx_fp8.calibrate(m, [(torch.randn(1, 256, 128), torch.randn(1, 128))])
    plain, _, _, _ = kernels({"quantization": "int8", "quantization_config": {"quantize_sensitive": True}})
    smoothed, report, out, ref = kernels(
        {
            "quantization": "int8",
            "quantization_config": {
                "quantize_sensitive": True,
                "activation_scales": calibration,
                "smoothing_alpha": ALPHA,
            },
        }
    )
    assert len(smoothed) == len(plain), (plain, smoothed)
    assert len([k for k in smoothed if "amax" in k and "mul" in k]) == 2  # both groups smoothed in their kernel
    assert any(True for e in report.entries if e.op == 'linear')  # not vacuous: all() of nothing is True
    assert all("smoothed" in e.reason for e in report.entries if e.op == "linear")
    for a, b in zip(out, ref):
        assert rel_err(a, b) < 0.05


@pytest.mark.slow
def test_one_instance_callable_refuses_another_instances_weights():
    """Dynamo shares one graph between model instances (Wan2.2's two experts); fx_fp8's dispatch
    gives each instance its own callable, with its own W * s copies and 1/s (tests/pipeline/test_two_experts.py
    runs both experts). One instance's callable handed another instance's weights must refuse,
    naming the problem, rather than run expert 0's copies on expert 1's tensors."""

    def capture(model, kw):
        torch._dynamo.reset()
        cap = Capture()
        with torch.no_grad():
            torch.compile(model, backend=cap, fullgraph=True)(**kw)
        return cap.graphs[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experts = [build_tiny_transformer("wan", layers=1, seed=s) for s in (0, 1)]
    kw = example_inputs("wan", experts[0])
    fns, inputs = [], []
    for expert in experts:
        calibration = fx_fp8.calibrate(expert, [example_inputs("wan", expert, seed=s) for s in (1, 2)])
        gm, ins = capture(expert, kw)
        fn, report = compile_stored(gm, ins, FP8Config.from_kwargs(**options("int8", ALPHA, calibration)))
        assert report.count("linear", "int8") >= 4
        fns.append(fn)
        inputs.append(ins)
    first = lambda res: res[0] if isinstance(res, (list, tuple)) else res  # noqa: E731
    with torch.no_grad():
        own = first(fns[1](*inputs[1]))
        native = output_tensor(experts[1](**kw))
        with pytest.raises(RuntimeError, match="weight its model instance does not hold"):
            fns[0](*inputs[1])  # expert 0's callable, expert 1's tensors
        torch.testing.assert_close(first(fns[1](*inputs[1])), own, rtol=0, atol=0)
    assert rel_err(output_tensor(own), native) < 0.05


def test_cache_key_includes_the_smoothing():
    m = one_linear(256, 256)
    calibration = fx_fp8.calibrate(m, [(activations("outliers", 256, 0),)])
    x = activations("outliers", 256, 1)
    weight = m[0].weight
    with torch.no_grad():
        for alpha in (None, ALPHA, 0.8):
            torch._dynamo.reset()
            torch.compile(m, backend="fp8", options=options("int8", alpha, calibration))(x)
    keys = list(state_of(m, weight).copies)
    assert len(keys) == 3 and keys[0] == ("int8", "channel", None)
    assert keys[1][:3] == keys[2][:3] == keys[0]
    assert keys[1][3][:2] == ("smooth", 0.5) and keys[2][3][:2] == ("smooth", 0.8)
    # the smoothed copy is W * s (not W), and its 1/s is counted with the copies
    sm = smoothing_of(m, weight, ALPHA)
    copy = state_of(m, weight).copies[keys[1]]
    wq, ws = copy.wq, copy.ws
    deq = quant.dequantize_weight(wq, ws, "channel")
    assert rel_err(deq, weight * sm.factors) < 0.03 and rel_err(deq, weight) > 0.5
    assert len(quantized_copies_of(m)) == 3 * 2 + 2  # three copies (weight, scale), two smoothings' 1/s


# -- prepare_model ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_prepare_model_smooths_each_layer(scheme):
    model = tiny_flux()
    calibration = fx_fp8.calibrate(model, [example_inputs("flux", model, seed=s) for s in (1, 2)])
    kw = example_inputs("flux", model, seed=0)
    with torch.no_grad():
        native = output_tensor(model(**kw))
    cfg = FP8Config.from_kwargs(**options("int8", ALPHA, calibration, scheme))
    result = fx_fp8.prepare_model(model, cfg)
    layer = model.get_submodule("transformer_blocks.0.attn.to_q")
    assert isinstance(layer, QuantizedLinear) and layer.weight.dtype == torch.int8
    assert layer.input_smoothing.shape == (layer.in_features,) and layer.input_smoothing.dtype == torch.float32
    assert "smoothed inputs" in repr(layer)
    # compiled with the dynamic config: prepared layers run as prepared (static scales included). The
    # backend's static-scale name check counts nn.Linear modules only (fx_fp8/compile/backend.py), so a
    # static config would reject a prepared model's scales.
    run_cfg = FP8Config.from_kwargs(**options("int8", ALPHA, calibration))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = output_tensor(model(**kw))
        compiled = output_tensor(torch.compile(model, backend="fp8", options={"config": run_cfg})(**kw))
    assert rel_err(eager, native) < 0.05
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    rows = [e for e in fx_fp8.get_reports()[-1].entries if e.op == "linear" and e.action == "int8"]
    assert len(rows) == len(result["quantized"]) and all("smoothed" in e.reason for e in rows)
    assert len({e.act_quant_group for e in rows}) == len(rows)  # a prepared layer's own 1/s: never shared
    # the buffer follows device moves and keeps its dtype under dtype casts
    model.to(torch.bfloat16)
    assert layer.input_smoothing.dtype == torch.float32


# -- the NPU lowering -------------------------------------------------------------------------------
@pytest.mark.slow
def test_npu_multiplies_before_its_fused_quantization(torch_npu_sim):
    model = tiny_flux(torch.bfloat16)
    calibration = fx_fp8.calibrate(model, [example_inputs("flux", model, seed=1, dtype=torch.bfloat16)])
    kw = example_inputs("flux", model, dtype=torch.bfloat16)
    out = {}
    with torch.no_grad():
        for lowering in ("npu", "reference"):
            torch._dynamo.reset()
            opts = dict(options("int8", ALPHA, calibration), lowering=lowering)
            out[lowering] = output_tensor(torch.compile(model, backend="fp8_npu", options=opts, fullgraph=True)(**kw))
            if lowering == "npu":
                report = fx_fp8.get_reports()[-1]
    rows = [e for e in report.entries if e.op == "linear" and e.action == "int8"]
    assert rows and all("smoothed" in e.reason for e in rows)
    groups = {e.act_quant_group for e in rows}
    assert torch_npu_sim.calls["npu_dynamic_quant"] == len(groups)  # still one fused quantization per group
    assert torch_npu_sim.calls["npu_quant_matmul"] == len(rows)
    assert rel_err(out["npu"], out["reference"]) < 1e-2


# -- errors -------------------------------------------------------------------------------------------
def test_smoothing_needs_a_calibration_with_channel_statistics():
    with pytest.raises(ValueError, match="smoothing_alpha needs quantization_config.activation_scales"):
        FP8Config.from_kwargs(quantization="int8", quantization_config={"smoothing_alpha": 0.5})
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="invalid quantization_config.smoothing_alpha"):
            FP8Config.from_kwargs(
                quantization="int8", quantization_config={"smoothing_alpha": bad, "activation_scales": {"0": 0.1}}
            )
    m = one_linear(256, 256)
    old = {"format": "fx_fp8.quant.activation_scales/1", "scales": {"0": 0.1}}  # written before channel_amax existed
    for source in (old, {"0": 0.1}):
        opts = options("int8", ALPHA, source)
        with pytest.raises(Exception, match="smoothing_alpha needs per-channel activation statistics.*'channel_amax'"):
            torch.compile(m, backend="fp8", options=opts)(torch.randn(4, 256))
        torch._dynamo.reset()
        with pytest.raises(ValueError, match="no 'channel_amax' section"):
            fx_fp8.prepare_model(one_linear(256, 256), FP8Config.from_kwargs(**opts))


def test_channel_statistics_of_the_wrong_length_name_the_layer():
    m = one_linear(256, 256)
    bad = {"format": "fx_fp8.quant.activation_scales/1", "scales": {"0": 0.1}, "channel_amax": {"0": [1.0] * 255}}
    with pytest.raises(Exception, match="channel_amax for '0' has 255 values but the layer has 256 input features"):
        torch.compile(m, backend="fp8", options=options("int8", ALPHA, bad))(torch.randn(4, 256))
    with pytest.raises(ValueError, match="channel_amax for '0' has 255 values"):
        fx_fp8.prepare_model(m, FP8Config.from_kwargs(**options("int8", ALPHA, bad)))
    assert type(m[0]) is nn.Linear  # the error left the model as it was


def test_a_layer_without_channel_statistics_stays_native():
    m, x = TwoLinears(relu=False).eval(), torch.randn(8, 64)
    calibration = fx_fp8.calibrate(m, [(x,)])
    partial = {
        "format": "fx_fp8.quant.activation_scales/1",
        "scales": dict(calibration),
        "channel_amax": {"a": calibration.channel_amax["a"].tolist()},
    }
    torch.compile(m, backend="fp8", options=options("int8", ALPHA, partial))(x)
    got = {e.module: (e.action, e.reason) for e in fx_fp8.get_reports()[-1].entries}
    assert got["a"][0] == "int8"
    assert got["b"] == (
        "native",
        "no channel statistics for smoothing_alpha in the calibration (recalibrate with fx_fp8.calibrate)",
    )
    other = {"format": "fx_fp8.quant.activation_scales/1", "scales": {"x": 0.1}, "channel_amax": {"x": [1.0] * 64}}
    torch._dynamo.reset()
    with pytest.raises(Exception, match="none of the 2 eligible linears of this graph has channel_amax"):
        torch.compile(m, backend="fp8", options=options("int8", ALPHA, other))(x)


def test_prepared_smoothed_layers_stay_correct_where_linears_are_weight_only(monkeypatch):
    """A prepared layer holds W * s: on a device without INT8/FP8 matrix units (weight-only linears)
    its input must still be multiplied by 1/s."""
    m = one_linear(256, 256)
    calibration = fx_fp8.calibrate(m, [(activations("outliers", 256, seed),) for seed in range(2)])
    x = activations("outliers", 256, 100)
    with torch.no_grad():
        ref = m(x)
    fx_fp8.prepare_model(m, FP8Config.from_kwargs(**options("int8", ALPHA, calibration, min_features=0)))
    monkeypatch.setattr(ReferenceLowering, "weight_only", lambda self, weight, qcfg: "test device: no INT8 units")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = torch.compile(m, backend="fp8", options=options("int8", ALPHA, calibration, min_features=0))(x)
    (entry,) = fx_fp8.get_reports()[-1].entries
    assert "weight-only" in entry.reason
    assert rel_mse(y, ref) < 1e-3  # without the 1/s the output would be off by the factors s
