"""normalise_keys (fx_fp8/config/keys.py): the key rules FP8Config.from_kwargs and replace share,
written once, so both entry points take the same spellings and refuse bad keys with the same
messages; vLLM-Omni's quantize_sensitive becomes `sensitive` there."""

import pytest
import yaml

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.keys import normalise_keys

ENTRY_POINTS = {
    "from_kwargs": FP8Config.from_kwargs,
    "replace": lambda **kw: FP8Config().replace(**kw),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"cache_backend": "tea_cache"},
            r"'cache_backend' is a pipeline option, not an FP8 option: pass it to fx_fp8.compile_pipeline",
        ),
        ({"quantization": {"transformer": "fp8"}}, r"quantization \{'transformer': 'fp8'\} maps pipeline components"),
        ({"kv_cache_dtyp": "fp8"}, r"unknown config key 'kv_cache_dtyp' \(did you mean 'kv_cache_dtype'\?\)"),
        ({"quantisation": "fp8"}, r"unknown config key 'quantisation' \(did you mean 'quantization'\?\)"),
        (
            {"quantization": "fp8", "quantization_config": "int8"},
            "quantization 'fp8' disagrees with quantization_config.method 'int8'",
        ),
        (
            {"ignored_layers": ["a"], "quantization_config": {"ignored_layers": ["b"]}},
            r"ignored_layers given twice with different values: \['a'\] and quantization_config.ignored_layers=\['b'\]",
        ),
        (
            {"quantization_skip_steps": "0-3", "quantization_config": {"skip_steps": "0-2"}},
            "quantization_skip_steps '0-3' disagrees with quantization_config.skip_steps '0-2'",
        ),
        (
            {"quantization_config": {"quantize_sensitive": True, "sensitive": "native"}},
            r"quantize_sensitive: true \(a synonym of sensitive: fp8\) disagrees with quantization_config.sensitive 'native'",
        ),
        (
            {"quantization_config": {"quantize_sensitive": "yes"}},
            "invalid quantization_config.quantize_sensitive 'yes'",
        ),
        ({"quantization_config": 5}, "invalid quantization_config 5: expected a mapping"),
    ],
)
def test_both_entry_points_refuse_alike(entry, kw, message):
    with pytest.raises(ValueError, match=message):
        ENTRY_POINTS[entry](**kw)


def test_replace_says_what_a_pipeline_key_or_a_component_map_is():
    # replace (FP8Config.load's overrides) said only "unknown config key" / "invalid quantization"
    base = FP8Config()
    with pytest.raises(ValueError, match="'parallel_config' is a pipeline option") as e:
        base.replace(parallel_config={"ulysses_degree": 2})
    assert "unknown config key" not in str(e.value)
    with pytest.raises(ValueError, match=r"component map\): fx_fp8.compile_pipeline reads it"):
        FP8Config.load(base, quantization={"transformer": "fp8", "text_encoder": "int8"})


def test_quantize_sensitive_is_folded_into_sensitive_at_the_door():
    def qc(**given):
        return normalise_keys({"quantization_config": given}).data["quantization_config"]

    assert qc(quantize_sensitive=True) == {"sensitive": "fp8"}
    assert qc(quantize_sensitive=True, sensitive="FP8") == {"sensitive": "fp8"}
    assert qc(quantize_sensitive=False, min_features=0) == {"min_features": 0}  # false says nothing
    assert qc(quantize_sensitive=False, sensitive="native") == {"sensitive": "native"}
    cfg = FP8Config.from_kwargs(quantization_config={"quantize_sensitive": True})
    assert cfg.quantization_config.sensitive == "fp8" and cfg.quantization_config.quantize_sensitive
    assert "quantize_sensitive" not in cfg.to_dict()["quantization_config"]  # what a saved YAML holds
    # an override replaces the base's setting, in either spelling; false keeps the base's
    assert cfg.replace(quantization_config={"sensitive": "native"}).quantization_config.sensitive == "native"
    assert cfg.replace(quantization_config={"quantize_sensitive": False}).quantization_config.sensitive == "fp8"
    native = FP8Config.from_kwargs(quantization_config={"sensitive": "native"})
    assert native.replace(quantization_config={"quantize_sensitive": True}).quantization_config.sensitive == "fp8"


@pytest.mark.parametrize(
    "quantize_sensitive, sensitive, expected",
    [
        (True, "fp8", "fp8"),
        (False, "weight_only", "weight_only"),
        (False, "native", "native"),
        (True, None, "fp8"),
        (False, None, "weight_only"),  # written before `sensitive` existed
    ],
)
def test_a_yaml_saved_with_quantize_sensitive_still_loads(tmp_path, quantize_sensitive, sensitive, expected):
    data = FP8Config().to_dict()
    qc = data["quantization_config"]
    qc["quantize_sensitive"] = quantize_sensitive
    if sensitive is None:
        del qc["sensitive"]
    else:
        qc["sensitive"] = sensitive
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    for cfg in (FP8Config.from_yaml(path), FP8Config.load(data), FP8Config().replace(**data)):
        assert cfg.quantization_config.sensitive == expected


def test_replace_quantization_sets_the_method_next_to_other_linear_settings():
    # the base's method does not survive a new `quantization` (it raised "disagrees" when
    # quantization_config came along without a method)
    int8 = FP8Config.from_kwargs(quantization="int8")
    cfg = int8.replace(quantization="fp8", quantization_config={"min_features": 0})
    assert cfg.quantization == "fp8" and cfg.quantization_config.method == "fp8"
    assert cfg.quantization_config.min_features == 0


def test_replace_keeps_a_flat_ignored_layers_next_to_a_reset_quantization_config():
    # quantization_config=None resets the linear settings; the flat ignored_layers next to it was dropped
    base = FP8Config.from_kwargs(quantization="fp8", quantization_config={"min_features": 0})
    cfg = base.replace(quantization_config=None, ignored_layers=["img_mlp"])
    assert cfg.quantization_config.ignored_layers == ("img_mlp",) and cfg.quantization_config.min_features == 32
    assert base.replace(quantization_config=None).quantization_config.min_features == 32


def test_quantization_config_built_directly_still_takes_quantize_sensitive():
    """The public dataclass kept its vLLM-Omni keyword when the field was folded into `sensitive`."""
    from fx_fp8 import QuantizationConfig

    assert QuantizationConfig(quantize_sensitive=True).sensitive == "fp8"
    assert QuantizationConfig(quantize_sensitive=False).sensitive == QuantizationConfig().sensitive
    with pytest.raises(ValueError, match="disagrees with quantization_config.sensitive 'weight_only'"):
        QuantizationConfig(quantize_sensitive=True, sensitive="weight_only")
