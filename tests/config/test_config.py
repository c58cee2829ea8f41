"""FP8Config: construction from kwargs / YAML / mappings, validation messages, round trips."""

import warnings

import pytest
import yaml

from fx_fp8.compile.backend import config_from_options
from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.quantization import QuantizationConfig


def test_defaults_turn_both_features_on():
    cfg = FP8Config.from_kwargs()
    assert cfg.attention_enabled and cfg.linear_enabled and not cfg.has_step_skips
    qc = cfg.quantization_config
    assert qc.ignored_layers == () and qc.quantize_sensitive is False and qc.method == "fp8"


@pytest.mark.parametrize(
    "kw, attention, linear",
    [
        ({"quantization": None}, True, False),
        ({"diffusion_kv_cache_dtype": None}, False, True),
        ({"diffusion_kv_cache_dtype": "auto"}, False, True),
        ({"diffusion_kv_cache_dtype": "None"}, False, True),
        ({"quantization": "fp8"}, False, True),  # one opt-in: the other stays off (vLLM-Omni)
        ({"diffusion_kv_cache_dtype": "fp8"}, True, False),
        ({"diffusion_kv_cache_dtype": "fp8", "quantization": "fp8"}, True, True),
        ({"diffusion_kv_cache_dtype": None, "quantization": None}, False, False),
    ],
)
def test_feature_switches(kw, attention, linear):
    cfg = FP8Config.from_kwargs(**kw)
    assert (cfg.attention_enabled, cfg.linear_enabled) == (attention, linear)


@pytest.mark.parametrize(
    "key, hint",
    [
        ("diffusion_kv_cache_skip_step", "diffusion_kv_cache_skip_steps"),
        ("quantisation", "quantization"),
        ("ignored_layer", "ignored_layers"),
    ],
)
def test_unknown_top_key_did_you_mean(key, hint):
    with pytest.raises(ValueError) as e:
        FP8Config.from_kwargs(**{key: "0"})
    assert repr(key) in str(e.value) and f"did you mean {hint!r}" in str(e.value)


def test_unknown_nested_keys_did_you_mean():
    with pytest.raises(
        ValueError,
        match=r"unknown key 'activation_schem' in quantization_config \(did you mean 'activation_scheme'\?\)",
    ):
        FP8Config.from_kwargs(quantization_config={"activation_schem": "dynamic"})
    with pytest.raises(ValueError, match=r"'hadamrd' in attention \(did you mean 'hadamard'\?\)"):
        FP8Config.from_kwargs(attention={"hadamrd": True})


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"diffusion_kv_cache_dtype": "fp16"}, "invalid diffusion_kv_cache_dtype 'fp16'"),
        ({"quantization": "awq"}, "invalid quantization 'awq'"),
        ({"quantization_config": {"method": "nf4"}}, "invalid quantization_config.method 'nf4'"),
        ({"quantization_config": {"weight_block_size": [128]}}, "invalid weight_block_size [128]"),
        ({"quantization_config": {"weight_block_size": [128, 0]}}, "invalid weight_block_size 0"),
        ({"quantization_config": {"weight_block_size": "128x128"}}, "invalid weight_block_size '128x128'"),
        (
            {"quantization_config": {"weight_granularity": "row"}},
            "invalid quantization_config.weight_granularity 'row'",
        ),
        (
            {"quantization_config": {"activation_scheme": "static"}},
            "activation_scheme 'static' needs activation_scales",
        ),
        ({"quantization_config": {"activation_scales": 3}}, "invalid activation_scales 3"),
        ({"quantization_config": {"min_features": -1}}, "invalid quantization_config.min_features -1"),
        ({"quantization_config": {"ignored_layers": ["re:(unclosed"]}}, "'re:(unclosed'"),
        ({"quantization_config": {"ignored_layers": [3]}}, "invalid ignored_layers [3]"),
        ({"attention": {"granularity": "token"}}, "invalid attention.granularity 'token'"),
        ({"attention": {"q_block": 0}}, "invalid attention.q_block 0"),
        ({"attention": {"hadamard": "yes"}}, "invalid attention.hadamard 'yes'"),
        ({"attention": {"p_scale": 1000}}, "invalid attention.p_scale 1000"),
        ({"attention": "block"}, "invalid attention 'block'"),
        ({"lowering": "tpu"}, "invalid lowering 'tpu'"),
        ({"downstream": "tensorrt"}, "invalid downstream 'tensorrt'"),
        ({"diffusion_kv_cache_skip_steps": "0,a"}, "invalid token 'a' in diffusion_kv_cache_skip_steps '0,a'"),
        ({"diffusion_kv_cache_skip_layers": "2-1"}, "invalid token '2-1' in diffusion_kv_cache_skip_layers '2-1'"),
    ],
)
def test_bad_values_name_the_value(kw, needle):
    with pytest.raises(ValueError) as e:
        FP8Config.from_kwargs(**kw)
    assert needle in str(e.value), str(e.value)


def test_block_size_implies_block_granularity():
    qc = QuantizationConfig(weight_block_size=[64, 32])
    assert qc.weight_granularity == "block" and qc.weight_block_size == (64, 32)
    assert QuantizationConfig(weight_granularity="block").weight_block_size == (128, 128)


def test_legacy_keys_accepted():
    cfg = FP8Config.from_kwargs(kv_cache_dtype="fp8", kv_cache_skip_steps="0,1", kv_cache_skip_layers=[3])
    assert cfg.attention_enabled and not cfg.linear_enabled
    assert cfg.diffusion_kv_cache_skip_steps == {0, 1} and cfg.diffusion_kv_cache_skip_layers == {3}


def test_new_key_wins_over_legacy_with_warning():
    with pytest.warns(UserWarning, match="both 'diffusion_kv_cache_skip_steps' and legacy 'kv_cache_skip_steps'"):
        cfg = FP8Config.from_kwargs(diffusion_kv_cache_skip_steps="0", kv_cache_skip_steps="0-3")
    assert cfg.diffusion_kv_cache_skip_steps == {0}


def test_legacy_keys_as_overrides_of_a_config():
    base = FP8Config()
    assert FP8Config.load(base, kv_cache_skip_steps="2").diffusion_kv_cache_skip_steps == {2}
    with pytest.warns(UserWarning, match="legacy 'kv_cache_skip_steps'"):
        cfg = FP8Config.load(base, kv_cache_skip_steps="1", diffusion_kv_cache_skip_steps="3")
    assert cfg.diffusion_kv_cache_skip_steps == {3}


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: FP8Config.from_kwargs(**kw),
        lambda **kw: FP8Config.load(FP8Config(diffusion_kv_cache_dtype=None), **kw),
    ],
)
def test_explicit_none_next_to_a_legacy_value_counts_as_not_given(build):
    # argparse-built dicts carry None for every flag: the legacy flag the user did give wins
    cfg = build(
        diffusion_kv_cache_dtype=None, kv_cache_dtype="fp8", kv_cache_skip_steps="0", diffusion_kv_cache_skip_steps=None
    )
    assert cfg.attention_enabled and cfg.diffusion_kv_cache_skip_steps == {0}


def test_ignored_layers_shortcut():
    cfg = FP8Config.from_kwargs(ignored_layers=["img_mlp"])
    assert cfg.quantization_config.ignored_layers == ("img_mlp",)
    assert cfg.linear_enabled and not cfg.attention_enabled  # a linear setting alone opts into linears only
    assert FP8Config.from_kwargs(ignored_layers=[]).quantization_config.ignored_layers == ()
    assert FP8Config.from_kwargs(ignored_layers="a, b").quantization_config.ignored_layers == ("a", "b")
    with pytest.raises(ValueError, match="ignored_layers given twice"):
        FP8Config.from_kwargs(ignored_layers=["a"], quantization_config={"ignored_layers": ["b"]})


def test_defaults_token_is_accepted_and_changes_nothing():
    assert QuantizationConfig(ignored_layers=["img_mlp", "@defaults"]).ignored_layers == ("img_mlp",)
    assert not QuantizationConfig(ignored_layers=["@defaults"]).quantize_sensitive


@pytest.mark.parametrize(
    "build",
    [
        lambda: FP8Config.from_kwargs(quantization="fp8", ignored_layers=None),
        lambda: FP8Config.from_kwargs(quantization="fp8", ignored_layers=[]),
        lambda: FP8Config.from_kwargs(quantization="fp8", quantization_config={"ignored_layers": None}),
        lambda: FP8Config.from_mapping({"quantization": "fp8", "ignored_layers": None}),
        lambda: FP8Config.from_mapping({"quantization": "fp8", "quantization_config": {"ignored_layers": None}}),
        lambda: FP8Config.load(FP8Config.from_kwargs(quantization="fp8", ignored_layers=["a"]), ignored_layers=None),
        lambda: FP8Config.load(None, quantization="fp8", ignored_layers=None),
    ],
)
def test_ignored_layers_none_means_the_same_everywhere(build):
    qc = build().quantization_config
    assert qc.ignored_layers == () and not qc.quantize_sensitive


def test_quantization_config_as_a_method_string_and_alone():
    cfg = FP8Config.from_kwargs(quantization_config="fp8")  # vLLM-Omni's tests pass it so
    assert cfg.linear_enabled and cfg.quantization_config.method == "fp8" and not cfg.attention_enabled
    alone = FP8Config.from_kwargs(
        quantization_config={"ignored_layers": ["img_mlp"]}
    )  # its t2i script's --ignored-layers
    assert alone.linear_enabled and not alone.attention_enabled
    int8 = FP8Config.from_kwargs(quantization_config={"method": "int8"})
    assert int8.quantization == "int8" and int8.quantization_config.method == "int8"
    assert FP8Config.from_kwargs(quantization="int8").quantization_config.method == "int8"
    with pytest.raises(ValueError, match="quantization 'fp8' disagrees with quantization_config.method 'int8'"):
        FP8Config.from_kwargs(quantization="fp8", quantization_config={"method": "int8"})
    assert FP8Config.load(FP8Config(), quantization="int8").quantization_config.method == "int8"


def test_linear_opt_in_with_attention_selectors_keeps_attention_on():
    cfg = FP8Config.from_kwargs(ignored_layers=["img_mlp"], diffusion_kv_cache_skip_steps="0,1")
    assert cfg.attention_enabled and cfg.linear_enabled and cfg.has_step_skips
    assert not FP8Config.from_kwargs(quantization="fp8").attention_enabled
    assert not FP8Config.from_kwargs(quantization=None, diffusion_kv_cache_skip_layers="1").linear_enabled


def test_attention_granularity_case_is_normalised():
    cfg = FP8Config.from_kwargs(attention={"granularity": "HEAD", "kernel": "Triton"})
    assert cfg.attention.granularity == "head" and cfg.attention.kernel == "triton"


def test_flat_yaml(tmp_path):
    path = tmp_path / "fp8.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "diffusion_kv_cache_dtype": "fp8",
                "diffusion_kv_cache_skip_steps": "0,1",
                "quantization": "fp8",
                "quantization_config": {"ignored_layers": ["img_mlp"], "weight_block_size": [128, 128]},
                "attention": {"granularity": "head", "hadamard": False},
            }
        )
    )
    cfg = FP8Config.from_yaml(path)
    assert cfg.diffusion_kv_cache_skip_steps == {0, 1} and cfg.attention.granularity == "head"
    assert cfg.quantization_config.weight_granularity == "block"
    assert FP8Config.load(str(path)) == cfg


def test_stage_config_yaml(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "stage_args": [
                    {"stage_id": 0, "stage_type": "llm", "engine_args": {"quantization": "awq-not-ours"}},
                    {
                        "stage_id": 1,
                        "stage_type": "diffusion",
                        "engine_args": {
                            "model": "Qwen/Qwen-Image",
                            "diffusion_kv_cache_dtype": "fp8",
                            "diffusion_kv_cache_skip_steps": "0-1",
                            "quantization": "fp8",
                            "quantization_config": {"ignored_layers": ["img_mlp"]},
                        },
                    },
                ]
            }
        )
    )
    with pytest.warns(UserWarning, match=r"engine_args keys not used by fx_fp8: \['model'\]"):
        cfg = FP8Config.from_yaml(path)
    assert cfg.attention_enabled and cfg.linear_enabled and cfg.diffusion_kv_cache_skip_steps == {0, 1}
    assert cfg.quantization_config.ignored_layers == ("img_mlp",)


def test_stage_config_without_diffusion_stage(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump({"stage_args": [{"stage_id": 0, "stage_type": "llm"}]}))
    with pytest.raises(ValueError, match="no stage with stage_type: diffusion"):
        FP8Config.from_yaml(path)


def test_yaml_errors(tmp_path):
    with pytest.raises(ValueError, match="config file not found: '.*missing.yaml'"):
        FP8Config.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        FP8Config.from_yaml(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ValueError, match="expected a mapping at the top level, got list"):
        FP8Config.from_yaml(listy)
    typo = tmp_path / "typo.yaml"
    typo.write_text("diffusion_kv_cache_skip_step: '0'\n")
    with pytest.raises(ValueError, match="did you mean 'diffusion_kv_cache_skip_steps'"):
        FP8Config.from_yaml(typo)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"quantization": None},
        {
            "diffusion_kv_cache_dtype": "fp8",
            "diffusion_kv_cache_skip_steps": "0,1,4-6",
            "diffusion_kv_cache_skip_layers": [0, 9],
        },
        {
            "quantization": "fp8",
            "quantization_config": {
                "ignored_layers": ["img_mlp", "re:.*proj"],
                "weight_block_size": [64, 128],
                "activation_scheme": "static",
                "activation_scales": {"a": 0.5},
            },
        },
        {
            "attention": {
                "granularity": "tensor",
                "hadamard": False,
                "smooth_k": False,
                "p_scale": 224.0,
                "cross_attention": True,
            },
            "lowering": "reference",
            "downstream": "inductor",
        },
    ],
)
def test_to_dict_round_trip(kw, tmp_path):
    cfg = FP8Config.from_kwargs(**kw)
    assert FP8Config.from_kwargs(**cfg.to_dict()) == cfg
    cfg.to_yaml(tmp_path / "c.yaml")
    assert FP8Config.from_yaml(tmp_path / "c.yaml") == cfg


def test_load_forms_and_overrides(tmp_path):
    base = FP8Config.from_kwargs(diffusion_kv_cache_skip_steps="0")
    assert FP8Config.load(base) is base
    assert FP8Config.load({"diffusion_kv_cache_skip_steps": "0"}) == base
    over = FP8Config.load(base, quantization=None, attention={"hadamard": False})
    assert not over.linear_enabled and over.attention.hadamard is False and over.attention.granularity == "block"
    assert over.diffusion_kv_cache_skip_steps == {0}
    with pytest.raises(ValueError, match="invalid config 42"):
        FP8Config.load(42)
    with pytest.raises(ValueError, match="did you mean 'quantization'"):
        FP8Config.load(base, quantisation=None)


def test_config_from_options_forms(tmp_path):
    cfg, extra = config_from_options({"diffusion_kv_cache_skip_steps": "0,1", "dump_graphs": True})
    assert cfg.diffusion_kv_cache_skip_steps == {0, 1} and extra == {"dump_graphs": True}
    given = FP8Config.from_kwargs(quantization=None)
    assert config_from_options({"config": given})[0] is given
    path = tmp_path / "c.yaml"
    given.to_yaml(path)
    assert config_from_options({"config": str(path)})[0] == given
    # options next to a config override it
    assert config_from_options({"config": given, "lowering": "reference"})[0].lowering == "reference"
    assert config_from_options(None)[0] == FP8Config()


def test_dataclasses_direct():
    assert AttentionQuantConfig().granularity == "block"
    with pytest.raises(ValueError, match="expected a mapping"):
        FP8Config(quantization_config=[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FP8Config.from_kwargs(quantization="int8")  # int8 is a method, not a warning


def test_selectors_of_a_feature_that_is_off_warn():
    with pytest.warns(UserWarning, match="diffusion_kv_cache_skip_steps set but FP8 attention is off"):
        FP8Config.from_kwargs(diffusion_kv_cache_dtype=None, diffusion_kv_cache_skip_steps="0,1")
    with pytest.warns(UserWarning, match="ignored_layers set but quantized linears are off"):
        FP8Config.from_kwargs(quantization=None, ignored_layers=["img_mlp"])
