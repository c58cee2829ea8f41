"""Static activation scales: calibrate, save, and reload in a fresh process for identical outputs."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.activation_scales import FORMAT
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.quant.weight_state import state_of

from toy_models import TwoLinears

STATIC_RUN = textwrap.dedent("""
    import sys, warnings
    import torch
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("sd3")
    options = {"quantization_config": {"activation_scheme": "static", "activation_scales": sys.argv[1]}}
    with torch.no_grad():
        out = output_tensor(torch.compile(model, backend="fp8", options=options)(**example_inputs("sd3", model, seed=5)))
    torch.save(out, sys.argv[2])
""")


def sd3():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_transformer("sd3")


@pytest.mark.slow
def test_static_scales_round_trip_in_fresh_process(tmp_path):
    model = sd3()
    batches = [example_inputs("sd3", model, seed=s) for s in range(3)]
    scales = fx_fp8.calibrate(model, batches)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(scales) == linears and all(v > 0 for v in scales.values())
    path = tmp_path / "scales.json"
    fx_fp8.save_activation_scales(scales, path)
    assert json.loads(path.read_text())["format"] == FORMAT
    assert fx_fp8.load_activation_scales(path) == pytest.approx(scales)

    options = {"quantization_config": {"activation_scheme": "static", "activation_scales": str(path)}}
    with torch.no_grad():
        static = output_tensor(
            torch.compile(model, backend="fp8", options=options)(**example_inputs("sd3", model, seed=5))
        )
        native = output_tensor(model(**example_inputs("sd3", model, seed=5)))
    (report,) = fx_fp8.get_reports()
    fp8 = [e for e in report.entries if e.op == "linear" and e.action == "fp8"]
    assert fp8 and all("static activations" in e.reason for e in fp8)
    assert len({e.act_quant_group for e in fp8}) == len(fp8)  # a calibrated scale per layer: no shared groups
    assert 1e-4 < float((static - native).norm() / native.norm()) < 0.05

    out_path = tmp_path / "out.pt"
    proc = subprocess.run(
        [sys.executable, "-c", STATIC_RUN, str(path), str(out_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(torch.load(out_path), static)


def test_calibrated_scales_are_max_over_batches():
    lin = nn.Sequential(nn.Linear(32, 32))
    xs = [torch.randn(4, 32) * s for s in (1.0, 3.0, 2.0)]
    scales = fx_fp8.calibrate(lin, [(x,) for x in xs])
    assert scales == {"0": pytest.approx(max(float(x.abs().max()) for x in xs) / 448.0)}
    # a callable run works too
    assert fx_fp8.calibrate(lin, lambda m: m(xs[1])) == {"0": pytest.approx(float(xs[1].abs().max()) / 448.0)}
    with pytest.raises(ValueError, match="saw no nn.Linear inputs"):
        fx_fp8.calibrate(lin, [])


def test_missing_scale_keeps_layer_native():
    m, x = TwoLinears(relu=False).eval(), torch.randn(8, 64)
    scales = {"a": float(x.abs().max()) / 448.0}
    torch.compile(
        m,
        backend="fp8",
        options={
            "quantization": "fp8",
            "quantization_config": {"activation_scheme": "static", "activation_scales": scales},
        },
    )(x)
    (report,) = fx_fp8.get_reports()
    got = {e.module: (e.action, e.reason) for e in report.entries}
    assert got["a"][0] == "fp8" and got["b"] == (
        "native",
        (
            "no static activation scale for this layer (recalibrate with fx_fp8.calibrate, or use "
            "quantization_config.activation_scheme: dynamic)"
        ),
    )


def test_calibrate_on_a_compiled_model_uses_the_real_names():
    model = sd3()
    compiled = torch.compile(model, backend="eager")
    scales = fx_fp8.calibrate(compiled, [example_inputs("sd3", model, seed=0)])
    assert scales and not any(n.startswith("_orig_mod") for n in scales)
    assert set(scales) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_scales_that_match_no_layer_are_an_error():
    model = sd3()
    with pytest.raises(Exception, match="none of the 1 static activation scales names a linear of this model"):
        with torch.no_grad():
            torch.compile(
                model,
                backend="fp8",
                options={
                    "quantization_config": {
                        "activation_scheme": "static",
                        "activation_scales": {"_orig_mod.proj_out": 0.1},
                    }
                },
            )(**example_inputs("sd3", model))


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), "0.1", True])
def test_scales_are_validated_when_loaded(value, tmp_path):
    with pytest.raises(
        ValueError, match=r"invalid activation scale .* for 'x' in activation_scales: expected a finite number > 0"
    ):
        fx_fp8.load_activation_scales({"x": value})
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": FORMAT, "scales": {"x": value}}, allow_nan=True))
    with pytest.raises(ValueError, match="invalid activation scale"):
        fx_fp8.load_activation_scales(path)


def test_bad_scale_files(tmp_path):
    with pytest.raises(ValueError, match="activation_scales file not found: '.*nope.json'"):
        fx_fp8.load_activation_scales(tmp_path / "nope.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"a": 1.0}))
    with pytest.raises(ValueError, match="is not an fx_fp8 activation-scales file"):
        fx_fp8.load_activation_scales(other)


# -- per-channel statistics ("channel_amax") and INT8 static scales (what smoothing needs) -------
def test_calibrate_records_channel_maxima_and_saves_them_compatibly(tmp_path):
    lin = nn.Sequential(nn.Linear(32, 32))
    xs = [torch.randn(3, 4, 32) * s for s in (1.0, 3.0, 2.0)]
    scales = fx_fp8.calibrate(lin, [(x,) for x in xs])
    want = torch.stack([x.abs().reshape(-1, 32).amax(0) for x in xs]).amax(0)
    assert torch.equal(scales.channel_amax["0"], want)
    assert scales["0"] == pytest.approx(float(want.max()) / 448.0)  # the per-tensor scale is unchanged
    path = tmp_path / "cal.json"
    fx_fp8.save_activation_scales(scales, path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and set(data) == {"format", "scales", "channel_amax"}  # same format name
    loaded = fx_fp8.load_activation_scales(path)
    assert loaded == pytest.approx(scales) and torch.equal(loaded.channel_amax["0"], want)
    # a file written before channel_amax existed still loads (no statistics)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": FORMAT, "scales": {"0": 0.5}}))
    assert fx_fp8.load_activation_scales(old) == {"0": 0.5} and fx_fp8.load_activation_scales(old).channel_amax is None
    # a plain {name: scale} mapping still saves and loads
    fx_fp8.save_activation_scales({"0": 0.25}, old)
    assert fx_fp8.load_activation_scales(old) == {"0": 0.25}
    # the calibration object rides in a config, through replace() too
    cfg = fx_fp8.FP8Config.from_kwargs(
        quantization="int8", quantization_config={"activation_scales": scales, "smoothing_alpha": 0.5}
    )
    assert cfg.replace(diffusion_kv_cache_dtype=None).quantization_config.activation_scales is scales


@pytest.mark.parametrize(
    "values", [[1.0, float("nan")], [1.0, float("inf")], [1.0, -1.0], ["a", 1.0], [], [[1.0]], 3.0]
)
def test_channel_maxima_are_validated_when_loaded(values, tmp_path):
    data = {"format": FORMAT, "scales": {"blocks.0.to_q": 0.1}, "channel_amax": {"blocks.0.to_q": values}}
    with pytest.raises(ValueError, match=r"invalid channel_amax for 'blocks\.0\.to_q' in activation_scales"):
        fx_fp8.load_activation_scales(data)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data, allow_nan=True))
    with pytest.raises(ValueError, match=r"invalid channel_amax for 'blocks\.0\.to_q' in '.*c\.json'"):
        fx_fp8.load_activation_scales(path)


def test_int8_static_scales_use_the_int8_range():
    """Calibrated scales are max|x| / 448; INT8 quantizes with max|x| / 127 (it clipped before)."""
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(64, 64)).eval(), torch.randn(8, 64)
    scales = fx_fp8.calibrate(m, [(x,)])
    errors = {}
    with torch.no_grad():
        ref = m(x)
    for method in ("fp8", "int8"):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(
                m,
                backend="fp8",
                options={
                    "quantization": method,
                    "quantization_config": {"activation_scheme": "static", "activation_scales": scales},
                },
            )(x)
        errors[method] = float((out - ref).norm() / ref.norm())
    assert fx_fp8.get_reports()[-1].entries[0].action == "int8"
    assert errors["int8"] < 0.02 and errors["fp8"] < 0.05, errors
    assert float(state_of(m, m[0].weight).input_scale) == pytest.approx(float(x.abs().max()) / 127.0)
