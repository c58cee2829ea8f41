"""compile_pipeline with a component map (vLLM-Omni's `quantization: {transformer: ..., text_encoder: ...}`):
the text encoders it names are prepared and compiled, the others left alone; an unknown component or
one that is not a torch module is refused by name before anything changes; restore_pipeline puts them back."""

from __future__ import annotations

import warnings

import pytest
import torch

import fx_fp8
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.tools.model_zoo.pipelines import tiny_flux
from fx_fp8.tools.model_zoo.text_encoders import prompt_embeddings, tiny_clip, tiny_t5, token_ids


def _flux_with_encoders():
    pipe, kwargs = tiny_flux()
    pipe.register_modules(text_encoder=tiny_clip(), text_encoder_2=tiny_t5())
    return pipe, kwargs


def test_map_prepares_and_compiles_the_named_text_encoders():
    pipe, _ = _flux_with_encoders()
    clip, t5, ids = pipe.text_encoder, pipe.text_encoder_2, token_ids()
    ref = prompt_embeddings(t5, ids)["last_hidden_state"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.compile_pipeline(
            pipe, {"quantization": {"transformer": "fp8", "text_encoder": None, "text_encoder_2": {"method": "int8"}}}
        )
        out = prompt_embeddings(pipe.text_encoder_2, ids)["last_hidden_state"]
    state = fx_fp8.pipeline_state(pipe)
    assert pipe.text_encoder is clip and "text_encoder" not in state.compiled  # null: left as it is
    assert pipe.text_encoder_2 is state.compiled["text_encoder_2"] and pipe.text_encoder_2 is not t5
    prepared = state.prepared["text_encoder_2"]
    assert prepared["method"] == "int8" and len(prepared["quantized"]) == 12
    assert isinstance(t5.encoder.block[0].layer[0].SelfAttention.q, QuantizedLinear)
    assert ((out - ref).norm() / ref.norm()).item() < 0.12
    fx_fp8.restore_pipeline(pipe, linears="quantized")
    assert pipe.text_encoder_2 is t5


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "text_encoder_3",
            r"'text_encoder_3', which FluxPipeline does not have; its components: vae, text_encoder, "
            r"text_encoder_2, tokenizer",
        ),
        ("scheduler", r"pipe.scheduler is a FlowMatchEulerDiscreteScheduler, not a torch.nn.Module"),
        ("tokenizer", r"pipe.tokenizer is None \(not loaded\), not a torch.nn.Module"),
        (
            "clip_*",
            r"quantization names component 'clip_\*', which FluxPipeline does not have; its "
            r"components: .*a key with \* \? \[ is a shell pattern matched against the whole component name",
        ),
        ("clip", r"quantization names component 'clip', which FluxPipeline does not have"),
        (
            "tok",
            r"quantization key 'tok' covers tokenizer, tokenizer_2 of FluxPipeline, none of them a torch.nn.Module",
        ),
    ],
)
def test_unknown_or_non_module_component_is_refused_unchanged(name, message):
    pipe, _ = _flux_with_encoders()
    before = dict(pipe.components)
    with pytest.raises(ValueError, match=message):
        fx_fp8.compile_pipeline(pipe, quantization={"transformer": "fp8", name: "fp8"})
    assert dict(pipe.components) == before and not any(
        isinstance(m, QuantizedLinear) for m in pipe.text_encoder_2.modules()
    )


def test_keep_weights_puts_the_text_encoder_linears_back():
    pipe, _ = _flux_with_encoders()
    clip = pipe.text_encoder
    q = clip.text_model.encoder.layers[0].self_attn.q_proj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.compile_pipeline(pipe, quantization={"text_encoder": "fp8"}, keep_weights=True)
    assert isinstance(clip.text_model.encoder.layers[0].self_attn.q_proj, QuantizedLinear)
    assert "transformer" in fx_fp8.pipeline_state(pipe).compiled  # its attention, native linears (not named)
    assert clip._fx_fp8_linears_only  # its report names no key for its attention (attention_remedies)
    fx_fp8.restore_pipeline(pipe)
    assert pipe.text_encoder is clip and type(clip.text_model.encoder.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert not hasattr(clip, "_fx_fp8_linears_only")
    assert torch.equal(clip.text_model.encoder.layers[0].self_attn.q_proj.weight, q.weight)


@pytest.mark.parametrize(
    "quantization, covered",
    [
        ({"text_encoder": "fp8"}, {"text_encoder", "text_encoder_2"}),  # a key covers the names it begins
        ({"text_encoder": "fp8", "text_encoder_2": None}, {"text_encoder"}),  # the longest key wins
        ({"text_encoder_2": "int8"}, {"text_encoder_2"}),
        ({"t": "fp8"}, {"text_encoder", "text_encoder_2"}),  # tokenizer (None) has nothing to quantize
        ({"text_encoder_*": "fp8"}, {"text_encoder_2"}),  # a pattern matches the whole name
        ({"text_encoder": "fp8", "text_encoder_?": None}, {"text_encoder"}),  # patterns are tried before prefixes
    ],
)
def test_keys_cover_components_as_vllm_omni_prefixes(quantization, covered):
    """vLLM-Omni's ComponentQuantizationConfig.resolve: a key applies to every component whose name
    begins with it, the longest such key wins (fx_fp8/config/components.py cites the source)."""
    pipe, _ = _flux_with_encoders()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.compile_pipeline(pipe, quantization=quantization, prepare=False)
    compiled = fx_fp8.pipeline_state(pipe).compiled
    assert covered and set(compiled) - {"transformer"} == covered
    assert all(pipe.components[name] is compiled[name] for name in covered)


#: what a native reason ends with: the setting that changes it, or that none does
SAYS_WHAT_TO_SET = ("nothing to set", "no setting changes it", "quantization_config.", "set ")


def test_summary_rows_of_text_encoders_say_their_attention_is_never_quantized():
    """A text encoder's attention is native by design (component maps compile its linears only): its
    report and summary row say so, instead of the attention pass's "set diffusion_kv_cache_dtype",
    which would not reach it; every other reason names what to set, or that nothing can be set."""
    from fx_fp8.passes.attention_remedies import LINEARS_ONLY_ATTENTION
    from fx_fp8.tools.model_zoo.text_encoders import tiny_qwen25_vl

    pipe, _ = tiny_flux()
    pipe.register_modules(text_encoder=tiny_qwen25_vl(), text_encoder_2=tiny_t5())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.compile_pipeline(
            pipe, quantization={"transformer": "fp8", "text_encoder": "fp8", "text_encoder_2": "int8"}
        )
        for encoder in (pipe.text_encoder, pipe.text_encoder_2):
            prompt_embeddings(encoder, token_ids())
    rows = {r.component: r for r in fx_fp8.summary(pipe)}
    qwen, t5 = rows["text_encoder"], rows["text_encoder_2"]
    assert qwen.attention_total > 0 and t5.attention_total > 0 and qwen.attention_fp8 == t5.attention_fp8 == 0
    for row in (qwen, t5):
        assert dict(row.native_reasons)[LINEARS_ONLY_ATTENTION] == row.attention_total
    reasons = {r for row in (qwen, t5) for r, _ in row.native_reasons}
    assert not any("diffusion_kv_cache_dtype" in r for r in reasons)
    assert any("'wo'" in r for r, _ in t5.native_reasons)
    assert qwen.linear_weight_only >= 1  # its lm_head: a text encoder's sensitive layer, weight-only by default
    assert len(reasons) == 2  # not vacuous: the attention and wo reasons
    assert all(any(s in r for s in SAYS_WHAT_TO_SET) for r in reasons), reasons
    assert "nothing to set" in str(fx_fp8.summary(pipe))
    # the per-node report says it at the source, not only the summary
    for encoder in (pipe.text_encoder, pipe.text_encoder_2):
        attention = [e for rep in fx_fp8.get_reports(encoder) for e in rep.entries if e.op == "attention"]
        assert attention and {e.reason for e in attention} == {LINEARS_ONLY_ATTENTION}
