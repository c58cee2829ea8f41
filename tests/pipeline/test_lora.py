"""LoRA on the shipped tiny pipeline after FP8 compilation: unfused adapters, fuse/unfuse,
hotswap. FP8+LoRA must sit within the usual FP8 error of native+LoRA and clearly apart from
FP8 without the LoRA; a prepared model (whose linears hold only FP8 weights) refuses."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import fx_fp8
from fx_fp8.tools.tiny_model import load_tiny_pipeline

TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "ff.net.2")
FP8_ERROR = 0.02  # FP8 against native on this pipeline: ~0.6 %
LORA_EFFECT = 0.04  # the LoRA moves the image by ~7 %


def _lora(transformer, rank=4, rel=0.3, seed=0):
    """A random LoRA in diffusers' key format whose update is `rel` of each target weight."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith(TARGETS):
            a = torch.randn(rank, m.in_features, generator=g)
            b = torch.randn(m.out_features, rank, generator=g)
            b *= rel * m.weight.norm() / (b @ a).norm()
            sd[f"transformer.{name}.lora_A.weight"] = a
            sd[f"transformer.{name}.lora_B.weight"] = b
    return sd


def _run(pipe):
    with torch.no_grad():
        return pipe(
            "a red circle", num_inference_steps=4, output_type="pt", generator=torch.Generator().manual_seed(0)
        ).images


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _pipes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, pipe = load_tiny_pipeline(), load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref.set_progress_bar_config(disable=True)
    return ref, pipe


@pytest.mark.slow
def test_lora_loaded_fused_and_unfused_after_compile():
    ref, pipe = _pipes()
    native = _run(ref)
    lora = _lora(ref.transformer)
    ref.transformer.load_lora_adapter(lora, prefix="transformer", adapter_name="style")
    native_lora = _run(ref)
    assert _rel(native_lora, native) > LORA_EFFECT

    fx_fp8.compile_pipeline(pipe, prepare=False)
    fp8 = _run(pipe)
    transformer = fx_fp8.pipeline_state(pipe).originals["transformer"]
    # unfused adapters: PEFT wraps the targets; the base layers stay FP8, each LoRA branch has a row
    transformer.load_lora_adapter(lora, prefix="transformer", adapter_name="style")
    fp8_lora = _run(pipe)
    assert _rel(fp8_lora, native_lora) < FP8_ERROR
    assert _rel(fp8, native_lora) > LORA_EFFECT
    rows = {e.module: e for e in fx_fp8.get_reports(pipe.transformer)[-1].entries if e.op == "linear"}
    assert rows["transformer_blocks.0.attn.to_q.base_layer"].action == "fp8"
    assert "transformer_blocks.0.attn.to_q.lora_A.style" in rows
    # fused: the base weights change through .data; the FP8 copies follow, once
    transformer.fuse_lora()
    fused = _run(pipe)  # PEFT's merged layers take another path: one more graph
    assert _rel(fused, native_lora) < FP8_ERROR
    frames = counters["stats"]["unique_graphs"]
    _run(pipe)
    assert counters["stats"]["unique_graphs"] == frames, "a second run after fusing recompiled"
    # unfused and unloaded: back to the model without the LoRA
    transformer.unfuse_lora()
    transformer.unload_lora()
    back = _run(pipe)
    assert _rel(back, native) < FP8_ERROR and _rel(back, native_lora) > LORA_EFFECT


@pytest.mark.slow
def test_set_adapters_and_hotswap_follow_without_recompiling():
    ref, pipe = _pipes()
    first, second = _lora(ref.transformer, seed=0), _lora(ref.transformer, seed=1)
    ref.transformer.load_lora_adapter(second, prefix="transformer", adapter_name="style")
    native_second = _run(ref)
    ref.transformer.set_adapters(["style"], weights=[0.5])
    native_half = _run(ref)

    transformer = pipe.transformer
    transformer.enable_lora_hotswap(target_rank=4)
    transformer.load_lora_adapter(first, prefix="transformer", adapter_name="style")
    # sensitive layers (no LoRA targets) pinned native: with the default weight-only ones this image's error
    # against native is 2.3 % (1.1 % native), past FP8_ERROR; this test is about the hotswap
    fx_fp8.compile_pipeline(pipe, prepare=False, quantization_config={"sensitive": "native"})
    _run(pipe)
    frames = counters["stats"]["unique_graphs"]
    transformer.load_lora_adapter(second, prefix="transformer", adapter_name="style", hotswap=True)
    assert _rel(_run(pipe), native_second) < FP8_ERROR
    assert counters["stats"]["unique_graphs"] == frames, "hotswapping a LoRA recompiled"
    transformer.set_adapters(["style"], weights=[0.5])
    assert _rel(_run(pipe), native_half) < FP8_ERROR


def test_lora_on_a_prepared_model_is_refused():
    _, pipe = _pipes()
    transformer = pipe.transformer
    fx_fp8.prepare_model(transformer)
    with pytest.raises(ValueError, match="QuantizedLinear"):
        transformer.load_lora_adapter(
            _lora(load_tiny_pipeline().transformer), prefix="transformer", adapter_name="style"
        )
