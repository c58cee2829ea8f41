"""Quantized checkpoints (fx_fp8.save_quantized / load_quantized) and an honest state dict for
prepared models: save_pretrained refuses, load_state_dict re-quantizes full-precision weights and
refuses quantized data without its scale, before anything is copied."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import fx_fp8
from fx_fp8.quant.checkpoint import QUANT_NAME, WEIGHTS_NAME
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline
from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.quant.quantized_linear import QuantizedLinear


def flux(seed=0, dtype=torch.float32, layers=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_transformer("flux", layers=layers, seed=seed, dtype=dtype)


def run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(same_bytes(sa[k], sb[k]) for k in sa)


def layers_of(model):
    return {
        n: (
            m.method,
            m.weight_granularity,
            m.weight_block,
            m.act_granularity,
            m.orig_dtype,
            m.input_scale is not None,
            m.input_smoothing is not None,
        )
        for n, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
    }


@pytest.mark.parametrize("method,dtype", [("fp8", torch.bfloat16), ("int8", torch.float32)])
def test_round_trip_is_bit_identical(method, dtype, tmp_path):
    model = flux(dtype=dtype)
    kw = example_inputs("flux", model, dtype=dtype)
    # fp8: the default, sensitive layers weight-only; int8: sensitive layers native, so native reasons travel
    sensitive = "native" if method == "int8" else "weight_only"
    result = fx_fp8.prepare_model(model, quantization=method, quantization_config={"sensitive": sensitive})
    assert bool(result["native"]) == (sensitive == "native") and bool(result["weight_only"]) == (sensitive != "native")
    ref = run(model, kw)
    fx_fp8.save_quantized(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", QUANT_NAME, WEIGHTS_NAME])
    record = json.loads((tmp_path / QUANT_NAME).read_text())
    assert sorted(record["layers"]) == sorted(result["quantized"]) and set(record["native"]) == set(result["native"])
    assert all(record["native"][n] == r for n, r in result["native"].items())  # reasons travel too
    assert {n for n, r in record["layers"].items() if r["weight_only"]} == set(result["weight_only"])
    assert {r["method"] for r in record["layers"].values() if not r["weight_only"]} == {method}
    assert {r["method"] for r in record["layers"].values() if r["weight_only"]} <= {"int8"}  # the default storage

    loaded = fx_fp8.load_quantized(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    assert layers_of(loaded) == layers_of(model) and state_equal(loaded, model)
    assert torch.equal(run(loaded, kw), ref)
    with pytest.raises(ValueError, match="save_quantized"):  # the loaded model is guarded like a prepared one
        loaded.save_pretrained(tmp_path / "plain")


@pytest.mark.slow
def test_round_trip_is_bit_identical_under_the_fp8_backend(tmp_path):
    model = flux(dtype=torch.bfloat16)
    kw = example_inputs("flux", model, dtype=torch.bfloat16)
    fx_fp8.prepare_model(model)
    ref = run(torch.compile(model, backend="fp8"), kw)
    fx_fp8.save_quantized(model, tmp_path)
    loaded = fx_fp8.load_quantized(tmp_path)
    assert torch.equal(run(torch.compile(loaded, backend="fp8"), kw), ref)
    assert torch.equal(run(loaded, kw), run(model, kw))


@pytest.mark.parametrize("method,scheme", [("fp8", "static"), ("int8", "dynamic"), ("int8", "static")])
def test_round_trip_with_static_scales_and_smoothing(method, scheme, tmp_path):
    model = flux()
    calibration = fx_fp8.calibrate(model, [example_inputs("flux", model, seed=s) for s in (1, 2)])
    qc = {"activation_scheme": scheme, "activation_scales": calibration}
    if method == "int8":
        qc["smoothing_alpha"] = 0.5
    fx_fp8.prepare_model(model, quantization=method, quantization_config=qc)
    layers = layers_of(model)
    # the W8A8 layers; the default weight-only sensitive layers have no activation scale or smoothing
    w8a8 = [v for v in layers.values() if v[3] != WEIGHT_ONLY]
    assert w8a8 and len(w8a8) < len(layers)
    assert all(s == (scheme == "static") and sm == (method == "int8") for *_, s, sm in w8a8)
    assert any(
        True for _ in (v for v in layers.values() if v[3] == WEIGHT_ONLY)
    )  # not vacuous: all() of nothing is True
    assert all(not s and not sm for *_, s, sm in (v for v in layers.values() if v[3] == WEIGHT_ONLY))
    kw = example_inputs("flux", model, seed=5)
    ref = run(model, kw)
    fx_fp8.save_quantized(torch.compile(model, backend="fp8"), tmp_path)  # a compiled model saves what it wraps
    loaded = fx_fp8.load_quantized(tmp_path)
    assert layers_of(loaded) == layers and state_equal(loaded, model)
    assert torch.equal(run(loaded, kw), ref)


def test_load_into_a_model_you_built_and_with_device_and_dtype(tmp_path):
    model = flux()
    fx_fp8.prepare_model(model)
    kw = example_inputs("flux", model)
    ref = run(model, kw)
    fx_fp8.save_quantized(model, tmp_path)
    other = flux(seed=3)
    assert fx_fp8.load_quantized(tmp_path, model=other) is other
    assert layers_of(other) == layers_of(model) and torch.equal(run(other, kw), ref)
    half = fx_fp8.load_quantized(tmp_path, type(model), device="cpu", dtype=torch.bfloat16)
    q = next(m for m in half.modules() if isinstance(m, QuantizedLinear) and not m.weight_only)
    assert (
        q.weight.dtype == torch.float8_e4m3fn
        and q.weight_scale.dtype == torch.float32
        and q.orig_dtype == torch.bfloat16
    )
    # proj_out: a sensitive layer, weight-only INT8 by default; its bias follows the dtype
    assert half.proj_out.weight_only and half.proj_out.weight.dtype == torch.int8
    assert half.proj_out.orig_dtype == half.proj_out.bias.dtype == torch.bfloat16
    assert rel_err(run(half, example_inputs("flux", half, dtype=torch.bfloat16)), ref) < 0.05
    with pytest.raises(ValueError, match="holds a FluxTransformer2DModel, not a SD3Transformer2DModel"):
        from diffusers import SD3Transformer2DModel

        fx_fp8.load_quantized(tmp_path, SD3Transformer2DModel)


def test_a_plain_module_round_trips_into_a_module_you_build(tmp_path):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)).eval()

    model, x = build(), torch.randn(4, 64)
    fx_fp8.prepare_model(model)
    ref = model(x)
    fx_fp8.save_quantized(model, tmp_path)
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(ValueError, match=r"without a diffusers config\.json: load it into a model you build"):
        fx_fp8.load_quantized(tmp_path)
    assert torch.equal(fx_fp8.load_quantized(tmp_path, model=build())(x), ref)


def test_strict_load_names_missing_and_unexpected_keys_and_leaves_the_model(tmp_path):
    model = flux()
    fx_fp8.prepare_model(model)
    fx_fp8.save_quantized(model, tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    del tensors["transformer_blocks.0.attn.to_q.weight_scale"]
    tensors["extra.weight"] = torch.zeros(1)
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    target = flux(seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError) as err:
        fx_fp8.load_quantized(tmp_path, model=target)
    assert "missing keys" in str(err.value) and "transformer_blocks.0.attn.to_q.weight_scale" in str(err.value)
    assert "unexpected keys" in str(err.value) and "extra.weight" in str(err.value)
    assert before  # not vacuous: all() of nothing is True
    assert not layers_of(target) and all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="nothing quantized to save"):
        fx_fp8.save_quantized(target, tmp_path / "new")
    with pytest.raises(FileNotFoundError, match="not an fx_fp8 quantized checkpoint"):
        fx_fp8.load_quantized(tmp_path / "nowhere")


def test_save_quantized_refuses_an_unprepared_model_and_writes_nothing(tmp_path):
    model = flux()
    with pytest.raises(ValueError, match=r"nothing quantized to save .*call fx_fp8.prepare_model.*save_pretrained"):
        fx_fp8.save_quantized(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="expects a prepared torch.nn.Module or a diffusers pipeline"):
        fx_fp8.save_quantized(object(), tmp_path / "out")


def test_save_pretrained_of_a_prepared_model_refuses(tmp_path):
    model = flux()
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    fx_fp8.prepare_model(model)
    first = next(n for n, m in model.named_modules() if isinstance(m, QuantizedLinear))
    for target in (model, torch.compile(model, backend="fp8")):
        with pytest.raises(ValueError, match=rf"first: '{first}'.*fx_fp8\.save_quantized"):
            target.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain").exists()
    # the original linears put back (restore_pipeline with keep_weights=True does): it saves again
    for name, linear in linears.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
    model.save_pretrained(tmp_path / "plain")
    assert (tmp_path / "plain" / "diffusion_pytorch_model.safetensors").exists()


def test_from_pretrained_of_a_quantized_folder_fails_loudly(tmp_path):
    model = flux()
    fx_fp8.prepare_model(model)
    fx_fp8.save_quantized(model, tmp_path)
    with pytest.raises(OSError, match="no file named diffusion_pytorch_model"):
        type(model).from_pretrained(tmp_path)


def test_pipeline_save_pretrained_refuses_a_prepared_transformer(tmp_path):
    pipe, _ = build_tiny_pipeline("flux", layers=1)
    fx_fp8.prepare_model(pipe.transformer)
    pipe.transformer = torch.compile(pipe.transformer, backend="fp8")  # what compile_pipeline puts there
    with pytest.raises(ValueError, match="fx_fp8.save_quantized"):
        pipe.save_pretrained(tmp_path)


def test_pipeline_round_trip_two_experts(tmp_path):
    pipe, call = build_tiny_pipeline("wan2.2", layers=1)
    for attr in ("transformer", "transformer_2"):
        fx_fp8.prepare_model(getattr(pipe, attr))
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    ref = pipe(**call, num_inference_steps=2, generator=g(), output_type="latent").frames
    fx_fp8.save_quantized(pipe, tmp_path)
    assert json.loads((tmp_path / QUANT_NAME).read_text())["components"] == ["transformer", "transformer_2"]
    with pytest.raises(ValueError, match="holds a pipeline's transformers"):
        fx_fp8.load_quantized(tmp_path)
    fresh, _ = build_tiny_pipeline("wan2.2", layers=1, seed=7)
    assert fx_fp8.load_quantized(tmp_path, pipe=fresh) is fresh
    assert all(layers_of(getattr(fresh, a)) == layers_of(getattr(pipe, a)) for a in ("transformer", "transformer_2"))
    assert torch.equal(fresh(**call, num_inference_steps=2, generator=g(), output_type="latent").frames, ref)


@pytest.mark.slow
def test_compiled_pipeline_refuses_save_pretrained_and_round_trips(tmp_path):
    pipe, call = build_tiny_pipeline("flux", layers=1)
    fx_fp8.compile_pipeline(pipe)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    ref = pipe(**call, num_inference_steps=2, generator=g(), output_type="latent").images
    with pytest.raises(ValueError, match="fx_fp8.save_quantized"):
        pipe.save_pretrained(tmp_path / "plain")
    fx_fp8.save_quantized(pipe, tmp_path / "q")
    fresh, _ = build_tiny_pipeline("flux", layers=1, seed=7)
    fx_fp8.load_quantized(tmp_path / "q", pipe=fresh)
    fx_fp8.compile_pipeline(fresh, prepare=False)  # a loaded transformer is compiled as it is
    assert torch.equal(fresh(**call, num_inference_steps=2, generator=g(), output_type="latent").images, ref)
    with pytest.raises(ValueError, match="restore_pipeline"):
        fx_fp8.load_quantized(tmp_path / "q", pipe=fresh)


@pytest.mark.parametrize("smoothing", [False, True])
def test_load_state_dict_of_full_precision_weights_requantizes(smoothing):
    new = flux(seed=1)
    full = new.state_dict()
    kw = example_inputs("flux", new, seed=4)
    native = run(new, kw)
    qc = {}
    if smoothing:
        qc = {
            "activation_scales": fx_fp8.calibrate(new, [example_inputs("flux", new, seed=s) for s in (1, 2)]),
            "smoothing_alpha": 0.5,
        }
    model = flux(seed=0)
    fx_fp8.prepare_model(model, quantization="int8" if smoothing else "fp8", quantization_config=qc)
    result = model.load_state_dict(full, strict=True)  # no weight_scale / input_smoothing is missing
    assert not result.missing_keys and not result.unexpected_keys
    out = run(model, kw)
    assert rel_err(out, native) < (0.1 if smoothing else 0.05)
    if not smoothing:  # the same as preparing those weights
        fresh = flux(seed=1)
        fx_fp8.prepare_model(fresh)
        assert state_equal(model, fresh) and torch.equal(out, run(fresh, kw))
    with pytest.raises(ValueError, match="save_quantized"):
        model.save_pretrained("unused")


def corrupt(case: str, sd: dict, name: str) -> dict:
    sd = dict(sd)
    if case == "codes without scale":
        del sd[f"{name}.weight_scale"]
    elif case == "wrong shape":
        sd[f"{name}.weight"] = torch.zeros(3, 3)
    elif case == "other method":
        sd[f"{name}.weight"] = torch.zeros_like(sd[f"{name}.weight"], dtype=torch.int8)
    elif case == "full precision with scale":
        sd[f"{name}.weight"] = sd[f"{name}.weight"].float()
    elif case == "scale without weight":
        del sd[f"{name}.weight"]
    return sd


@pytest.mark.parametrize(
    "case", ["codes without scale", "wrong shape", "other method", "full precision with scale", "scale without weight"]
)
def test_mismatched_state_raises_naming_the_layer_and_changes_nothing(case):
    model = flux()
    fx_fp8.prepare_model(model)
    name = "single_transformer_blocks.0.proj_mlp"
    assert isinstance(model.get_submodule(name), QuantizedLinear)
    donor = flux(seed=2)
    fx_fp8.prepare_model(donor)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = corrupt(case, donor.state_dict(), name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        model.load_state_dict(bad, strict=False)
    assert before  # not vacuous: all() of nothing is True
    assert all(same_bytes(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):  # the layer alone refuses too
        model.get_submodule(name).load_state_dict(
            {k.removeprefix(name + "."): v for k, v in bad.items() if k.startswith(name + ".")}, strict=False
        )
    model.load_state_dict(donor.state_dict())  # quantized data with its scales loads as it is
    kw = example_inputs("flux", model)
    assert state_equal(model, donor) and torch.equal(run(model, kw), run(donor, kw))
