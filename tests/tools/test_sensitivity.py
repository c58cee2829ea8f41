"""`fx-fp8 sensitivity`: the error model, the greedy search, and end-to-end runs (subprocess)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.patterns import matches
from fx_fp8.tools.sensitivity_search import ErrorModel, greedy
from fx_fp8.tools.sensitivity_items import Item
from fx_fp8.tools.image_metrics import psnr_db
from fx_fp8.tools.sensitivity_items import block_pattern

ROOT = Path(__file__).resolve().parents[2]


def _items():
    return [
        Item("attention_layer", 0, "attention layer 0", mse=5.0, work=10.0),
        Item("attention_layer", 1, "attention layer 1", mse=1.0, work=10.0),
        Item("attention_step", 0, "attention step 0", mse=4.0, work=20.0),
        Item("attention_step", 1, "attention step 1", mse=1.0, work=20.0),
        Item("linears_block", 0, "linears block 0", mse=0.5, work=100.0),
        Item("linears_block", 1, "linears block 1", mse=8.0, work=100.0),
    ]


def test_error_model_is_additive_and_separable():
    m = ErrorModel(_items(), steps=2)
    # attention (layer, step) = layer error x step error / mean of both totals ((6 + 5) / 2)
    assert m.raw(set()) == pytest.approx(6 * 5 / 5.5 + 0.5 + 8.0)
    assert m.raw({("attention_layer", 0)}) == pytest.approx(1 * 5 / 5.5 + 8.5)
    assert m.raw({("attention_step", 0), ("attention_layer", 0)}) == pytest.approx(1 * 1 / 5.5 + 8.5)
    assert m.raw({(i.kind, i.index) for i in _items()}) == 0.0
    # FP8 work over the run: attention per layer x live steps, linears x all steps
    assert m.work(set()) == pytest.approx(2 * 10 * 2 + 2 * 100 * 2)
    assert m.work({("attention_step", 1)}) == pytest.approx(2 * 10 * 1 + 400)


def test_greedy_keeps_native_the_best_error_per_flop_until_done():
    items = _items()
    m = ErrorModel(items, steps=2)
    chosen: set = set()
    added = greedy(m, items, chosen, lambda c: m.raw(c) <= 9.0)
    # layer 0 removes 25/5.5 of error for 20 FLOPs (step 0: 24/5.5 for 20): the best ratio
    assert [i.label for i in added][0] == "attention layer 0"
    assert m.raw(chosen) <= 9.0
    assert ("linears_block", 1) not in chosen or m.raw(chosen - {("linears_block", 1)}) > 9.0
    # a target that needs everything native: greedy stops when nothing has a gain left
    chosen = set()
    greedy(m, items, chosen, lambda c: False)
    assert m.raw(chosen) == 0.0
    assert psnr_db(0.0, 2.0) == math.inf and psnr_db(0.04, 2.0) == pytest.approx(20.0)


def test_block_pattern_matches_exactly_one_block():
    p = block_pattern("transformer_blocks", 1)
    assert matches(p, "transformer_blocks.1.attn.to_q")
    assert not matches(p, "transformer_blocks.11.attn.to_q")
    assert not matches(p, "single_transformer_blocks.1.proj_mlp")
    assert not matches(p, "transformer_blocks.10")
    FP8Config.from_kwargs(ignored_layers=["@defaults", p])  # a valid ignored_layers pattern


def _sensitivity(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    r = subprocess.run(
        [sys.executable, "-m", "fx_fp8", "sensitivity", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads((tmp_path / "sensitivity.json").read_text())


def _check_result(r, res, tmp_path, target):
    items = res["items"]
    # one progress line per measurement, with the elapsed time, on stderr
    progress = [l for l in r.stderr.splitlines() if re.match(r"\[\s*\d+\.\ds\] #\d+", l)]
    assert len(progress) == 2 + len(items) + (len(res["history"]) - 1)
    assert float(res["measured_psnr"]) >= target
    # the final check ran the YAML through compile_pipeline: same numbers as the in-process swap
    swap, official = res["history"][-2], res["history"][-1]
    assert "compile_pipeline" in official["label"]
    assert float(official["psnr"]) == pytest.approx(float(swap["psnr"]), abs=0.1)
    assert f"re-measured PSNR:   {float(res['measured_psnr']):.2f} dB (meets" in r.stdout
    assert "predicted PSNR:" in r.stdout
    # strictly more FP8 than "skip everything": some item stays FP8, some FLOPs stay FP8
    assert len(res["native_items"]) < len(items)
    assert 0.0 < res["fp8_work_fraction"] <= 1.0
    # the YAML is a loadable config matching the recommendation
    cfg = FP8Config.from_yaml(tmp_path / "recommended.yaml")
    assert cfg.to_dict() == res["recommended"]
    native = set(res["native_items"])
    assert cfg.diffusion_kv_cache_skip_steps == {int(l.split()[-1]) for l in native if l.startswith("attention step")}
    assert cfg.diffusion_kv_cache_skip_layers == {int(l.split()[-1]) for l in native if l.startswith("attention layer")}
    blocks = [l for l in native if l.startswith("linears block")]
    ignored = cfg.quantization_config.ignored_layers or ()
    assert len([p for p in ignored if p.startswith("re:") and p.endswith("\\..*")]) == len(blocks)
    assert (tmp_path / "sensitivity.png").stat().st_size > 5000
    return cfg


@pytest.mark.slow
def test_sensitivity_tiny_model_meets_target(tmp_path):
    # 16x16, 4 steps: all-FP8 is about 36 dB here, so a 45 dB target makes the search work; from the
    # library default (the model's own config keeps attention native on every one of 4 steps)
    r, res = _sensitivity(
        tmp_path,
        "--library-default",
        "--steps",
        "4",
        "--prompts",
        "2",
        "--height",
        "16",
        "--width",
        "16",
        "--target-psnr",
        "45",
    )
    assert float(res["all_fp8"]["psnr"]) < 45 and res["native_items"]
    kinds = {i["kind"] for i in res["items"]}
    assert kinds == {"attention_layer", "attention_step", "linears_block"}
    assert len([i for i in res["items"] if i["kind"] == "attention_step"]) == 4
    assert len([i for i in res["items"] if i["kind"] == "attention_layer"]) == 4  # 2 double + 2 single blocks
    _check_result(r, res, tmp_path, 45.0)


@pytest.mark.slow
def test_sensitivity_tiny_wan_meets_target(tmp_path):
    # random-weight Wan2.1 with classifier-free guidance (two transformer calls per step);
    # all-FP8 is about 57 dB, so ask for 65 dB
    r, res = _sensitivity(
        tmp_path,
        "--model",
        "wan",
        "--steps",
        "4",
        "--prompts",
        "1",
        "--height",
        "16",
        "--width",
        "16",
        "--target-psnr",
        "65",
    )
    assert float(res["all_fp8"]["psnr"]) < 65 and res["native_items"]
    _check_result(r, res, tmp_path, 65.0)


# -- step policy ------------------------------------------------------------------------------
def test_step_policy_candidates_and_their_fp8_flops():
    from fx_fp8.tools.sensitivity_steps import edge_steps, step_policy_candidates

    assert edge_steps(1, 4) == [0, 3] and edge_steps(2, 10) == [0, 1, 8, 9]
    # attention 1 FLOP / step, linears 3 FLOPs / step; 4 steps: k = 2 would leave no FP8 step
    cands = {c.label: c for c in step_policy_candidates(FP8Config(), 4, (1, 2), 1.0, 3.0)}
    assert set(cands) == {
        "attention native on steps 0,3",
        "linears weight-only on steps 0,3",
        "linears native on steps 0,3",
        "attention native + linears weight-only on steps 0,3",
        "attention native + linears native on steps 0,3",
    }
    assert cands["attention native on steps 0,3"].fp8_work_fraction == pytest.approx((1 * 2 + 3 * 4) / 16)
    assert cands["linears native on steps 0,3"].fp8_work_fraction == pytest.approx((1 * 4 + 3 * 2) / 16)
    both = cands["attention native + linears weight-only on steps 0,3"]
    assert both.fp8_work_fraction == pytest.approx(0.5)
    assert both.overrides() == {
        "diffusion_kv_cache_skip_steps": [0, 3],
        "quantization_skip_steps": "0,3",
        "quantization_skip_steps_mode": "weight_only",
    }
    cfg = FP8Config().replace(**both.overrides())
    qc = cfg.quantization_config
    assert list(qc.skip_steps) == [0, 3] and qc.skip_steps_mode == "weight_only"
    # only the features the base has on: attention-only base -> one policy per k
    att_only = step_policy_candidates(FP8Config.from_kwargs(diffusion_kv_cache_dtype="fp8"), 10, (1, 2), 1.0, 0.0)
    assert [c.label for c in att_only] == ["attention native on steps 0,9", "attention native on steps 0-1,8-9"]


def test_choose_step_policy_keeps_the_most_fp8_that_meets_the_target():
    from fx_fp8.tools.sensitivity_steps import StepPolicy, choose_step_policy

    a = StepPolicy("a", [0], [], "", 0.9, psnr=29.0)
    b = StepPolicy("b", [], [0], "native", 0.7, psnr=31.0)
    c = StepPolicy("c", [0], [0], "native", 0.6, psnr=35.0)
    d = StepPolicy("d", [], [0], "weight_only", 0.7, psnr=32.0)
    assert choose_step_policy([a, b, c, d], 30.0) is d  # most FLOPs among those that meet; tie -> higher PSNR
    assert choose_step_policy([a, b, c], 33.0) is c
    assert choose_step_policy([a, b], 40.0) is None  # none meets: no policy (the layer search decides)


def test_error_model_work_without_the_steps_a_policy_skips():
    m = ErrorModel(_items(), steps=2, attention_steps_off=[1], linear_steps_off=[0])
    assert m.full_work() == pytest.approx(2 * 10 * 2 + 2 * 100 * 2)
    assert m.work(set()) == pytest.approx(2 * 10 * 1 + 2 * 100 * 1)


def test_step_edges_and_a_base_policy_are_refused():
    from fx_fp8.tools.sensitivity import run_sensitivity
    from fx_fp8.tools.sensitivity_steps import check_step_edges as _check_step_edges

    with pytest.raises(ValueError, match="k must be < 2"):
        _check_step_edges((2, 3), 4)
    with pytest.raises(ValueError, match="got 0"):
        _check_step_edges((0,), 4)
    assert _check_step_edges((3, 1, 1), 8) == [1, 3]
    with pytest.raises(ValueError, match="diffusion_kv_cache_skip_steps: '0-1'"):
        base = FP8Config.from_kwargs(diffusion_kv_cache_dtype="fp8", diffusion_kv_cache_skip_steps="0,1")
        run_sensitivity(None, base, steps=4, step_policy=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step-policy", "2"], "k must be < 2"),
        (["--step-policy", "1,x"], "expected k values like '1,2'"),
        (["--step-policy", "--diffusion-kv-cache-skip-steps", "0"], "drop --diffusion-kv-cache-skip-steps '0'"),
    ],
)
def test_cli_step_policy_errors_are_one_line(args, message, capsys, tmp_path):
    from fx_fp8.tools.cli import main

    assert main(["sensitivity", "--steps", "4", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_step_policy_is_written_and_meets_the_target_when_rerun(tmp_path):
    """The search proposes a step policy on the tiny model, writes it into the YAML, and the YAML
    run through compile_pipeline from scratch reaches the target."""
    import torch

    from fx_fp8 import compile_pipeline, restore_pipeline
    from fx_fp8.tools.model_source import resolve_model
    from fx_fp8.tools.sensitivity import run_sensitivity

    run = resolve_model("tiny").load_pipeline(prompts=2, height=16, width=16, seed=0)
    yaml_path = tmp_path / "recommended.yaml"
    lines = []
    # 4 steps at 16x16: all FP8 is about 37.5 dB, k = 1 policies 35.6-44.7 dB
    res = run_sensitivity(
        run,
        None,
        steps=4,
        target_psnr=38.5,
        yaml_path=yaml_path,
        verify=False,
        step_policy=True,
        step_edges=(1, 2),
        log=lines.append,
    )
    assert res.all_fp8.psnr < 38.5
    meeting = [c for c in res.step_candidates if c.psnr >= 38.5]
    assert len(res.step_candidates) == 5 and meeting
    assert res.step_policy is max(meeting, key=lambda c: (c.fp8_work_fraction, c.psnr))
    assert any(l.endswith(")") and "step policy chosen: " + res.step_policy.label in l for l in lines)
    cfg = FP8Config.from_yaml(yaml_path)
    assert list(cfg.diffusion_kv_cache_skip_steps) == res.step_policy.attention_steps
    assert list(cfg.quantization_config.skip_steps) == res.step_policy.linear_steps
    if res.step_policy.linear_steps:
        assert cfg.quantization_config.skip_steps_mode == res.step_policy.linear_mode
    assert 0.0 < res.fp8_work_fraction <= res.step_policy.fp8_work_fraction
    # re-run the written YAML as a user would: native, then compile_pipeline, same seeds
    torch._dynamo.reset()
    native, _ = run.run(4)
    compile_pipeline(run.pipe, str(yaml_path), prepare=False)
    try:
        fp8, _ = run.run(4, publish=False)
    finally:
        restore_pipeline(run.pipe)
    peak = float(native.max() - native.min())
    assert psnr_db(float(((fp8 - native) ** 2).mean()), peak) >= 38.5
