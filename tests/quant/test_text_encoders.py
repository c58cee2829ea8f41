"""FP8 / INT8 linears for text encoders (tiny T5, CLIP and Qwen2.5-VL `transformers` models built from configs)
through prepare_model and the backend: the model's `_keep_in_fp32_modules` layers (T5's `wo`, whose
input is cast to its weight's dtype) stay native with a reason naming it, CLIP's final
`text_projection` is kept as the DiT rules keep a final projection (weight-only), Qwen2.5-VL's
`lm_head` and vision tower are its sensitive layers (weight-only by default; a diffusers model's
`lm_head` is left to the DiT rules), and the prompt embeddings stay close to the native ones."""

from __future__ import annotations

import warnings

import pytest
import torch

import fx_fp8
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.tools.model_zoo.text_encoders import prompt_embeddings, tiny_clip, tiny_qwen25_vl, tiny_t5, token_ids

#: measured 3-6% (FP8) on these random tiny encoders (benchmarks/text_encoders.py); a wrong layer gives > 50%
MAX_REL_ERROR = 0.12


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_t5_prepared_keeps_wo_native_and_runs(method):
    model, ids = tiny_t5(), token_ids()
    ref = prompt_embeddings(model, ids)["last_hidden_state"]
    result = fx_fp8.prepare_model(model, quantization=method)
    wo = [n for n in result["native"] if n.endswith("DenseReluDense.wo")]
    assert len(wo) == 2 and all("_keep_in_fp32_modules" in result["native"][n] for n in wo)
    assert set(result["native"]) == set(wo) and "no setting changes it" in result["native"][wo[0]]
    assert type(model.get_submodule(wo[0])) is torch.nn.Linear
    assert "encoder.block.0.layer.1.DenseReluDense.wi_0" in result["quantized"]
    assert result["bytes_after"] < result["bytes_before"] / 2
    out = prompt_embeddings(model, ids)["last_hidden_state"]  # T5's wo cast would fail on an FP8 weight
    assert _rel(out, ref) < MAX_REL_ERROR


def test_clip_text_projection_weight_only_and_backend_runs_prepared():
    model, ids = tiny_clip(), token_ids()
    ref = prompt_embeddings(model, ids)
    result = fx_fp8.prepare_model(model, quantization="fp8")
    assert result["weight_only"] == ["text_projection"]  # the final projection, as a DiT's proj_out
    assert isinstance(model.text_projection, QuantizedLinear) and model.text_projection.weight_only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="fp8", options={"config": {"quantization": "fp8"}})
        out = prompt_embeddings(compiled, ids)
    for key in ("last_hidden_state", "text_embeds"):
        assert _rel(out[key], ref[key]) < MAX_REL_ERROR, key
    rows = [r for rep in fx_fp8.get_reports(compiled) for r in rep.entries if r.op == "linear"]
    assert rows
    assert all(r.action != "native" for r in rows)


def test_backend_keeps_the_keep_in_fp32_layers_native_as_prepare_does():
    model, ids = tiny_t5(), token_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="fp8", options={"config": {"quantization": "fp8"}})
        prompt_embeddings(compiled, ids)
    rows = {r.module: r for rep in fx_fp8.get_reports(compiled) for r in rep.entries if r.op == "linear"}
    wo = [m for m in rows if m.endswith("DenseReluDense.wo")]
    assert len(wo) == 2
    assert all(rows[m].action == "native" and "_keep_in_fp32_modules" in rows[m].reason for m in wo)
    assert rows["encoder.block.0.layer.1.DenseReluDense.wi_0"].action != "native"


#: Qwen2.5-VL's sensitive layers by the text-encoder rules: its output head and its vision tower
QWEN_KEPT = [
    "lm_head",
    "model.visual.blocks.0.attn.qkv",
    "model.visual.blocks.0.attn.proj",
    "model.visual.blocks.0.mlp.gate_proj",
    "model.visual.blocks.0.mlp.up_proj",
    "model.visual.blocks.0.mlp.down_proj",
    "model.visual.merger.mlp.0",
    "model.visual.merger.mlp.2",
]


def test_qwen25_vl_keeps_lm_head_and_the_vision_tower_weight_only_prepared_and_compiled():
    model, ids = tiny_qwen25_vl(), token_ids()
    ref = prompt_embeddings(model, ids)["hidden_states[-1]"]
    result = fx_fp8.prepare_model(model, quantization="fp8")
    assert sorted(result["weight_only"]) == sorted(QWEN_KEPT) and not result["native"]
    assert "model.language_model.layers.0.mlp.down_proj" in result["quantized"]
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight_only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="fp8", options={"config": {"quantization": "fp8"}})
        out = prompt_embeddings(compiled, ids)["hidden_states[-1]"]
    assert _rel(out, ref) < MAX_REL_ERROR
    rows = {r.module: r for rep in fx_fp8.get_reports(compiled) for r in rep.entries if r.op == "linear"}
    assert rows["lm_head"].action == "weight-only" and "sensitive: weight_only" in rows["lm_head"].reason


def test_sensitive_native_keeps_the_qwen25_vl_head_and_vision_tower_native():
    model = tiny_qwen25_vl()
    result = fx_fp8.prepare_model(model, quantization="fp8", quantization_config={"sensitive": "native"})
    assert sorted(result["native"]) == sorted(QWEN_KEPT) and type(model.lm_head) is torch.nn.Linear
    assert "output head lm_head" in result["native"]["lm_head"] and "quantizes it" in result["native"]["lm_head"]


def test_sensitive_fp8_quantizes_the_qwen25_vl_head_and_vision_tower():
    model = tiny_qwen25_vl()
    result = fx_fp8.prepare_model(model, quantization="fp8", quantization_config={"sensitive": "fp8"})
    assert not result["native"] and set(QWEN_KEPT) <= set(result["quantized"])
    assert isinstance(model.lm_head, QuantizedLinear) and not model.lm_head.weight_only


def test_a_diffusers_models_lm_head_is_left_to_the_dit_rules():
    """The text-encoder rules are a transformers model's: a module of another library named lm_head
    (diffusers' Cosmos3 has one) is quantized as before."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head, self.visual = torch.nn.Linear(64, 128), torch.nn.Sequential(torch.nn.Linear(64, 64))

    result = fx_fp8.prepare_model(Model(), quantization="fp8")
    assert sorted(result["quantized"]) == ["lm_head", "visual.0"] and not result["native"]
