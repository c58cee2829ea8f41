"""One step policy for attention and linears (quantization_config.skip_steps next to
diffusion_kv_cache_skip_steps), weight-only (W8A16) linears, and the choice of how the sensitive
layers run (quantization_config.sensitive)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.checkpoint import QUANT_NAME
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.selectors import Selector
from fx_fp8.config.step_variants import attention_skipped, linear_skip_mode, variant_name
from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.quant.quantized_linear import QuantizedLinear


def flux(dtype=torch.float32, layers=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_transformer("flux", layers=layers, seed=0, dtype=dtype)


def run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- 1. the linear step selector ----------------------------------------------------------------
def test_linear_skip_steps_key_grammar_and_errors():
    cfg = FP8Config.from_kwargs(quantization_config={"skip_steps": "0-2,47-49"})
    assert cfg.quantization_config.skip_steps == Selector([(0, 2), (47, 49)])
    assert cfg.quantization_config.skip_steps_mode == "weight_only"
    assert cfg.to_dict()["quantization_config"]["skip_steps"] == "0-2,47-49"
    assert FP8Config.from_kwargs(**cfg.to_dict()) == cfg  # round trip
    for bad in ("a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match=r"quantization_config\.skip_steps") as e:
            FP8Config.from_kwargs(quantization_config={"skip_steps": bad})
        assert repr(bad) in str(e.value) or bad in str(e.value)
    with pytest.raises(ValueError, match=r"quantization_config\.skip_steps_mode 'int4'"):
        FP8Config.from_kwargs(quantization_config={"skip_steps_mode": "int4"})
    with pytest.raises(ValueError, match="quantization_skip_steps"):
        FP8Config.from_kwargs(quantization_skip_steps="x")


def test_flat_keyword_is_no_opt_in_and_agrees_with_the_nested_key():
    # like diffusion_kv_cache_skip_steps, the flat key selects steps: both features stay on
    cfg = FP8Config.from_kwargs(quantization_skip_steps="0,1", quantization_skip_steps_mode="native")
    assert cfg.attention_enabled and cfg.linear_enabled and cfg.linear_step_skips
    assert cfg.quantization_config.skip_steps == Selector.of([0, 1])
    assert cfg.quantization_config.skip_steps_mode == "native"
    with pytest.raises(ValueError, match="disagrees with quantization_config.skip_steps"):
        FP8Config.from_kwargs(quantization_skip_steps="0", quantization_config={"skip_steps": "1"})
    # on a loaded config (compile_pipeline(pipe, "x.yaml", quantization_skip_steps=...)) it overrides
    base = FP8Config.from_kwargs(quantization_config={"skip_steps": "5"})
    assert base.replace(quantization_skip_steps="0-1").quantization_config.skip_steps == Selector([(0, 1)])
    with pytest.warns(UserWarning, match="quantization_config.skip_steps set but quantized linears are off"):
        FP8Config.from_kwargs(quantization=None, quantization_config={"skip_steps": "0"})


def test_yaml_and_cli_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "quantization_config:\n  skip_steps: 0-1,28-29\n  skip_steps_mode: weight_only\n"
        "  sensitive: fp8\ndiffusion_kv_cache_skip_steps: 0-1\n"
    )
    cfg = FP8Config.from_yaml(path)
    assert cfg.quantization_config.skip_steps == Selector([(0, 1), (28, 29)])
    assert cfg.quantization_config.sensitive == "fp8" and cfg.quantization_config.quantize_sensitive
    import argparse

    parser = add_fp8_flags(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--quantization-skip-steps", "0,29", "--quantization-skip-steps-mode", "native", "--sensitive", "native"]
    )
    cfg = config_from_args(args)
    assert cfg.quantization_config.skip_steps == Selector.of([0, 29])
    assert cfg.quantization_config.skip_steps_mode == "native" and cfg.quantization_config.sensitive == "native"
    with pytest.raises(ValueError, match="--quantize-sensitive"):
        config_from_args(parser.parse_args(["--quantize-sensitive", "--sensitive", "native"]))


def test_sensitive_choice_and_its_synonym():
    from fx_fp8.config.quantization import QuantizationConfig

    assert QuantizationConfig().sensitive == fx_fp8.config.quantization.DEFAULT_SENSITIVE
    # quantize_sensitive is read as sensitive where a config comes in; the dataclass holds sensitive alone
    assert (
        FP8Config.from_kwargs(quantization_config={"quantize_sensitive": True}).quantization_config.sensitive == "fp8"
    )
    assert FP8Config(quantization_config={"quantize_sensitive": True}).quantization_config.sensitive == "fp8"
    assert QuantizationConfig(sensitive="FP8").quantize_sensitive is True
    assert QuantizationConfig(sensitive="native").quantize_sensitive is False
    for build in (FP8Config.from_kwargs, FP8Config().replace, FP8Config):
        with pytest.raises(
            ValueError, match="quantize_sensitive: true .* disagrees with quantization_config.sensitive 'native'"
        ):
            build(quantization_config={"quantize_sensitive": True, "sensitive": "native"})
    with pytest.raises(ValueError, match=r"quantization_config\.sensitive 'bf16'"):
        QuantizationConfig(sensitive="bf16")
    # an override replaces the base's setting, in either spelling
    base = FP8Config.from_kwargs(quantization_config={"sensitive": "weight_only"})
    assert base.replace(quantization_config={"quantize_sensitive": True}).quantization_config.sensitive == "fp8"
    assert (
        FP8Config.from_kwargs(quantization_config={"quantize_sensitive": True})
        .replace(quantization_config={"sensitive": "native"})
        .quantization_config.sensitive
        == "native"
    )


# -- 2. one policy, few graphs ------------------------------------------------------------------
def test_step_variants_are_a_closed_set_from_the_selectors():
    assert variant_name(False, False) == "fp8" and variant_name(True, False) == "native"
    assert variant_name(False, True) == "linear_weight_only"
    assert variant_name(True, True, "native") == "native+linear_native"
    assert attention_skipped("native+linear_native") and not attention_skipped("linear_native")
    assert linear_skip_mode("native+linear_weight_only") == "weight_only" and linear_skip_mode("native") is None

    def variants(**kw):
        return FP8Config.from_kwargs(**kw).step_variants()

    assert variants() == (None,)
    assert variants(diffusion_kv_cache_skip_steps="0,1") == ("fp8", "native")
    assert variants(quantization_skip_steps="0,1") == ("fp8", "linear_weight_only")
    # the same steps for both: no step runs only one of them
    assert variants(diffusion_kv_cache_skip_steps="0-1", quantization_skip_steps="0-1") == (
        "fp8",
        "native+linear_weight_only",
    )
    assert set(variants(diffusion_kv_cache_skip_steps="0-1", quantization_skip_steps="0-1,28-29")) == {
        "fp8",
        "native+linear_weight_only",
        "linear_weight_only",
    }
    assert set(variants(diffusion_kv_cache_skip_steps="0-3", quantization_skip_steps="2-5")) == {
        "fp8",
        "native",
        "native+linear_weight_only",
        "linear_weight_only",
    }
    # a gap of the linear selector inside an attention range is found without expanding the ranges
    assert set(variants(diffusion_kv_cache_skip_steps="0-1000000000", quantization_skip_steps="0-5,7-1000000000")) == {
        "fp8",
        "native",
        "native+linear_weight_only",
    }
    # a feature that is off selects nothing
    assert variants(
        diffusion_kv_cache_dtype=None,
        quantization="fp8",
        diffusion_kv_cache_skip_steps="0",
        quantization_skip_steps="3",
    ) == ("fp8", "linear_weight_only")


def test_each_step_runs_its_variant_and_only_used_variants_are_compiled(downstream_compiles):
    compiles = downstream_compiles
    torch._dynamo.reset()
    model = flux()
    kw = example_inputs("flux", model)
    ref = run(model, kw)
    # attention 0-3, linears 2-5: four variants possible; steps 0, 6, 7 use two of them
    compiled = torch.compile(
        model, backend="fp8", options={"diffusion_kv_cache_skip_steps": "0-3", "quantization_skip_steps": "2-5"}
    )
    outs = {}
    for step in (0, 6, 7, 0):
        with fx_fp8.denoising_step(step):
            outs[step] = run(compiled, kw)
    reports = {r.step_variant: r for r in fx_fp8.get_reports(compiled)}
    assert set(reports) == {"fp8", "native", "native+linear_weight_only", "linear_weight_only"}  # every report
    assert len(compiles) == 2  # but only "native" and "fp8" were compiled
    for step in (2, 4):
        with fx_fp8.denoising_step(step):
            outs[step] = run(compiled, kw)
    assert len(compiles) == 4
    r = reports["native+linear_weight_only"]
    assert r.count("attention", "fp8") == 0 and r.count("linear", "fp8") == 0
    assert r.count("linear", "weight-only") == reports["fp8"].count("linear", "fp8") + reports["fp8"].count(
        "linear", "weight-only"
    )
    assert all(
        "skip_steps" in e.reason
        for e in r.entries
        if e.op == "linear" and e.action == "weight-only" and "sensitive" not in e.reason
    )
    lw = reports["linear_weight_only"]
    assert lw.count("attention", "fp8") == reports["fp8"].count("attention", "fp8") > 0
    # weight-only steps are closer to native than W8A8 ones
    assert rel_err(outs[4], ref) < rel_err(outs[6], ref) < 0.05
    assert not torch.equal(outs[2], outs[4])  # attention native on 2, FP8 on 4


def test_native_mode_keeps_linears_native_and_prepared_layers_say_why():
    torch._dynamo.reset()
    model = flux()
    kw = example_inputs("flux", model)
    compiled = torch.compile(
        model,
        backend="fp8",
        options={
            "diffusion_kv_cache_dtype": None,
            "quantization": "fp8",
            "quantization_config": {"skip_steps": "0", "skip_steps_mode": "native", "sensitive": "native"},
        },
    )
    with fx_fp8.denoising_step(0):
        out = run(compiled, kw)
    assert torch.allclose(out, run(model, kw), atol=1e-5)  # nothing quantized runs on step 0
    (native,) = [r for r in fx_fp8.get_reports(compiled) if r.step_variant == "linear_native"]
    assert native.count("linear", "quantized") == 0

    torch._dynamo.reset()
    model = flux()
    fx_fp8.prepare_model(model, quantization="fp8")
    compiled = torch.compile(
        model,
        backend="fp8",
        options={"quantization": "fp8", "quantization_config": {"skip_steps": "0", "skip_steps_mode": "native"}},
    )
    with pytest.warns(UserWarning, match="they run weight-only on the skipped steps"), fx_fp8.denoising_step(0):
        run(compiled, kw)
    (r,) = [r for r in fx_fp8.get_reports(compiled) if r.step_variant == "linear_native"]
    rows = [e for e in r.entries if e.op == "linear" and e.action != "native"]
    assert any(True for e in rows if 'sensitive' not in e.reason)  # not vacuous: all() of nothing is True
    assert rows and all(
        e.action == "weight-only" and "prepared, so weight-only" in e.reason
        for e in rows
        if "sensitive" not in e.reason
    )


def test_unpublished_step_warns_and_runs_the_skipped_variant():
    torch._dynamo.reset()
    model = flux()
    kw = example_inputs("flux", model)
    compiled = torch.compile(model, backend="fp8", options={"quantization_skip_steps": "3"})
    with pytest.warns(UserWarning, match="quantization_config.skip_steps set but no denoising step was published"):
        run(compiled, kw)
    seen = []
    with fx_fp8.steps.variant_listener(seen.append):
        run(compiled, kw)
    assert seen == ["linear_weight_only"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux", "wan2.2"])
def test_a_whole_run_recompiles_nothing_after_the_first_steps_of_each_variant(name):
    """CFG batch 2 (Wan), 30 steps, Wan2.2's two experts: every call of a step runs one variant,
    and Dynamo compiles nothing after the first steps of each variant."""
    from torch._dynamo.utils import counters

    from fx_fp8 import compile_pipeline, pipeline_state
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    steps = 30
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe, kwargs = build_tiny_pipeline(name)
    torch._dynamo.reset()
    counters.clear()
    compile_pipeline(pipe, diffusion_kv_cache_skip_steps="0-1", quantization_skip_steps="0-1,28-29")
    per_step = []

    def callback(p, i, t, tensors):
        per_step.append((counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())))
        return {}

    pipe(
        **dict(kwargs, num_inference_steps=steps, output_type="latent"),
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=callback,
    )
    variants = pipeline_state(pipe).step_variants()
    expected = ["native+linear_weight_only"] * 2 + ["fp8"] * 26 + ["linear_weight_only"] * 2
    assert [set(v) for v in variants] == [{e} for e in expected]
    calls = 2 if name == "wan2.2" else 1  # Wan's CFG calls the transformer twice per step
    assert all(len(v) == calls for v in variants)
    # after the first two steps of each variant run by each transformer (Wan2.2's second expert
    # takes over mid-run), Dynamo makes no graph and recompiles nothing
    first = {}
    for c in pipeline_state(pipe).calls:
        first.setdefault((c.transformer, c.variant), c.step)
    allowed = {s + d for s in first.values() for d in (0, 1)}
    changed = {i for i in range(1, steps) if per_step[i] != per_step[i - 1]}
    assert changed <= allowed, (first, per_step)
    assert len(first) <= 4 * (2 if name == "wan2.2" else 1)
    assert per_step[-1][1] == 0  # no recompile at all
    reports = [r.step_variant for rs in pipeline_state(pipe).reports().values() for r in rs]
    assert set(reports) == {"fp8", "native+linear_weight_only", "linear_weight_only"}


# -- 3. weight-only FP8 as a linear method -----------------------------------------------------
def test_sensitive_weight_only_prepares_w8a16_layers_at_half_the_bytes(tmp_path):
    model = flux(dtype=torch.bfloat16)
    kw = example_inputs("flux", model, dtype=torch.bfloat16)
    ref = run(model, kw)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    result = fx_fp8.prepare_model(
        model, example_inputs=kw, quantization="fp8", quantization_config={"sensitive": "weight_only"}
    )
    assert result["weight_only"], "the tiny Flux has adaLN modulation linears"
    for name in result["weight_only"]:
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear) and layer.weight_only
        # the weight-only storage: INT8, one fp32 scale per output channel and 32 input columns
        assert layer.weight.dtype == torch.int8
        assert layer.weight_scale.shape == (layer.out_features, -(-layer.in_features // 32))
        old = linears[name].weight
        assert layer.weight.numel() * layer.weight.element_size() * 2 == old.numel() * old.element_size()
    out = run(model, kw)
    assert rel_err(out, ref) < 0.05
    # the compiled form runs fx_fp8::weight_only_linear and says weight-only
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="fp8", options={"quantization": "fp8", "quantization_config": {"sensitive": "weight_only"}}
    )
    assert torch.allclose(run(compiled, kw).float(), out.float(), atol=2e-2, rtol=2e-2)
    (report,) = fx_fp8.get_reports(compiled)
    rows = {e.module: e for e in report.entries if e.op == "linear"}
    assert {n for n, e in rows.items() if e.action == "weight-only"} == set(result["weight_only"])
    assert all("prepared weight-only" in rows[n].reason for n in result["weight_only"])

    # checkpoints keep the method
    fx_fp8.save_quantized(model, tmp_path)
    record = json.loads((tmp_path / QUANT_NAME).read_text())
    assert {n for n, r in record["layers"].items() if r["weight_only"]} == set(result["weight_only"])
    loaded = fx_fp8.load_quantized(tmp_path)
    assert {n for n, m in loaded.named_modules() if isinstance(m, QuantizedLinear) and m.weight_only} == set(
        result["weight_only"]
    )
    assert torch.equal(run(loaded, kw), out)


def test_sensitive_modes_at_compile_time():
    torch._dynamo.reset()
    model = flux()
    kw = example_inputs("flux", model)
    ref = run(model, kw)
    errors, actions = {}, {}
    for mode in ("native", "weight_only", "fp8"):
        torch._dynamo.reset()
        compiled = torch.compile(
            model,
            backend="fp8",
            options={
                "diffusion_kv_cache_dtype": None,
                "quantization": "fp8",
                "quantization_config": {"sensitive": mode},
            },
        )
        errors[mode] = rel_err(run(compiled, kw), ref)
        (report,) = fx_fp8.get_reports(compiled)
        actions[mode] = {e.module: e.action for e in report.entries if e.op == "linear"}
    sensitive = {n for n, a in actions["weight_only"].items() if a == "weight-only"}
    assert sensitive and all(actions["native"][n] == "native" for n in sensitive)
    assert all(actions["fp8"][n] == "fp8" for n in sensitive)
    # unquantized activations: W8A16 on the sensitive layers costs less than W8A8 on them
    assert errors["native"] < errors["weight_only"] < errors["fp8"]


def test_npu_weight_only_runs_the_weight_quant_matmul_within_its_contract():
    from npu_sim import SimulatedContractError, installed

    from fx_fp8.ops import npu_calls, quant
    from fx_fp8.ops.lowering import get_lowering

    low = get_lowering("npu")
    assert low.weight_only_method("fp8") == "int8"  # the op's contract takes int8 (or int4) weights, no FP8
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(5, 64, generator=g).to(dtype)
        wq, ws = quant.quantize_weight(w, "channel", None, "int8")
        with installed("Ascend910B1") as sim:
            out = low.weight_only_linear(x, wq, ws, b, method="int8", weight_granularity="channel", weight_block=None)
            assert sim.calls["npu_weight_quant_batchmatmul"] == 1
            assert sim.last_kwargs["npu_weight_quant_batchmatmul"]["bias_dtype"] == (
                torch.float32 if dtype == torch.bfloat16 else torch.float16
            )
            ref = get_lowering("reference").weight_only_linear(
                x, wq, ws, b, method="int8", weight_granularity="channel", weight_block=None
            )
            assert out.dtype == dtype and rel_err(out, ref) < 1e-2
            # the simulator refuses what the contract does not take: FP8 weights, a wrong scale dtype
            kw = npu_calls.weight_quant_call_kwargs(x, wq, ws, b)
            with pytest.raises(SimulatedContractError, match="weight must be int8"):
                sim.npu_weight_quant_batchmatmul(**dict(kw, weight=kw["weight"].to(torch.float8_e4m3fn)))
            with pytest.raises(SimulatedContractError, match="antiquant_scale must be"):
                sim.npu_weight_quant_batchmatmul(**dict(kw, antiquant_scale=kw["antiquant_scale"].float()))


@pytest.mark.parametrize("group", [32, 64])
def test_npu_weight_only_groups_run_the_weight_quant_matmul_per_group(group):
    """Weight-only layers stored with per-group scales (quantization_config.weight_only_group_size)
    run npu_weight_quant_batchmatmul's per-group case (A2/A3: g a multiple of 32 below K, scales
    (ceil(K/g), N)), not a dequantize + matmul; a group outside the contract falls back, counted."""
    from npu_sim import SimulatedContractError, installed

    from fx_fp8.ops import npu_calls, quant
    from fx_fp8.ops.lowering import get_lowering

    low, ref = get_lowering("npu"), get_lowering("reference")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 160, generator=g), torch.randn(96, generator=g)
    x = torch.randn(3, 160, generator=g).to(torch.bfloat16)
    granularity, block = quant.weight_only_layout(group)
    wq, ws = quant.quantize_weight(w, granularity, block, "int8")
    args = dict(method="int8", weight_granularity=granularity, weight_block=block)
    with installed("Ascend910B1") as sim:
        out = low.weight_only_linear(x, wq, ws, b, **args)
        assert sim.calls["npu_weight_quant_batchmatmul"] == 1
        assert sim.last_kwargs["npu_weight_quant_batchmatmul"]["antiquant_group_size"] == group
        assert rel_err(out, ref.weight_only_linear(x, wq, ws, b, **args)) < 1e-2
        kw = npu_calls.weight_quant_call_kwargs(x, wq, ws, b, group)
        with pytest.raises(SimulatedContractError, match="per-group antiquant_scale must be"):
            sim.npu_weight_quant_batchmatmul(**dict(kw, antiquant_scale=ws.to(x.dtype)))  # (N, K/g): not K-major
        with pytest.raises(SimulatedContractError, match="antiquant_group_size=48"):
            sim.npu_weight_quant_batchmatmul(**dict(kw, antiquant_group_size=48))
        # a group size the op does not take (16) dequantizes instead
        wq16, ws16 = quant.quantize_weight(w, *quant.weight_only_layout(16), "int8")
        args16 = dict(args, weight_granularity="block", weight_block=(1, 16))
        out16 = low.weight_only_linear(x, wq16, ws16, b, **args16)
        assert sim.calls["npu_weight_quant_batchmatmul"] == 1
        assert rel_err(out16, ref.weight_only_linear(x, wq16, ws16, b, **args16)) < 1e-2
