"""One decision per linear (fx_fp8/quant/linear_plan.py): plan_linear is called only by its named
consumers; every native reason says what the user can set; equal inputs give equal plans; a
prepared layer is built from its plan (QuantizedLinear.from_plan), as prepare_model builds it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.quantization import QuantizationConfig
from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.ops.reference import ReferenceLowering
from fx_fp8.quant.linear_plan import QUANTIZATION_OFF, Calibration, LinearPlan, plan_linear
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.recipe import recipe
from fx_fp8.quant.rules import text_encoder_sensitive_reason

PACKAGE = Path(fx_fp8.__file__).resolve().parent
#: the modules that may decide a linear, and how many calls each makes
CONSUMERS = {
    "passes/linear_decisions.py": 2,  # the linear pass's decisions, and its instance facts
    "passes/prequantized.py": 2,  # the pre-quantized pass (a stored layout), and its instance facts
    "quant/prepare.py": 1,  # prepare_model
    "quant/layer_quantize.py": 1,  # the diffusers load path
    "quant/prequantized.py": 1,  # adopt_prequantized
    "tools/tiny_model/fake_quant.py": 1,  # FP8-aware training's simulation of the pass
}


def plan_calls() -> dict[str, int]:
    """{module path under fx_fp8/: calls of plan_linear}, from the source."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if "plan_linear" not in text:  # parse only the files that name it
            continue
        tree = ast.parse(text)
        n = sum(
            1
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "plan_linear"
        )
        if n:
            out[str(path.relative_to(PACKAGE))] = n
    return out


def test_only_the_named_consumers_decide_a_linear():
    calls = plan_calls()
    assert set(calls) - set(CONSUMERS) == set(), f"plan_linear called outside its consumers: {calls}"
    # each consumer decides through it (none spells a rule of its own), a node once per pass run
    assert calls == CONSUMERS


QC = QuantizationConfig(ignored_layers=["blocks.0.ff"], sensitive="native")


@pytest.mark.parametrize(
    "name, shape, dtype, qcfg, setting",
    [
        ("blocks.0.ff", (64, 64), torch.float32, QC, "quantization_config.ignored_layers"),
        ("time_text_embed.linear_1", (64, 64), torch.float32, QC, "sensitive: weight_only"),
        ("blocks.0.attn", (16, 64), torch.float32, QC, "quantization_config.min_features"),
        ("blocks.0.attn", (64, 64), torch.int8, QC, "load the model in float32, bfloat16 or float16"),
        ("blocks.0.attn", (64, 72), torch.float32, QC, "no setting changes it"),
    ],
)
def test_each_native_reason_says_what_to_set(name, shape, dtype, qcfg, setting):
    plan = plan_linear(name, shape[0], shape[1], dtype, qcfg)
    assert plan.native and setting in plan.reason, plan.reason


def test_calibration_and_lowering_and_step_reasons_come_from_the_same_chain():
    qcfg = QuantizationConfig(activation_scheme="static", activation_scales={"a": 0.5})
    cal = Calibration(scales={"a": 0.5})
    assert plan_linear("a", 64, 64, torch.float32, qcfg, calibration=cal).static_scale == 0.5
    missing = plan_linear("b", 64, 64, torch.float32, qcfg, calibration=cal)
    assert missing.native and "activation_scheme: dynamic" in missing.reason  # what to set
    # the ignored_layers pattern comes before the calibration, the step variant after it
    assert (
        "ignored_layers"
        in plan_linear("b", 64, 64, torch.float32, QuantizationConfig(ignored_layers=["b"]), calibration=cal).reason
    )
    assert (
        plan_linear("a", 64, 64, torch.float32, qcfg, calibration=cal, step_mode="native").reason
        == "skipped step variant (quantization_config.skip_steps, native)"
    )
    skipped = plan_linear("a", 64, 64, torch.float32, qcfg, calibration=cal, step_mode="weight_only")
    assert skipped.weight_only and skipped.recipe == recipe("fp8", "channel")  # the W8A8 copy, run weight-only
    assert plan_linear("a", 64, 64, torch.float32, qcfg, enabled=False).reason == QUANTIZATION_OFF


def test_equal_inputs_give_equal_plans_and_a_plan_is_frozen():
    qcfg = QuantizationConfig()
    lowering = ReferenceLowering()
    a = plan_linear("blocks.0.x_embedder", 64, 64, torch.bfloat16, qcfg, lowering=lowering)
    b = plan_linear("blocks.0.x_embedder", 64, 64, torch.bfloat16, qcfg, lowering=lowering)
    assert a == b and a.weight_only and a.act == WEIGHT_ONLY and a.recipe is not None
    assert (a.kernel, a.measurement) == (None, None)  # the slot fx-fp8 tune fills
    with pytest.raises(Exception):
        a.kind = "native"
    with pytest.raises(ValueError, match="unknown linear plan kind 'fp16'"):
        LinearPlan("fp16")
    with pytest.raises(ValueError, match="a native linear plan needs its reason"):
        LinearPlan("native")


def test_from_plan_builds_what_prepare_model_builds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64)).eval()
    ref = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    fx_fp8.prepare_model(model, quantization="fp8")
    prepared = model[0]
    plan = plan_linear("0", 64, 64, torch.float32, QuantizationConfig())
    wq, ws = plan.recipe.quantize(ref[0])
    built = QuantizedLinear.from_plan(plan, wq, ws, ref[1], orig_dtype=torch.float32)
    assert (built.method, built.weight_granularity, built.weight_block, built.act_granularity) == (
        prepared.method,
        prepared.weight_granularity,
        prepared.weight_block,
        prepared.act_granularity,
    )
    assert torch.equal(built.weight.view(torch.uint8), prepared.weight.view(torch.uint8))
    with pytest.raises(ValueError, match=r"a 'native' linear plan has no quantization recipe \(small layer"):
        QuantizedLinear.from_plan(
            plan_linear("0", 16, 16, torch.float32, QuantizationConfig()), wq, ws, None, orig_dtype=torch.float32
        )


def test_a_text_encoders_head_and_vision_tower_are_sensitive_layers_the_setting_decides():
    """A text encoder's lm_head / vision tower (fx_fp8.quant.rules.TEXT_ENCODER_SENSITIVE_PATTERNS) is a
    sensitive layer, as a DiT's final projection: weight-only by default, native under sensitive: native,
    W8A8 under sensitive: fp8; each reason names it."""
    why = text_encoder_sensitive_reason("lm_head", "Qwen2_5_VLForConditionalGeneration")
    assert "output head lm_head" in why and text_encoder_sensitive_reason("model.language_model.x", "M") is None
    plan = plan_linear("lm_head", 64, 128, torch.float32, QuantizationConfig(), sensitive=why)
    assert plan.weight_only and plan.reason.startswith(why) and "sensitive: weight_only" in plan.reason
    plan = plan_linear("lm_head", 64, 128, torch.float32, QuantizationConfig(sensitive="native"), sensitive=why)
    assert plan.native and plan.reason.startswith(why) and "fp8 / quantize_sensitive: true, quantizes it" in plan.reason
    assert plan_linear("lm_head", 64, 128, torch.float32, QuantizationConfig(sensitive="fp8"), sensitive=why).w8a8
    # what the layer's shape rules out is said first, as for any linear
    assert (
        "min_features"
        in plan_linear("lm_head", 16, 128, torch.float32, QuantizationConfig(sensitive="fp8"), sensitive=why).reason
    )
