"""Modules split by concern keep their old import paths: each name the old module had is still
importable from it and is the very object of the module it moved to (a copy would drift, and a
test that wraps the old name would wrap nothing)."""
from __future__ import annotations

import importlib

import pytest

MOVED = {
    "fx_fp8.tools.sensitivity": {
        "fx_fp8.tools.sensitivity_items": ["ITEM_KINDS", "Item", "Measurement", "SensitivityResult", "block_pattern"],
        "fx_fp8.tools.sensitivity_search": ["ErrorModel", "greedy"],
        "fx_fp8.tools.sensitivity_steps": ["StepPolicy", "choose_step_policy", "edge_steps", "step_policy_candidates"],
        "fx_fp8.tools.sensitivity_chart": ["save_chart"],
    },
    "fx_fp8.ops.npu": {
        "fx_fp8.ops.npu_platform": ["ASCEND_950_SOC", "MODE7_REFUSED_FROM", "MXFP8_ATTENTION_FROM", "cann_accepts_mode7",
                                    "cann_has_mxfp8_attention", "cann_version", "chip_problem", "device_name",
                                    "import_problem", "is_fp8_chip", "parse_cann_version", "soc_version"],
        "fx_fp8.ops.npu_calls": ["BLOCK_QUANT_MODES", "INT_MAX", "KERNEL_HEAD_DIMS", "KERNEL_KV_BLOCK",
                                 "KERNEL_OUT_DTYPES", "KERNEL_Q_BLOCK", "MAX_MATMUL_DIM", "MX_QUANT_MODES",
                                 "P_SCALE_RANGE", "attention_call_kwargs", "kernel_block_scales", "kernel_head_dim",
                                 "linear_call_kwargs", "mindiesd_block_quant", "mindiesd_call_kwargs",
                                 "mx_call_kwargs", "weight_quant_call_kwargs", "weight_quant_group"],
        "fx_fp8.ops.npu_attention": ["KERNELS", "AttentionPlan", "attention_plan", "rotate_qk"],
    },
    "fx_fp8.tools.cli": {
        "fx_fp8.tools.cli_common": ["PROG", "UsageError", "to_json"],
        "fx_fp8.tools.cli_inspect": ["cmd_dump", "cmd_inspect", "compile_and_report", "format_inspect"],
        "fx_fp8.tools.cli_sensitivity": ["SENSITIVITY_HELP", "cmd_sensitivity"],
    },
    "fx_fp8.calibration": {
        "fx_fp8.activation_scales": ["CHANNEL_SECTION", "FORMAT", "GROUPS_SECTION", "STEP_SECTION", "ActivationScales",
                                     "load_activation_scales", "save_activation_scales"],
        "fx_fp8.step_groups": ["check_step_groups", "format_step_groups", "parse_step_groups"],
        "fx_fp8.linear_scales": ["channel_stats", "check_channel_amax", "check_per_step_supported",
                                 "check_scales_match", "method_scale", "smoothed_static_scale", "step_scale_table"],
    },
    "fx_fp8.checkpoint": {
        "fx_fp8.state_guard": ["guard", "quantized_layers", "unguard"],
    },
    "fx_fp8.weights": {
        "fx_fp8.weight_recipe": ["Smoothing"],
    },
    "fx_fp8.config": {
        "fx_fp8.attention_config": ["ATTENTION_GRANULARITIES", "ATTENTION_KERNELS", "AttentionQuantConfig"],
        "fx_fp8.quantization_config": ["DEFAULTS_TOKEN", "DEFAULT_SENSITIVE", "QUANTIZATION_METHODS", "SENSITIVE_MODES",
                                       "SKIP_STEPS_MODES", "QuantizationConfig"],
        "fx_fp8.config_keys": ["STEP_SHORTCUTS"],
    },
    "fx_fp8.backend": {
        "fx_fp8.dispatch": ["InstanceDispatch", "StepDispatch", "find_anchor"],
        "fx_fp8.instance_plans": ["Template", "check_reuse"],
    },
}
CASES = [(old, new, name) for old, parts in MOVED.items() for new, names in parts.items() for name in names]


@pytest.mark.parametrize("old,new,name", CASES, ids=[f"{o.rsplit('.', 1)[1]}.{n}" for o, _, n in CASES])
def test_moved_name_is_importable_from_its_old_module(old, new, name):
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_config_keeps_its_own_concern():
    """FP8Config's nested settings, its flat-key rules and its value checks live in their own modules;
    the dataclasses built from the old module are the new modules' classes."""
    from fx_fp8 import config

    assert config.QuantizationConfig.__module__ == "fx_fp8.quantization_config"
    assert config.AttentionQuantConfig.__module__ == "fx_fp8.attention_config"
    assert type(config.FP8Config().quantization_config) is config.QuantizationConfig
    assert config.TOP_KEYS is importlib.import_module("fx_fp8.config_keys").TOP_KEYS


def test_the_old_private_names_tests_import_still_resolve():
    from fx_fp8.tools import sensitivity, sensitivity_items, sensitivity_steps

    assert sensitivity._check_step_edges is sensitivity_steps.check_step_edges
    assert sensitivity._items is sensitivity_items.items_from_reports


def test_backend_keeps_what_tests_patch_and_its_old_private_names():
    """compile_graph reads CHECK_REUSE, INSTANCE_PLANS and _downstream_compile from fx_fp8.backend's globals
    (tests monkeypatch them there), so they stay defined in that module; the private names the split made
    public are the new modules' objects."""
    from fx_fp8 import backend, dispatch, instance_plans

    for name in ("CHECK_REUSE", "INSTANCE_PLANS", "_downstream_compile", "compile_graph"):
        assert name in backend.compile_graph.__globals__ and backend.compile_graph.__globals__ is vars(backend)
    assert not hasattr(dispatch, "CHECK_REUSE") and not hasattr(instance_plans, "CHECK_REUSE")
    assert backend._anchor is dispatch.find_anchor
    assert backend._Template is instance_plans.Template
    assert backend._check_reuse is instance_plans.check_reuse
