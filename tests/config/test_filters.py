"""ignored_layers pattern semantics (fx_fp8/config/patterns.py), one test per rule, and precedence."""

import pytest
import torch

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.quantization import QuantizationConfig
from fx_fp8.config.patterns import first_match, matches, validate_pattern
from fx_fp8.quant.linear_plan import plan_linear
from fx_fp8.quant.rules import SENSITIVE_LAYER_PATTERNS

from toy_models import TwoLinears


def native_reason(name, in_features, out_features, dtype, qcfg, sensitive=None):
    """plan_linear's native reason for the linear `name`, None when it is quantized."""
    plan = plan_linear(name, in_features, out_features, dtype, qcfg, sensitive=sensitive)
    return plan.reason if plan.native else None


NAME = "transformer_blocks.7.img_mlp.net.0.proj"


@pytest.mark.parametrize(
    "pattern, name, hit",
    [
        # plain names match any run of whole dotted components
        ("img_mlp", NAME, True),
        ("img_mlp.net", NAME, True),
        ("net.0.proj", NAME, True),
        ("transformer_blocks.7", NAME, True),
        ("mlp", NAME, False),  # not a substring match
        ("img", NAME, False),
        ("7.img", NAME, False),
        ("transformer_blocks.1", "transformer_blocks.17.attn", False),
        # globs match the whole name
        ("*img_mlp*", NAME, True),
        ("img_mlp*", NAME, False),
        ("transformer_blocks.?.img_mlp.*", NAME, True),
        ("transformer_blocks.[0-6].*", NAME, False),
        # re: must match the whole name
        ("re:.*img_mlp.*", NAME, True),
        ("re:img_mlp", NAME, False),
        ("re:transformer_blocks\\.\\d+\\.img_mlp\\..*", NAME, True),
        ("re:proj_out", "proj_out", True),
        ("re:proj_out", "single_transformer_blocks.3.proj_out", False),
    ],
)
def test_pattern_rules(pattern, name, hit):
    assert matches(pattern, name) is hit


def test_first_match_reports_the_pattern():
    assert first_match(["mlp", "img_mlp", "re:.*"], NAME) == "img_mlp"
    assert first_match(["mlp"], NAME) is None


@pytest.mark.parametrize("bad", ["re:(", "re:[a-", "re:*x"])
def test_bad_regex_names_pattern(bad):
    with pytest.raises(ValueError) as e:
        validate_pattern(bad)
    assert repr(bad) in str(e.value) and "regular expression" in str(e.value)
    with pytest.raises(ValueError, match="invalid ignored_layers pattern"):
        FP8Config.from_kwargs(ignored_layers=["ok", bad])


def test_ignored_beats_eligibility():
    qc = QuantizationConfig(ignored_layers=["img_mlp"])
    # an ignored layer that is also too small reports the pattern, not the size
    assert (
        native_reason("img_mlp.fc", 8, 8, torch.float32, qc)
        == "ignored_layers pattern 'img_mlp' (remove it from quantization_config.ignored_layers to quantize this layer)"
    )
    assert "min_features" in native_reason("other.fc", 16, 16, torch.float32, qc)
    assert "multiples of 16" in native_reason("other.fc", 24, 64, torch.float32, qc)
    assert native_reason("other.fc", 64, 64, torch.float32, qc) is None
    assert "weight dtype" in native_reason("other.fc", 64, 64, torch.int8, qc)


def test_user_list_adds_to_the_sensitive_layers():
    sensitive = "time_text_embed.linear_1"
    for kw in ({}, {"ignored_layers": ["img_mlp"]}, {"ignored_layers": []}):
        # pinned to native: the native reason names what the analysis found
        reason = native_reason(sensitive, 64, 64, torch.float32, QuantizationConfig(sensitive="native", **kw))
        assert reason.startswith("known sensitive layer (pattern 'time_text_embed')"), reason
        # the default runs it weight-only, for the same reason
        plan = plan_linear(sensitive, 64, 64, torch.float32, QuantizationConfig(**kw))
        kind, why = plan.kind, plan.reason
        assert kind == "weight_only" and why.startswith("known sensitive layer (pattern 'time_text_embed')"), why
    opt_in = QuantizationConfig(ignored_layers=["img_mlp"], sensitive="fp8")
    assert native_reason(sensitive, 64, 64, torch.float32, opt_in) is None
    assert (
        native_reason("a.img_mlp.fc", 64, 64, torch.float32, opt_in)
        == "ignored_layers pattern 'img_mlp' (remove it from quantization_config.ignored_layers to quantize this layer)"
    )
    # a structural reason found in the graph is reported instead of the name pattern
    assert native_reason(
        "blocks.0.mod", 64, 64, torch.float32, QuantizationConfig(sensitive="native"), sensitive="adaLN modulation"
    ).startswith("adaLN modulation; kept native")


@pytest.mark.parametrize(
    "name, ignored",
    [
        ("x_embedder", True),
        ("transformer_blocks.0.norm1.linear", True),
        ("transformer_blocks.0.norm1_context.linear", True),
        ("norm_out.linear", True),
        ("proj_out", True),
        ("transformer_blocks.0.img_mod.1", True),
        ("layers.3.adaLN_modulation.0", True),
        ("condition_embedder.time_proj", True),
        ("single_transformer_blocks.3.proj_out", False),
        ("transformer_blocks.0.attn.to_q", False),
        ("transformer_blocks.0.ff.net.2", False),
        ("blocks.0.norm2", False),
    ],
)
def test_default_patterns(name, ignored):
    assert (first_match(SENSITIVE_LAYER_PATTERNS, name) is not None) is ignored


def test_unmatched_user_pattern_warns():
    model = TwoLinears(names=("fc1", "fc2")).eval()
    compiled = torch.compile(model, backend="fp8", options={"ignored_layers": ["fc1", "no_such_layer"]})
    with pytest.warns(
        UserWarning, match=r"ignored_layers patterns matched no linear of the model: \['no_such_layer'\]"
    ):
        compiled(torch.randn(4, 64))
    (report,) = fx_fp8.get_reports(compiled)
    actions = {e.module: (e.action, e.reason) for e in report.entries if e.op == "linear"}
    assert actions["fc1"] == (
        "native",
        "ignored_layers pattern 'fc1' (remove it from quantization_config.ignored_layers to quantize this layer)",
    )
    assert actions["fc2"][0] == "fp8"
