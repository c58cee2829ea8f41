"""One path to quantize a weight (fx_fp8/quant/recipe.py).

prepare_model and the linear pass quantize the same weight to the same bytes (same recipe,
a smoothing group of one); every caller (prepare_model, the pass at compile and at run time, a
prepared layer loading full-precision weights, fake quantization) goes through
WeightRecipe.quantize and group_smoothing; the recipe and the smoothing rule check their input;
the pass's messages say what prepare_model did (a hooked linear it left, sensitive layers it
quantized W8A8 under the weight-only default).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.ops import quant
from fx_fp8.ops.reference import ReferenceLowering
from fx_fp8.tools.tiny_model.fake_quant import fake_fp8
from fx_fp8.quant.recipe import Smoothing, WeightRecipe, group_smoothing
from fx_fp8.quant.weight_state import state_of
from fx_fp8.quant.quantized_linear import QuantizedLinear

ALPHA = 0.5


class Two(nn.Module):
    """A W8A8 linear feeding `proj_out`, which the default rules make weight-only (a sensitive name)."""

    def __init__(self, dim=256, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(dim)
        self.lin, self.proj_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        with torch.no_grad():
            for m in (self.lin, self.proj_out):
                m.weight.copy_(torch.randn(dim, dim, generator=g) / dim**0.5)
        self.to(dtype).eval()

    def forward(self, x):
        return self.proj_out(self.lin(x))


def inputs(seed, dim=256, dtype=torch.float32):
    x = torch.randn(64, dim, generator=torch.Generator().manual_seed(seed))
    x[:, 1::64] *= 20  # outlier channels: smoothing moves something
    return x.to(dtype)


def options(method, calibration=None, alpha=None, scheme="dynamic", **qc):
    qcfg = {"activation_scheme": scheme, "activation_scales": calibration, "smoothing_alpha": alpha, **qc}
    return {
        "quantization": method,
        "diffusion_kv_cache_dtype": None,
        "quantization_config": qcfg,
        "lowering": "reference",
        "downstream": "eager",
    }


def only_copy(model, weight):
    (entry,) = state_of(model, weight).copies.values()
    return entry.wq, entry.ws


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize(
    "method,scheme,alpha,qc",
    [
        ("int8", "static", ALPHA, {}),  # smoothed, static scales
        ("fp8", "dynamic", ALPHA, {}),  # smoothed, dynamic
        ("fp8", "dynamic", None, {"weight_granularity": "block"}),
    ],
    ids=["int8-static-smoothed", "fp8-dynamic-smoothed", "fp8-block"],
)
def test_prepare_model_and_the_pass_quantize_to_identical_bytes(method, scheme, alpha, qc):
    """Same recipe, a smoothing group of one (lin alone reads x): prepare_model's QuantizedLinear
    and the pass's compile-time copy hold the same bytes, scales, 1/s and static scale; the
    weight-only proj_out too."""
    model = Two(dtype=torch.bfloat16)
    calibration = fx_fp8.calibrate(model, [(inputs(s, dtype=torch.bfloat16),) for s in range(3)])
    opts = options(method, calibration if alpha is not None or scheme == "static" else None, alpha, scheme, **qc)
    unprepared = copy.deepcopy(model)
    result = fx_fp8.prepare_model(model, opts)
    assert result["quantized"] == ["lin", "proj_out"] and result["weight_only"] == ["proj_out"]
    with torch.no_grad():
        torch.compile(unprepared, backend="fp8", options=opts)(inputs(9, dtype=torch.bfloat16))
    (report,) = fx_fp8.get_reports()[-1:]
    assert {e.module: e.action for e in report.entries if e.op == "linear"} == {
        "lin": method,
        "proj_out": "weight-only",
    }
    for name in ("lin", "proj_out"):
        prepared, weight = model.get_submodule(name), unprepared.get_submodule(name).weight
        wq, ws = only_copy(unprepared, weight)
        assert same_bytes(prepared.weight.data, wq) and same_bytes(prepared.weight_scale, ws), name
    assert model.proj_out.input_smoothing is None and model.proj_out.weight.dtype == torch.int8  # W8A16 storage
    if alpha is not None:
        assert same_bytes(
            model.lin.input_smoothing, state_of(unprepared, unprepared.lin.weight).smoothing[alpha].inverse
        )
    else:
        assert model.lin.input_smoothing is None
    if scheme == "static":
        assert same_bytes(model.lin.input_scale, state_of(unprepared, unprepared.lin.weight).input_scale)


def test_every_caller_quantizes_through_the_one_recipe(monkeypatch):
    """quant.quantize_weight is called only from WeightRecipe.quantize and quant.smoothing_factors
    only from group_smoothing, by each caller: prepare_model, the pass at compile time, its
    run-time re-quantization after a weight change, refresh_weights, a full-precision load into a prepared layer,
    and fake quantization."""
    calls = []

    def spy(real):
        def wrapped(*a, **k):
            caller = sys._getframe(1).f_code
            calls.append((real.__name__, caller.co_name, os.path.basename(caller.co_filename)))
            return real(*a, **k)

        return wrapped

    monkeypatch.setattr(quant, "quantize_weight", spy(quant.quantize_weight))
    monkeypatch.setattr(quant, "smoothing_factors", spy(quant.smoothing_factors))
    one_path = {("quantize_weight", "quantize", "recipe.py"), ("smoothing_factors", "group_smoothing", "recipe.py")}

    def through_recipe(what, run) -> list:
        calls.clear()
        run()
        assert calls and set(calls) <= one_path, (what, calls)
        return [c[0] for c in calls]

    model = Two()
    calibration = fx_fp8.calibrate(model, [(inputs(s),) for s in range(3)])
    opts = options("int8", calibration, ALPHA)
    full = copy.deepcopy(model.state_dict())
    unprepared = copy.deepcopy(model)
    assert sorted(through_recipe("prepare_model", lambda: fx_fp8.prepare_model(model, opts))) == [
        "quantize_weight",
        "quantize_weight",
        "smoothing_factors",
    ]  # lin smoothed, proj_out weight-only
    compiled = torch.compile(unprepared, backend="fp8", options=opts)
    with torch.no_grad():
        assert sorted(through_recipe("the pass", lambda: compiled(inputs(9)))) == [
            "quantize_weight",
            "quantize_weight",
            "smoothing_factors",
        ]
        unprepared.lin.weight.data = unprepared.lin.weight * 0.5  # followed on the next call: W * s again
        assert through_recipe("re-quantization at run time", lambda: compiled(inputs(9))) == ["quantize_weight"]
        unprepared.lin.weight.data.mul_(0.5)  # in place through the alias: seen by refresh_weights
        assert through_recipe("refresh_weights", lambda: fx_fp8.refresh_weights(unprepared)) == ["quantize_weight"]
    assert through_recipe("load_state_dict", lambda: model.load_state_dict(full)) == ["quantize_weight"] * 2
    fake = Two()

    def fake_run():
        with fake_fp8(fake, fx_fp8.FP8Config(quantization="fp8", quantization_config={"min_features": 0})) as names:
            assert names == ["lin"]  # proj_out is weight-only: not simulated
            fake(inputs(1))

    assert through_recipe("fake quantization", fake_run) == ["quantize_weight"]


def test_recipe_checks_its_input():
    with pytest.raises(ValueError, match="unknown weight quantization method 'fp4'"):
        WeightRecipe("fp4", "channel")
    with pytest.raises(ValueError, match="unknown weight granularity 'row'"):
        WeightRecipe("fp8", "row")
    with pytest.raises(ValueError, match=r"block \[rows, cols\].*got \(128,\)"):
        WeightRecipe("fp8", "block", (128,))
    assert WeightRecipe("fp8", "channel", (128, 128)).block is None  # one cache key per scale layout
    with pytest.raises(ValueError, match=r"must be \[out, in\], got shape \[4\]"):
        WeightRecipe().quantize(torch.ones(4))
    with pytest.raises(ValueError, match=r"smoothing of 3 factors for a weight of shape \[2, 4\]"):
        WeightRecipe().quantize(torch.ones(2, 4), Smoothing.make(torch.ones(3), ALPHA))
    with pytest.raises(ValueError, match="at least one"):
        group_smoothing([], ALPHA)
    with pytest.raises(ValueError, match=r"channel maxima of 3 values for a weight of shape \[2, 4\]"):
        group_smoothing([(torch.ones(3), torch.ones(2, 4))], ALPHA)


def test_group_smoothing_takes_the_maximum_over_members():
    """s = max(amax)^alpha / max(|W| columns)^(1 - alpha) over the group; a group of one is the
    layer's own rule (what prepare_model uses)."""
    g = torch.Generator().manual_seed(0)
    a1, a2 = torch.rand(32, generator=g) * 4, torch.rand(32, generator=g) * 4
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(24, 32, generator=g)
    sm = group_smoothing([(a1, w1), (a2, w2)], ALPHA)
    expected = quant.smoothing_factors(torch.maximum(a1, a2), torch.maximum(w1.abs().amax(0), w2.abs().amax(0)), ALPHA)
    assert torch.equal(sm.factors, expected) and torch.equal(sm.inverse, 1.0 / expected)
    one = group_smoothing([(a1, w1)], ALPHA)
    assert torch.equal(one.factors, quant.smoothing_factors(a1, w1.abs().amax(0), ALPHA))
    assert one.key != sm.key and one.key[:2] == ("smooth", ALPHA)


def test_weight_only_recipe_follows_the_config_and_the_lowering():
    qcfg = fx_fp8.FP8Config(quantization="fp8").quantization_config
    r = WeightRecipe.weight_only(qcfg, ReferenceLowering())
    assert (r.method, r.granularity, r.block) == (
        ReferenceLowering().weight_only_method(qcfg.weight_only_method or qcfg.method),
        *quant.weight_only_layout(qcfg.weight_only_group_size),
    )
    assert WeightRecipe.w8a8(qcfg).key == (
        qcfg.method,
        qcfg.weight_granularity,
        None if qcfg.weight_granularity != "block" else tuple(qcfg.weight_block_size),
    )


def test_fake_quantization_simulates_the_method_and_refuses_smoothing():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    from fx_fp8.tools.tiny_model.fake_quant import fake_quant_weight

    recipe = WeightRecipe("int8", "channel")
    assert torch.equal(fake_quant_weight(w, recipe), recipe.dequantize(*recipe.quantize(w)))
    model = Two(dim=64)
    config = fx_fp8.FP8Config(
        quantization="fp8",
        quantization_config={
            "smoothing_alpha": ALPHA,
            "min_features": 0,
            "activation_scales": fx_fp8.calibrate(model, [(inputs(0, dim=64),)]),
        },
    )
    with fake_fp8(model, config), pytest.raises(ValueError, match="does not simulate .*smoothing_alpha=0.5"):
        model(inputs(0, dim=64))


# -- what the pass says about prepare_model's decisions ----------------------------------------------
def test_a_linear_prepare_model_left_for_its_hooks_is_reported_as_such():
    """prepare_model leaves a linear carrying a diffusers hook unreplaced; the compile report says
    so (not "call prepare_model ... to free them": it was called)."""
    from diffusers.hooks import HookRegistry, ModelHook

    model = Two()
    HookRegistry.check_if_exists_or_initialize(model.lin).register_hook(ModelHook(), "kept")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fx_fp8.prepare_model(model, options("fp8"))
    assert list(result["hooked"]) == ["lin"] and result["quantized"] == ["proj_out"]
    with torch.no_grad():
        torch.compile(model, backend="fp8", options=options("fp8"))(inputs(0))
    (report,) = fx_fp8.get_reports()[-1:]
    notes = " ".join(report.notes)
    assert "to free them" not in notes, report.notes
    assert "prepare_model left 1 linear(s) unreplaced because they carry diffusers hooks" in notes and "lin" in notes
    (row,) = [e for e in report.entries if e.module == "lin"]
    assert row.action == "fp8" and "weights quantized at compile (prepare_model left it" in row.reason


def test_an_unprepared_model_is_told_to_prepare():
    with torch.no_grad():
        torch.compile(Two(), backend="fp8", options=options("fp8"))(inputs(0))
    (report,) = fx_fp8.get_reports()[-1:]
    assert any("call fx_fp8.prepare_model(model, config) before torch.compile to free them" in n for n in report.notes)
    assert not any("prepare_model left" in n for n in report.notes)


@pytest.mark.parametrize(
    "mode,would",
    [("weight_only", "would run weight-only (W8A16)"), ("native", "would run native")],
    ids=["weight_only", "native"],
)
def test_sensitive_layers_prepared_w8a8_warning_says_what_the_rules_would_do(mode, would):
    """prepare_model without example inputs quantizes structurally sensitive layers W8A8; the
    compile's warning says what its rules would have done with them under `sensitive`."""
    from toy_models import toy, toy_inputs

    model, kw = toy(), toy_inputs()
    result = fx_fp8.prepare_model(model, quantization="fp8", quantization_config={"sensitive": mode})
    assert "blocks.0.ada" in result["quantized"] and "blocks.0.ada" not in result["weight_only"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            torch.compile(
                model, backend="fp8", options={"quantization": "fp8", "quantization_config": {"sensitive": mode}}
            )(**kw)
    (msg,) = [str(w.message) for w in caught if "prepare_model quantized" in str(w.message)]
    assert "keep native" not in msg
    assert f"sensitive {mode!r} they {would}" in msg and "blocks.0.ada" in msg and "run as prepared (W8A8)" in msg
