"""FP8 weights really free memory: prepare_model + compile, measured over reachable tensors."""

import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.tools.model_zoo.registry import example_inputs, output_tensor
from fx_fp8.ops import quant
from fx_fp8.quant.weight_state import quantized_copies_of, state_of
from fx_fp8.quant.quantized_linear import QuantizedLinear
from memory_oracles import state_storage_bytes


def bf16_flux():
    """A Flux transformer wide enough (256) that per-channel scales are a small overhead."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=32,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=64,
            num_attention_heads=4,
            joint_attention_dim=64,
            pooled_projection_dim=64,
            axes_dims_rope=(16, 24, 24),
        )
    model = model.to(torch.bfloat16).eval()
    return model, example_inputs("flux", model, dtype=torch.bfloat16)


def linear_weight_bytes(model, names):
    return {n: model.get_submodule(n).weight.numel() * 2 for n in names}


#: the default sensitive layers (sensitive: weight_only): INT8 weights, one fp32 scale per 32 input
#: columns = (1 + 4 / 32) / 2 of their bf16 bytes
WEIGHT_ONLY_RATIO = (1 + 4 / 32) / 2


def stored_bytes(model, names):
    return sum(model.get_submodule(n).weight.numel() + model.get_submodule(n).weight_scale.numel() * 4 for n in names)


def run_steps(compiled, kw, steps):
    with torch.no_grad():
        for i in steps:
            with fx_fp8.denoising_step(i):
                out = output_tensor(compiled(**kw))
    return out


@pytest.mark.slow
def test_prepare_model_frees_bf16_weights():
    model, kw = bf16_flux()
    with torch.no_grad():
        ref = output_tensor(model(**kw)).float()
    total_before = fx_fp8.reachable_tensor_bytes(model)
    state_before = state_storage_bytes(model)  # torch's count of the model's storages, not fx_fp8's
    eligible = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    bf16_bytes = linear_weight_bytes(model, eligible)

    result = fx_fp8.prepare_model(model)
    quantized, weight_only = result["quantized"], result["weight_only"]
    assert len(quantized) >= 15 and set(quantized) | set(result["native"]) == set(eligible)
    assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in quantized)
    # the default: the sensitive layers are weight-only, the others FP8 with per-channel scales
    assert {"x_embedder", "proj_out"} <= set(weight_only) <= set(quantized)
    w8a8 = [n for n in quantized if n not in weight_only]
    q_before = sum(bf16_bytes[n] for n in quantized)
    q_after = stored_bytes(model, quantized)
    assert result["bytes_before"] == q_before and result["bytes_after"] == q_after
    assert stored_bytes(model, w8a8) <= 0.52 * sum(bf16_bytes[n] for n in w8a8)
    assert stored_bytes(model, weight_only) <= WEIGHT_ONLY_RATIO * sum(bf16_bytes[n] for n in weight_only)
    assert q_after <= 0.53 * q_before, q_after / q_before

    compiled = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_steps": "0"})
    out = run_steps(compiled, kw, [0])  # compiles both step variants
    total_after = fx_fp8.reachable_tensor_bytes(compiled)
    # the whole model drops by exactly what the quantized weights saved
    assert total_after == total_before - q_before + q_after
    assert state_storage_bytes(model) == state_before - q_before + q_after
    print(
        f"\nbf16 Flux (width 256): quantized linears {q_before} -> {q_after} bytes ({q_after / q_before:.3f}x), "
        f"model {total_before} -> {total_after} bytes ({total_after / total_before:.3f}x)"
    )
    assert 1e-3 < float((out.float() - ref).norm() / ref.norm()) < 0.05

    # calling again, both variants: no BF16 copy comes back, no compile-time FP8 copies either
    run_steps(compiled, kw, [0, 1, 2])
    assert fx_fp8.reachable_tensor_bytes(compiled) == total_after
    assert state_storage_bytes(model) == state_before - q_before + q_after
    assert not quantized_copies_of(model)
    reports = fx_fp8.get_reports(compiled)
    assert [r.step_variant for r in reports] == ["fp8", "native"]
    for r in reports:
        assert r.weights["original_copy_kept"] is False and r.weights["quantized_linear_bytes_before"] == 0
        assert r.count("linear", "fp8") == len(w8a8) and r.count("linear", "weight-only") == len(weight_only)
        assert all("prepared weights" in e.reason for e in r.entries if e.op == "linear" and e.action == "fp8")


@pytest.mark.slow
def test_without_prepare_model_the_original_is_kept():
    model, kw = bf16_flux()
    total_before = fx_fp8.reachable_tensor_bytes(model)
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        compiled(**kw)
    (report,) = fx_fp8.get_reports(compiled)
    w = report.weights
    assert w["original_copy_kept"] is True
    assert any("still holds its original weights" in n and "prepare_model" in n for n in report.notes)
    # FP8 per-channel (<= 0.52x) and, by default, the sensitive layers weight-only (0.5625x): 0.526x measured
    assert 0 < w["quantized_linear_bytes_after"] <= 0.53 * w["quantized_linear_bytes_before"]
    # the FP8 copies come on top of the BF16 originals
    assert fx_fp8.reachable_tensor_bytes(compiled) == total_before + w["quantized_linear_bytes_after"]


@pytest.mark.slow
def test_prepare_model_same_numerics_as_compile_time_quantization():
    model, kw = bf16_flux()
    with torch.no_grad():
        plain = output_tensor(torch.compile(model, backend="fp8")(**kw))
    torch._dynamo.reset()
    fx_fp8.prepare_model(model)
    with torch.no_grad():
        prepared = output_tensor(torch.compile(model, backend="fp8")(**kw))
    torch.testing.assert_close(prepared, plain, atol=0, rtol=0)


def test_prepare_model_respects_config():
    model, _ = bf16_flux()
    off = fx_fp8.prepare_model(model, quantization=None)
    assert off["quantized"] == [] and not any(isinstance(m, QuantizedLinear) for m in model.modules())
    res = fx_fp8.prepare_model(model, ignored_layers=["ff"])
    assert all(".ff." not in n for n in res["quantized"])
    assert (
        res["native"]["transformer_blocks.0.ff.net.2"]
        == "ignored_layers pattern 'ff' (remove it from quantization_config.ignored_layers to quantize this layer)"
    )
    # sensitive: weight-only by default, even with an explicit list
    assert "x_embedder" not in res["native"] and "x_embedder" in res["weight_only"]
    assert model.get_submodule("x_embedder").weight_only
    pinned, _ = bf16_flux()
    res = fx_fp8.prepare_model(pinned, ignored_layers=["ff"], quantization_config={"sensitive": "native"})
    assert type(pinned.get_submodule("x_embedder")) is nn.Linear and res["weight_only"] == []
    assert res["native"]["x_embedder"].startswith("known sensitive layer")
    with pytest.raises(ValueError, match="already prepared"):  # a prepared model is not prepared twice
        fx_fp8.prepare_model(model, quantization_config={"quantize_sensitive": True})
    fresh, _ = bf16_flux()
    fx_fp8.prepare_model(fresh, quantization_config={"quantize_sensitive": True})
    assert (
        type(fresh.get_submodule("x_embedder")) is QuantizedLinear and not fresh.get_submodule("x_embedder").weight_only
    )
    with pytest.raises(ValueError, match="did you mean"):
        fx_fp8.prepare_model(bf16_flux()[0], ignored_layer=["ff"])


def _state(model):
    return {
        n: (type(m), m.weight.dtype, m.weight.data_ptr())
        for n, m in model.named_modules()
        if getattr(m, "weight", None) is not None
    }


@pytest.mark.parametrize(
    "bad",
    [
        {"quantization_config": {"activation_scheme": "static", "activation_scales": {"no.such.layer": 0.1}}},
        {"quantization_config": {"activation_scheme": "static", "activation_scales": {"x_embedder": float("nan")}}},
        {"quantization_config": {"weight_granularity": "row"}},
    ],
)
def test_prepare_model_error_leaves_the_model_unchanged(bad):
    model, _ = bf16_flux()
    before = _state(model)
    with pytest.raises(ValueError):
        fx_fp8.prepare_model(model, **bad)
    assert _state(model) == before


@pytest.mark.slow
def test_prepared_model_survives_dtype_and_device_moves():
    model, kw = bf16_flux()
    fx_fp8.prepare_model(model)
    layer = model.get_submodule("transformer_blocks.0.attn.to_q")
    with torch.no_grad():
        ref = output_tensor(model(**kw)).float()
        for convert, dtype in (
            (lambda m: m.to(torch.float32), torch.float32),
            (lambda m: m.half(), torch.float16),
            (lambda m: m.to("cpu", torch.bfloat16), torch.bfloat16),
        ):
            convert(model)
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
            assert layer.bias.dtype == dtype and layer.orig_dtype == dtype
            out = output_tensor(
                model(**{k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()})
            )
            assert out.dtype == dtype and float((out.float() - ref).norm() / ref.norm()) < 0.05


@pytest.mark.slow
def test_two_weight_granularities_never_requantize_in_steady_state(monkeypatch):
    """One model compiled with two configs keeps both quantized copies on its weights."""
    model, kw = bf16_flux()
    calls = []
    real = quant.quantize_weight
    monkeypatch.setattr(quant, "quantize_weight", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    a = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
    b = torch.compile(
        model, backend="fp8", options={"quantization": "fp8", "quantization_config": {"weight_granularity": "tensor"}}
    )
    with torch.no_grad():
        a(**kw), b(**kw)
        first = len(calls)
        # "block": the sensitive layers' weight-only 32-column groups, shared by both configs
        assert first > 0 and set(calls) == {"channel", "tensor", "block"}
        for _ in range(10):
            a(**kw), b(**kw)
    assert len(calls) == first  # 20 steady calls: no re-quantization
    w = model.get_submodule("transformer_blocks.0.attn.to_q").weight
    assert len(state_of(model, w).copies) == 2


@pytest.mark.slow
@pytest.mark.parametrize("smoothing", [False, True])
def test_prepare_model_int8_stores_about_half_the_bf16_bytes(smoothing):
    """INT8 weights + fp32 scales (+ the 1/s vector with smoothing) <= 0.52x the bf16 bytes: halving a
    bf16 model's weight memory is what INT8 is asked for."""
    model, kw = bf16_flux()
    with torch.no_grad():
        ref = output_tensor(model(**kw)).float()
    total_before = fx_fp8.reachable_tensor_bytes(model)
    qc = {}
    if smoothing:
        qc = {"activation_scales": fx_fp8.calibrate(model, [kw]), "smoothing_alpha": 0.5}
    bf16_bytes = linear_weight_bytes(model, [n for n, m in model.named_modules() if type(m) is nn.Linear])
    result = fx_fp8.prepare_model(model, quantization="int8", quantization_config=qc)
    quantized, weight_only = result["quantized"], result["weight_only"]
    assert len(quantized) >= 15 and result["method"] == "int8"
    # the W8A8 layers; the sensitive ones are weight-only by default (INT8, 32-column groups, never smoothed)
    w8a8 = [n for n in quantized if n not in weight_only]
    assert {"x_embedder", "proj_out"} <= set(weight_only) <= set(quantized)
    layers = [model.get_submodule(n) for n in w8a8]
    assert layers  # not vacuous: all() of nothing is True
    assert all(m.weight.dtype == torch.int8 and (m.input_smoothing is not None) == smoothing for m in layers)
    assert all(
        model.get_submodule(n).weight.dtype == torch.int8 and model.get_submodule(n).input_smoothing is None
        for n in weight_only
    )
    w8a8_before, w8a8_after = (
        sum(bf16_bytes[n] for n in w8a8),
        sum(
            m.weight.numel() + m.weight_scale.numel() * 4 + (m.input_smoothing.numel() * 4 if smoothing else 0)
            for m in layers
        ),
    )
    assert w8a8_after <= 0.52 * w8a8_before, w8a8_after / w8a8_before
    wo_before, wo_after = sum(bf16_bytes[n] for n in weight_only), stored_bytes(model, weight_only)
    assert wo_after <= WEIGHT_ONLY_RATIO * wo_before, wo_after / wo_before
    q_before, q_after = w8a8_before + wo_before, w8a8_after + wo_after
    assert result["bytes_before"] == q_before and result["bytes_after"] == q_after
    assert fx_fp8.reachable_tensor_bytes(model) == total_before - q_before + q_after
    print(
        f"\nbf16 Flux (width 256), int8{' + smoothing' if smoothing else ''}: quantized linears {q_before} -> "
        f"{q_after} bytes ({q_after / q_before:.3f}x)"
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = output_tensor(torch.compile(model, backend="fp8", options={"quantization": "int8"})(**kw))
    (report,) = fx_fp8.get_reports()
    assert report.count("linear", "int8") == len(w8a8) and report.count("linear", "fp8") == 0
    assert report.count("linear", "weight-only") == len(weight_only)
    assert 1e-4 < float((out.float() - ref).norm() / ref.norm()) < 0.05


@pytest.mark.slow
def test_prepared_layers_report_how_they_were_prepared_and_disagreement_warns():
    model, kw = bf16_flux()
    fx_fp8.prepare_model(model, quantization_config={"weight_granularity": "tensor"})
    compiled = torch.compile(model, backend="fp8")  # the default config says channel scales
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(**kw)
    (report,) = fx_fp8.get_reports(compiled)
    rows = [e for e in report.entries if e.op == "linear" and e.action == "fp8"]
    assert rows  # not vacuous: all() of nothing is True
    assert rows and all("tensor weight scales" in e.reason and "prepared weights" in e.reason for e in rows)
    msgs = [str(i.message) for i in w if "were prepared by prepare_model with another" in str(i.message)]
    assert len(msgs) == 1 and "transformer_blocks.0.attn.to_q" in msgs[0]
