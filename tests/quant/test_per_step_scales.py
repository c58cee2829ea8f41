"""Per-step static activation scales: fx_fp8.calibrate(..., per_step=True) records the maxima per
group of denoising steps, and static linears (compiled, prepared, reloaded) quantize with the scale
of the published step's group, looked up per call: changing the step recompiles nothing."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.activation_scales import FORMAT
from fx_fp8.ops import quant
from fx_fp8.quant.quantized_linear import QuantizedLinear

STEPS = 4
FP8_MAX, INT8_MAX = 448.0, 127.0


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64)).eval()


def inputs():
    """Activations whose range grows with the step: step s is ~(1 + 3 s) times step 0."""
    g = torch.Generator().manual_seed(1)
    return {s: torch.randn(16, 64, generator=g) * (1 + 3 * s) for s in range(STEPS)}


def run_steps(xs):
    def run(m):
        for s, x in xs.items():
            with fx_fp8.denoising_step(s):
                m(x)

    return run


def options(scales, method="int8"):
    return {"quantization": method, "quantization_config": {"activation_scheme": "static", "activation_scales": scales}}


def reference(m, x, scale0: float, scale2: float, method: str):
    """The two linears quantized per channel, each activation with the given static scale (max|x| / 448,
    as calibrated: INT8 maps it to its own range), through the eager reference op."""
    qmax = FP8_MAX if method == "fp8" else INT8_MAX

    def lin(layer, x, scale):
        wq, ws = quant.quantize_weight(layer.weight.detach(), "channel", None, method)
        s = torch.tensor(scale * FP8_MAX / qmax, dtype=torch.float32)
        return torch.ops.fx_fp8.quantized_linear(
            x,
            wq,
            ws,
            layer.bias.detach(),
            s,
            method=method,
            weight_granularity="channel",
            weight_block=[],
            act_granularity="token",
            lowering="reference",
        )

    return lin(m[2], torch.relu(lin(m[0], x, scale0)), scale2)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


# -- calibration -------------------------------------------------------------------------------
def test_calibrate_per_step_records_each_step_and_groups():
    m, xs = model(), inputs()
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True)
    assert cal.per_step and cal.step_groups == ((0, 0), (1, 1), (2, 2), (3, 3))
    first = torch.tensor([float(x.abs().max()) / FP8_MAX for x in xs.values()])
    assert torch.allclose(cal.step_scales["0"], first)
    # the per-tensor scale is still the all-steps maximum: what one static scale would be
    assert cal == pytest.approx(fx_fp8.calibrate(m, list((x,) for x in xs.values())))
    assert cal["0"] == pytest.approx(float(first.max()))
    assert not cal.single().per_step and cal.single() == cal

    two = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups=2)
    assert two.step_groups == ((0, 1), (2, 3))
    assert torch.allclose(two.step_scales["0"], torch.stack([first[:2].max(), first[2:].max()]))
    uneven = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups="0, 1-3")
    assert uneven.step_groups == ((0, 0), (1, 3))
    assert torch.allclose(uneven.step_scales["0"], torch.stack([first[0], first[1:].max()]))
    listed = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups=[(0, 2), (3, 3)])
    assert listed.step_groups == ((0, 2), (3, 3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(step_groups=2), r"step_groups=2 needs per_step=True"),
        (dict(per_step="yes"), r"invalid per_step 'yes'"),
        (dict(per_step=True, step_groups=0), r"invalid step_groups 0: expected a number of groups >= 1"),
        (dict(per_step=True, step_groups=5), r"invalid step_groups 5"),
        (dict(per_step=True, step_groups=True), r"invalid step_groups True"),
        (dict(per_step=True, step_groups="0-2,2-3"), r"step groups 0-2 and 2-3 overlap"),
        (dict(per_step=True, step_groups="0-1"), r"ran step\(s\) 2-3 that are in no group"),
        (dict(per_step=True, step_groups="0-3,7"), r"ran no step of group\(s\) 7"),
        (dict(per_step=True, step_groups="0-a"), r"invalid token '0-a'|invalid token 'a'"),
        (dict(per_step=True, step_groups="0-1,,2-3"), r"invalid group '' in step_groups"),
        (dict(per_step=True, step_groups="3-1"), r"range end 1 is below its start 3"),
        (dict(per_step=True, step_groups=[(0, 1, 2)]), r"invalid group \(0, 1, 2\)"),
    ],
)
def test_bad_step_groups_are_errors_naming_the_value(kwargs, match):
    m, xs = model(), inputs()
    with pytest.raises(ValueError, match=match):
        fx_fp8.calibrate(m, run_steps(xs), **kwargs)


def test_calibrate_per_step_needs_a_published_step():
    m, xs = model(), inputs()
    with pytest.raises(ValueError, match=r"per_step=True.*no denoising step published.*publish_steps"):
        fx_fp8.calibrate(m, [(xs[0],)], per_step=True)


# -- compiled (unprepared) ---------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_compiled_static_linears_use_the_published_steps_scale(method, downstream_compiles):
    m, xs = model(), inputs()
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True)
    s0, s2 = cal.step_scales["0"], cal.step_scales["2"]
    compiled = torch.compile(m, backend="fp8", options=options(cal, method))
    x = xs[3]  # the largest activations: a step's scale smaller than step 3's clips them
    with torch.no_grad():
        native = m(x)
        outs = {}
        for s in (3, 0, 2, 1, 3):
            with fx_fp8.denoising_step(s):
                outs[s] = compiled(x)
            ref = reference(m, x, float(s0[s]), float(s2[s]), method)
            assert rel(outs[s], ref) < 1e-4, (s, rel(outs[s], ref))
    assert len(downstream_compiles) == 1  # one graph for every step: the scale is looked up, not compiled in
    assert rel(outs[3], native) < 0.05 and rel(outs[0], native) > 0.3  # step 0's scale clips step 3's input
    (report,) = fx_fp8.get_reports()
    linears = [e for e in report.entries if e.op == "linear"]
    assert [e.action for e in linears] == [method] * 2
    assert all("static per-step activations" in e.reason for e in linears)


def test_step_outside_the_groups_is_an_error_and_no_step_uses_the_all_steps_scale():
    m, xs = model(), inputs()
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups=2)
    compiled = torch.compile(m, backend="fp8", options=options(cal))
    with torch.no_grad():
        with fx_fp8.denoising_step(STEPS):
            with pytest.raises(ValueError, match=r"denoising step 4 is in none of the step groups \(0-1,2-3\)"):
                compiled(xs[0])
        with pytest.warns(UserWarning, match="no denoising step is published"):
            out = compiled(xs[3])
    assert rel(out, reference(m, xs[3], cal["0"], cal["2"], "int8")) < 1e-4


def test_one_scale_calibration_compiles_the_plain_static_op():
    """.single() (or per_step=False) keeps one scale per layer: the graph reads no step."""
    m, xs = model(), inputs()
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True).single()
    compiled = torch.compile(m, backend="fp8", options=options(cal))
    with torch.no_grad(), fx_fp8.denoising_step(0):
        out = compiled(xs[3])
    assert rel(out, reference(m, xs[3], cal["0"], cal["2"], "int8")) < 1e-4
    (report,) = fx_fp8.get_reports()
    assert any(True for e in report.entries if e.op == 'linear')  # not vacuous: all() of nothing is True
    assert all("static activations" in e.reason for e in report.entries if e.op == "linear")


def test_per_step_scales_are_not_combined_with_smoothing():
    m, xs = model(), inputs()
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True)
    opts = options(cal)
    opts["quantization_config"]["smoothing_alpha"] = 0.5
    with pytest.raises(Exception, match=r"smoothing_alpha=0.5 is not combined with per-step activation scales"):
        with torch.no_grad():
            torch.compile(m, backend="fp8", options=opts)(xs[0])
    with pytest.raises(ValueError, match=r"smoothing_alpha=0.5 is not combined with per-step"):
        fx_fp8.prepare_model(m, opts)


def test_step_ops_stay_out_of_cuda_graphs():
    """A captured CUDA graph would replay the first step's pick: the ops are tagged for Inductor."""
    assert torch.Tag.cudagraph_unsafe in torch.ops.fx_fp8.step_scale.default.tags  # prepared and unprepared layers
    # what Inductor checks before capturing (without graph partitions it then skips cudagraphs)
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graph = torch.fx.Graph()
    scale = graph.call_function(
        torch.ops.fx_fp8.step_scale.default, (graph.placeholder("t"), graph.placeholder("f")), {"groups": [0, 0]}
    )
    graph.output(scale)
    assert get_first_incompatible_cudagraph_node(torch.fx.GraphModule({}, graph)) is scale


# -- prepared, saved, reloaded -----------------------------------------------------------------
def test_prepared_layers_look_up_their_step_scale(downstream_compiles, tmp_path):
    m, orig, xs = model(), model(), inputs()  # orig: the same weights, kept unprepared for the reference
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups="0-1,2-3")
    s0, s2 = cal.step_scales["0"], cal.step_scales["2"]
    result = fx_fp8.prepare_model(m, options(cal))
    assert result["quantized"] == ["0", "2"]
    assert isinstance(m[0], QuantizedLinear) and m[0].input_step_groups == (0, 1, 2, 3)
    assert torch.allclose(m[0].input_step_scales, s0 * FP8_MAX / INT8_MAX)
    assert "per-step input scales (2 step groups)" in repr(m[0])
    x = xs[3]
    with torch.no_grad():
        eager = {}
        for s in range(STEPS):
            with fx_fp8.denoising_step(s):
                eager[s] = m(x)
            g = s // 2
            assert rel(eager[s], reference(orig, x, float(s0[g]), float(s2[g]), "int8")) < 1e-5, s
        compiled = torch.compile(m, backend="fp8", options=options(cal))
        for s in (2, 0, 3, 1):
            with fx_fp8.denoising_step(s):
                assert rel(compiled(x), eager[s]) < 1e-4
    assert len(downstream_compiles) == 1
    assert not torch.equal(eager[0], eager[2])
    (report,) = fx_fp8.get_reports()
    assert any(True for e in report.entries if e.op == 'linear')  # not vacuous: all() of nothing is True
    assert all(
        "static per-step activations" in e.reason and "prepared" in e.reason for e in report.entries if e.op == "linear"
    )

    # save_quantized / load_quantized keep the per-step scales
    fx_fp8.save_quantized(m, tmp_path / "q")
    loaded = fx_fp8.load_quantized(tmp_path / "q", model=model())
    assert loaded[0].input_step_groups == (0, 1, 2, 3)
    assert torch.equal(loaded[0].input_step_scales, m[0].input_step_scales)
    with torch.no_grad(), fx_fp8.denoising_step(1):
        assert torch.equal(loaded(x), eager[1])


# -- files and configs -------------------------------------------------------------------------
def test_per_step_scales_round_trip_through_json_and_yaml(tmp_path):
    m, xs = model(), inputs()
    cal = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups=2)
    path = tmp_path / "s.json"
    fx_fp8.save_activation_scales(cal, path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["step_groups"] == [[0, 1], [2, 3]]
    back = fx_fp8.load_activation_scales(path)
    assert back.step_groups == cal.step_groups
    assert all(torch.allclose(back.step_scales[n], cal.step_scales[n]) for n in cal)

    cfg = fx_fp8.FP8Config.from_kwargs(**options(cal))
    cfg.to_yaml(tmp_path / "c.yaml")
    again = fx_fp8.load_activation_scales(
        fx_fp8.FP8Config.from_yaml(tmp_path / "c.yaml").quantization_config.activation_scales
    )
    assert again.step_groups == cal.step_groups and torch.allclose(again.step_scales["2"], cal.step_scales["2"])


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.pop("step_scales"), r"need both 'step_groups' and 'step_scales'"),
        (
            lambda d: d["step_scales"].update({"0": [0.1]}),
            r"invalid step_scales for '0' .*: 1 scales for 2 step groups",
        ),
        (lambda d: d["step_scales"].update({"0": [0.1, 0.0]}), r"group 1 has scale 0.0, expected a finite number > 0"),
        (lambda d: d["step_scales"].pop("2"), r"must name the same linears as its scales.*\['2'\]"),
        (lambda d: d.update(step_groups=[[0, 2], [2, 3]]), r"step groups 0-2 and 2-3 overlap"),
        (lambda d: d.update(step_groups=[[0, -1], [2, 3]]), r"invalid step group \[0, -1\]"),
        (lambda d: d.update(step_groups="0-3"), r"invalid 'step_groups' section"),
    ],
)
def test_bad_per_step_sections_are_errors(edit, match, tmp_path):
    m, xs = model(), inputs()
    data = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups=2).to_json()
    edit(data)
    with pytest.raises(ValueError, match=match):
        fx_fp8.load_activation_scales(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        fx_fp8.load_activation_scales(path)


def test_regroup_matches_calibrating_with_the_groups():
    m, xs = model(), inputs()
    each = fx_fp8.calibrate(m, run_steps(xs), per_step=True)
    for groups in (2, "0,1-3"):
        direct = fx_fp8.calibrate(m, run_steps(xs), per_step=True, step_groups=groups)
        again = each.regroup(groups)
        assert again.step_groups == direct.step_groups and again == direct
        assert all(torch.equal(again.step_scales[n], direct.step_scales[n]) for n in direct)
    with pytest.raises(ValueError, match=r"regroup needs a calibration with one step per group.*step groups 0-1,2-3"):
        each.regroup(2).regroup(1)
    with pytest.raises(ValueError, match=r"invalid step_groups 9: the calibration saw steps 0-3, so between 1 and 4"):
        each.regroup(9)
    # steps 0, 1 and 3 seen: 3 equal groups of 0-3 leave one without a calibrated step
    gappy = fx_fp8.calibrate(m, run_steps({s: xs[s] for s in (0, 1, 3)}), per_step=True)
    assert gappy.step_groups == ((0, 0), (1, 1), (3, 3)) and gappy.regroup(2).step_groups == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match=r"ran no step of group\(s\) 2 \(it saw steps 0-1,3\)"):
        gappy.regroup(4)
