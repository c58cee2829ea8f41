"""FP8 weights really free memory: prepare_model + compile, measured over reachable tensors."""
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.tools.families import example_inputs, output_tensor
from fx_fp8.weights import FP8Linear, _CACHE


def bf16_flux():
    """A Flux transformer wide enough (256) that per-channel scales are a small overhead."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FluxTransformer2DModel(patch_size=1, in_channels=32, num_layers=1, num_single_layers=1, attention_head_dim=64,
                                       num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64,
                                       axes_dims_rope=(16, 24, 24))
    model = model.to(torch.bfloat16).eval()
    return model, example_inputs("flux", model, dtype=torch.bfloat16)


def linear_weight_bytes(model, names):
    return {n: model.get_submodule(n).weight.numel() * 2 for n in names}


def run_steps(compiled, kw, steps):
    with torch.no_grad():
        for i in steps:
            with fx_fp8.denoising_step(i):
                out = output_tensor(compiled(**kw))
    return out


def test_prepare_model_frees_bf16_weights():
    model, kw = bf16_flux()
    with torch.no_grad():
        ref = output_tensor(model(**kw)).float()
    total_before = fx_fp8.reachable_tensor_bytes(model)
    eligible = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    bf16_bytes = linear_weight_bytes(model, eligible)

    result = fx_fp8.prepare_model(model)
    quantized = result["quantized"]
    assert len(quantized) >= 15 and set(quantized) | set(result["native"]) == set(eligible)
    assert all(isinstance(model.get_submodule(n), FP8Linear) for n in quantized)
    q_before = sum(bf16_bytes[n] for n in quantized)
    q_after = sum(model.get_submodule(n).weight.numel() + model.get_submodule(n).weight_scale.numel() * 4 for n in quantized)
    assert result["bytes_before"] == q_before and result["bytes_after"] == q_after
    assert q_after <= 0.52 * q_before, q_after / q_before

    compiled = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_steps": "0"})
    out = run_steps(compiled, kw, [0])  # compiles both step variants
    total_after = fx_fp8.reachable_tensor_bytes(compiled)
    # the whole model drops by exactly what the quantized weights saved
    assert total_after == total_before - q_before + q_after
    print(f"\nbf16 Flux (width 256): quantized linears {q_before} -> {q_after} bytes ({q_after / q_before:.3f}x), "
          f"model {total_before} -> {total_after} bytes ({total_after / total_before:.3f}x)")
    assert 1e-3 < float((out.float() - ref).norm() / ref.norm()) < 0.05

    # calling again, both variants: no BF16 copy comes back, no compile-time FP8 copies either
    run_steps(compiled, kw, [0, 1, 2])
    assert fx_fp8.reachable_tensor_bytes(compiled) == total_after
    assert not any(p in _CACHE for p in model.parameters())
    reports = fx_fp8.get_reports()
    assert [r.step_variant for r in reports] == ["fp8", "native"]
    for r in reports:
        assert r.weights["original_copy_kept"] is False and r.weights["quantized_linear_bytes_before"] == 0
        assert r.count("linear", "fp8") == len(quantized)
        assert all("prepared FP8 weights" in e.reason for e in r.entries if e.op == "linear" and e.action == "fp8")


def test_without_prepare_model_the_original_is_kept():
    model, kw = bf16_flux()
    total_before = fx_fp8.reachable_tensor_bytes(model)
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        compiled(**kw)
    (report,) = fx_fp8.get_reports()
    w = report.weights
    assert w["original_copy_kept"] is True
    assert any("still holds its original weights" in n and "prepare_model" in n for n in report.notes)
    assert 0 < w["quantized_linear_bytes_after"] <= 0.52 * w["quantized_linear_bytes_before"]
    # the FP8 copies come on top of the BF16 originals
    assert fx_fp8.reachable_tensor_bytes(compiled) == total_before + w["quantized_linear_bytes_after"]


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
    assert off["quantized"] == [] and not any(isinstance(m, FP8Linear) for m in model.modules())
    res = fx_fp8.prepare_model(model, ignored_layers=["ff"])
    assert all(".ff." not in n for n in res["quantized"])
    assert res["native"]["transformer_blocks.0.ff.net.2"] == "ignored_layers pattern 'ff'"
    assert model.get_submodule("x_embedder").__class__ is FP8Linear  # the explicit list replaced the defaults
    with pytest.raises(ValueError, match="did you mean"):
        fx_fp8.prepare_model(model, ignored_layer=["ff"])
