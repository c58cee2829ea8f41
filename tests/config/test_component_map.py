"""The component map (vLLM-Omni's per-component `quantization` mapping, fx_fp8/config/components.py):
which config each pipeline component gets, and the errors for malformed specs."""

from __future__ import annotations

import pytest

from fx_fp8.config.components import ComponentConfigs, is_component_map, matching_key


def test_plain_config_means_the_transformers():
    scoped = ComponentConfigs.split({"quantization": "int8"}, {})
    assert scoped.specs is None
    assert scoped.transformer_config("transformer").quantization == "int8"
    assert not is_component_map({"method": "fp8"}) and is_component_map({"text_encoder": "fp8"})


def test_map_scopes_linears_and_keeps_attention_for_transformers(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text(
        "diffusion_kv_cache_dtype: fp8\nquantization:\n  transformer: fp8\n"
        "  text_encoder: {quant_method: int8, ignored_layers: [fc2]}\n  text_encoder_2: null\n"
    )
    scoped = ComponentConfigs.split(str(path), {})
    t = scoped.transformer_config("transformer")
    assert t.attention_enabled and t.quantization == "fp8"
    te = scoped.component_config("text_encoder")
    assert not te.attention_enabled and te.quantization == "int8"
    assert te.quantization_config.ignored_layers == ("fc2",)
    assert not scoped.component_config("text_encoder_2").linear_enabled
    # a key covers the names it begins (vLLM-Omni's prefix rule): 'transformer' covers transformer_2
    assert scoped.transformer_config("transformer_2").quantization == "fp8"
    # a denoising transformer no key begins keeps native linears (vLLM-Omni: default none)
    only_encoders = ComponentConfigs.split(None, {"quantization": {"text_encoder": "fp8"}})
    assert not only_encoders.transformer_config("transformer").linear_enabled


def test_default_covers_unnamed_transformers_and_override_map():
    scoped = ComponentConfigs.split(None, {"quantization": {"text_encoder": "fp8", "default": "int8"}})
    assert scoped.named == ["text_encoder"]
    assert scoped.transformer_config("transformer_2").quantization == "int8"


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"text_encoder": {"ignored_layers": ["x"]}}, "text_encoder .* has no method"),
        ({"text_encoder": {"method": "fp8", "quant_method": "int8"}}, "disagree"),
        ({"text_encoder": 8}, "invalid quantization=.text_encoder 8"),
        ({"default": "fp8"}, "names no component"),
        ({"text_encoder": "fp4"}, "fp4"),
    ],
)
def test_bad_specs_name_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        scoped = ComponentConfigs.split(None, {"quantization": spec})
        scoped.component_config("text_encoder")


def test_map_in_config_and_quantization_override_refused():
    with pytest.raises(ValueError, match="both set quantization"):
        ComponentConfigs.split({"quantization": {"text_encoder": "fp8"}}, {"quantization": "fp8"})


def test_a_model_config_given_a_component_map_points_to_compile_pipeline():
    from fx_fp8.config.fp8_config import FP8Config

    with pytest.raises(ValueError, match=r"maps pipeline components .* fx_fp8.compile_pipeline reads it"):
        FP8Config.load({"quantization": {"text_encoder": "fp8"}})


def test_keys_match_as_vllm_omni_prefixes_longest_first():
    """vLLM-Omni's ComponentQuantizationConfig.resolve: str.startswith, the longest key that
    begins the name wins, no dot boundary; wildcard keys are fnmatch patterns tried first."""
    keys = ["text_encoder", "text_encoder_2", "transformer", "t"]
    assert matching_key("text_encoder", keys) == "text_encoder"
    assert matching_key("text_encoder_2", keys) == "text_encoder_2"  # longest wins, whatever the order
    assert matching_key("text_encoder_3", keys) == "text_encoder"
    assert matching_key("transformer_2", keys) == "transformer"
    assert matching_key("tokenizer", keys) == "t"
    assert matching_key("vae", keys) is None
    # a key with a shell wildcard is an fnmatch pattern over the whole name, tried before the prefixes
    assert matching_key("text_encoder_2", ["text_encoder*"]) == "text_encoder*"
    assert matching_key("text_encoder", ["text_encoder_*", "t"]) == "t"
    assert matching_key("text_encoder_2", ["text_encoder_2", "text_encoder_?"]) == "text_encoder_?"
    assert matching_key("text_encoder_2", ["text_*", "text_encoder_*"]) == "text_encoder_*"  # longest pattern
    assert matching_key("vae", ["text_*"]) is None
    scoped = ComponentConfigs.split(
        None,
        {"quantization": {"text_encoder": "fp8", "text_encoder_2": None, "transformer_2": "int8", "default": "fp8"}},
    )
    assert scoped.component_config("text_encoder_3").quantization == "fp8"
    assert not scoped.component_config("text_encoder_2").linear_enabled
    assert scoped.transformer_config("transformer_2").quantization == "int8"
    assert scoped.transformer_config("transformer").quantization == "fp8"  # default: no key begins it
