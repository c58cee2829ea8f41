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
}
CASES = [(old, new, name) for old, parts in MOVED.items() for new, names in parts.items() for name in names]


@pytest.mark.parametrize("old,new,name", CASES, ids=[f"{o.rsplit('.', 1)[1]}.{n}" for o, _, n in CASES])
def test_moved_name_is_importable_from_its_old_module(old, new, name):
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_the_old_private_names_tests_import_still_resolve():
    from fx_fp8.tools import sensitivity, sensitivity_items, sensitivity_steps

    assert sensitivity._check_step_edges is sensitivity_steps.check_step_edges
    assert sensitivity._items is sensitivity_items.items_from_reports
