"""compile_pipeline with diffusers' cache hooks (FirstBlockCache, TaylorSeer, MagCache).

diffusers' cache hooks decide in Python, on tensor values, whether a block (or an attention
module, for TaylorSeer) runs; MagCache marks whole blocks torch.compiler.disable. compile_pipeline
runs each hook's decision eagerly and compiles what the hook wraps with the FP8 backend, one
region per module (fx_fp8/pipeline/cache_hooks.py). The end-to-end tests check, on real tiny pipelines, what
a user of `cache_backend=` cares about:

* blocks are still skipped: each block's attention runs are counted (a tensor counter in a
  forward pre-hook on its `to_q`, so runs inside compiled graphs count too) and compared with
  the cache-only native run of the same pipeline;
* a second run compiles nothing (torch._dynamo counters);
* diffusion_kv_cache_skip_layers and the sensitive-layer defaults hold (report rows);
* the latents stay close to the cache-only native run (the cache's own error is not FP8's).

The fast tests check the mapping of vLLM-Omni / diffusers names and settings onto diffusers'
configs and the errors for what diffusers lacks or rejects.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

import fx_fp8
from fx_fp8 import pipeline_state, restore_pipeline
from fx_fp8.pipeline.cache_hooks import cache_hooks, enable_cache
from fx_fp8.pipeline.options import PipelineOptions, canonical_cache_backend, diffusers_cache_config
from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

from cache_runs import STEPS, block_counters, run_steps
from checks import check_layer_one_native, rel_err
from example_scripts import load_example

#: settings that skip some (not all) block runs of the tiny pipelines in 8 steps
CACHES = {
    "first_block_cache": {"threshold": 0.4},
    "taylorseer": {"cache_interval": 2, "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"},
    "mag_cache": {
        "mag_threshold": 0.5,
        "mag_max_skip_steps": 3,
        "mag_ratios": [1.0] * STEPS,
        "num_inference_steps": STEPS,
    },
}
#: linears the family defaults keep native (when they run inside a compiled graph, their rows say so)
SENSITIVE = {
    "flux": (
        "time_text_embed.timestep_embedder.linear_1",
        "norm_out.linear",
        "proj_out",
        "x_embedder",
        "context_embedder",
        "transformer_blocks.0.norm1.linear",
    ),
    "wan2.1": ("condition_embedder.time_embedder.linear_1", "proj_out"),
}
SELF_ATTENTION = {
    "flux": (
        "transformer_blocks.0.attn",
        "transformer_blocks.1.attn",
        "single_transformer_blocks.0.attn",
        "single_transformer_blocks.1.attn",
    ),
    "wan2.1": ("blocks.0.attn1", "blocks.1.attn1"),
}


# -- helpers ---------------------------------------------------------------------------------------
def _pipeline(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_pipeline(name)


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "name,backend",
    [("flux", "first_block_cache"), ("flux", "taylorseer"), ("flux", "mag_cache"), ("wan2.1", "first_block_cache")],
)
def test_compile_pipeline_with_cache(name, backend):
    from torch._dynamo.utils import counters

    cache_config = CACHES[backend]
    # cache-only native: the same pipeline, the same cache, no FP8
    pipe, kwargs = _pipeline(name)
    enable_cache(pipe.transformer, backend, cache_config)
    native, native_calls = run_steps(pipe, kwargs, block_counters(pipe.transformer))

    pipe, kwargs = _pipeline(name)
    fx_fp8.compile_pipeline(
        pipe,
        {"diffusion_kv_cache_skip_layers": "1", "lowering": "reference"},
        cache_backend=backend,
        cache_config=cache_config,
    )
    original = pipeline_state(pipe).originals["transformer"]
    mods = block_counters(pipe.transformer)
    out, calls = run_steps(pipe, kwargs, mods)
    counters.clear()
    again, calls_again = run_steps(pipe, kwargs, mods)
    print(
        f"\n{name} {backend}: block runs native {native_calls}, fp8 {calls}; latents rel error vs cache-only "
        f"native {rel_err(out, native):.2e}"
    )

    # blocks are still skipped, as often as without FP8 (TaylorSeer and MagCache decide on the step
    # count alone; FirstBlockCache on residuals, which FP8 moves a little)
    full = STEPS * (2 if name.startswith("wan") else 1)  # Wan: cond and uncond calls per step
    assert max(calls) <= full and min(calls) < full
    if backend == "first_block_cache":
        assert calls[0] == full  # the first block always runs
    if backend != "first_block_cache":
        assert calls == native_calls
    else:
        assert sum(calls) <= sum(native_calls) + 2 and sum(calls) >= sum(native_calls) - 2
    # a second run compiles nothing and computes the same
    assert dict(counters["frames"]) == {} and counters["stats"]["unique_graphs"] == 0
    assert calls_again == calls and torch.equal(again, out)
    # each hooked module is its own compiled region
    regions = pipeline_state(pipe).extras["transformer"].regions.modules
    assert regions  # not vacuous: all() of nothing is True
    assert regions and all(m.startswith(("transformer_blocks", "single_transformer_blocks", "blocks")) for m in regions)
    # the layer selector and the defaults hold
    rows = check_layer_one_native(pipe.transformer, SELF_ATTENTION[name])
    prepared = pipeline_state(pipe).prepared["transformer"]
    for layer in SENSITIVE[name]:  # weight-only by default (native where too small to quantize)
        action = "weight-only" if layer in prepared["weight_only"] else "native"
        assert layer in prepared["weight_only"] or "small layer" in prepared["native"][layer], layer
        layer_rows = [e for e in rows if e.op == "linear" and e.module == layer]
        # a layer inside a compiled region has its row (Wan's embedder and proj_out run outside the
        # regions under FirstBlockCache: no row to check there, the prepared state above covers them)
        assert layer_rows or not any(layer.startswith(r + ".") for r in regions), layer
        assert all(e.action == action for e in layer_rows)
    assert set(SENSITIVE[name]) & set(prepared["weight_only"])
    # FP8's error on top of the cache is FP8's usual error
    assert rel_err(out, native) < 0.02

    restore_pipeline(pipe, linears="quantized")
    assert original._cache_config is None and not cache_hooks(original)
    assert "_fx_fp8_default_context" not in vars(original)


@pytest.mark.slow
def test_cache_enabled_by_the_user_before_or_after_compile_pipeline():
    """A cache the user enables on the transformer, before compile_pipeline or after it (through the
    compiled module), is compiled the same way (at the next run); restore_pipeline leaves it on."""
    from diffusers import TaylorSeerCacheConfig

    pipe, kwargs = _pipeline("flux")
    pipe.transformer.enable_cache(
        TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32)
    )
    fx_fp8.compile_pipeline(pipe, {"lowering": "reference"})
    assert len(pipeline_state(pipe).extras["transformer"].regions.modules) == 4  # at compile time
    _, calls = run_steps(pipe, kwargs, block_counters(pipe.transformer))
    assert calls == [5, 5, 5, 5]
    original = pipeline_state(pipe).originals["transformer"]
    restore_pipeline(pipe, linears="quantized")
    assert original._cache_config is not None and cache_hooks(original)
    assert all(not getattr(h, "_fx_fp8_region", False) for _, _, h in cache_hooks(original))

    pipe, kwargs = _pipeline("flux")
    fx_fp8.compile_pipeline(pipe, {"lowering": "reference"})
    pipe.transformer.enable_cache(diffusers_cache_config("first_block_cache", {"threshold": 0.4}))
    _, calls = run_steps(pipe, kwargs, block_counters(pipe.transformer))
    assert len(pipeline_state(pipe).extras["transformer"].regions.modules) == 4  # at the run
    assert calls[0] == STEPS and min(calls) < STEPS
    attn = [e for r in fx_fp8.get_reports(pipe.transformer) for e in r.entries if e.op == "attention"]
    assert {e.module for e in attn if e.action == "fp8"} == set(SELF_ATTENTION["flux"])


# -- mapping and errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,expected",
    [
        ("first_block_cache", "first_block_cache"),
        ("FBC", "first_block_cache"),
        ("taylorseer", "taylorseer"),
        ("taylor-seer", "taylorseer"),
        ("mag_cache", "mag_cache"),
        ("MagCache", "mag_cache"),
        ("none", None),
        (None, None),
        ("", None),
    ],
)
def test_cache_backend_names(name, expected):
    assert canonical_cache_backend(name) == expected


@pytest.mark.parametrize(
    "name,words",
    [
        ("tea_cache", "cache_backend 'tea_cache' is not supported: diffusers has no TeaCache hook"),
        ("step_cache", "'step_cache' is not supported"),
        ("sea_cache", "'sea_cache' is not supported"),
        ("mag", "unknown cache_backend 'mag'"),
        (3, "invalid cache_backend 3"),
    ],
)
def test_unsupported_cache_backends_are_named(name, words):
    with pytest.raises(ValueError, match=words):
        PipelineOptions(cache_backend=name)


def test_cache_configs_map_onto_diffusers():
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    cfg = diffusers_cache_config("first_block_cache", {"residual_diff_threshold": 0.12})
    assert isinstance(cfg, FirstBlockCacheConfig) and cfg.threshold == 0.12  # cache-dit's spelling
    assert diffusers_cache_config("first_block_cache", None).threshold == FirstBlockCacheConfig().threshold
    cfg = diffusers_cache_config(
        "taylorseer", '{"cache_interval": 3, "taylorseer_order": 2, "taylor_factors_dtype": "float32"}'
    )
    assert isinstance(cfg, TaylorSeerCacheConfig)
    assert (cfg.cache_interval, cfg.max_order, cfg.taylor_factors_dtype) == (3, 2, torch.float32)
    cfg = diffusers_cache_config(
        "mag_cache",
        {
            "mag_threshold": 0.1,
            "mag_max_skip_steps": 2,
            "mag_retention_ratio": 0.3,
            "mag_ratios": "flux",
            "num_inference_steps": 10,
        },
    )
    assert isinstance(cfg, MagCacheConfig) and (cfg.threshold, cfg.max_skip_steps, cfg.retention_ratio) == (0.1, 2, 0.3)
    assert len(cfg.mag_ratios) == 10  # diffusers interpolated FLUX_MAG_RATIOS to the step count
    assert diffusers_cache_config(None, None) is None


@pytest.mark.parametrize(
    "backend,config,words",
    [
        (
            "first_block_cache",
            {"thresh": 0.1},
            "unknown cache_config key 'thresh' for cache_backend 'first_block_cache' \\(did you mean 'threshold'\\?\\)",
        ),
        (
            "first_block_cache",
            {"threshold": -1},
            "invalid cache_config.threshold for cache_backend 'first_block_cache': -1",
        ),
        ("first_block_cache", {"threshold": 0.1, "residual_diff_threshold": 0.2}, "sets 'threshold' twice"),
        ("taylorseer", {"cache_interval": 0}, "invalid cache_config.cache_interval .*: 0"),
        ("taylorseer", {"taylor_factors_dtype": "int8"}, "taylor_factors_dtype .*'int8'"),
        ("taylorseer", {"cache_identifiers": "attn"}, "cache_identifiers .*'attn'"),
        ("mag_cache", {"num_inference_steps": 8}, "needs cache_config.mag_ratios"),
        ("mag_cache", {"mag_ratios": "flux"}, "needs cache_config.num_inference_steps"),
        ("mag_cache", {"mag_ratios": [1, "x"], "num_inference_steps": 2}, "mag_ratios .*\\[1, 'x'\\]"),
        (
            "mag_cache",
            {"mag_retention_ratio": 2, "mag_calibrate": True, "num_inference_steps": 2},
            "retention_ratio .*: 2",
        ),
        (None, {"threshold": 0.1}, "given without a cache_backend"),
        ("first_block_cache", "{threshold: 1}", "invalid cache_config .*not JSON"),
        ("first_block_cache", [1], "expected a mapping"),
    ],
)
def test_cache_config_errors_name_the_value(backend, config, words):
    with pytest.raises(ValueError, match=words):
        PipelineOptions(cache_backend=backend, cache_config=config)


def test_compile_pipeline_refuses_before_changing_anything():
    """fullgraph with a cache and two caches: refused with the reason, the pipeline untouched (a
    hooked linear is not refused: prepare_model leaves it unreplaced, test_context_parallel.py)."""
    from diffusers import TaylorSeerCacheConfig

    pipe, _ = _pipeline("flux")
    transformer = pipe.transformer
    with pytest.raises(ValueError, match="fullgraph=True cannot be combined with a cache backend"):
        fx_fp8.compile_pipeline(pipe, cache_backend="first_block_cache", compile_kwargs={"fullgraph": True})
    assert pipe.transformer is transformer and transformer._cache_config is None
    with pytest.raises(ValueError, match="unknown cache_config key 'treshold'"):
        fx_fp8.compile_pipeline(pipe, cache_backend="first_block_cache", cache_config={"treshold": 0.1})
    transformer.enable_cache(TaylorSeerCacheConfig(use_lite_mode=True))
    with pytest.raises(ValueError, match="already has a cache enabled .* and cache_backend 'mag_cache'"):
        fx_fp8.compile_pipeline(
            pipe, cache_backend="mag_cache", cache_config={"mag_calibrate": True, "num_inference_steps": 4}
        )
    assert pipe.transformer is transformer and type(transformer.proj_out) is torch.nn.Linear
    assert getattr(pipe, "_fx_fp8", None) is None


def test_pipeline_options_json_round_trip():
    opts = PipelineOptions(
        parallel={"ulysses_degree": 2}, cache_backend="taylorseer", cache_config={"cache_interval": 3}
    )
    again = PipelineOptions.from_mapping(json.loads(json.dumps(opts.to_dict())))
    assert again == opts


def test_a_cache_that_hooks_nothing_is_an_error():
    """TaylorSeer's default patterns (`^blocks.*attn`) miss Wan's attn1 / attn2: an error that says
    how to name them, and the model is left without a cache."""
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("wan")
    with pytest.raises(ValueError, match="hooked no module of WanTransformer3DModel.*cache_identifiers"):
        enable_cache(model, "taylorseer", {})
    assert model._cache_config is None
    assert enable_cache(model, "taylorseer", {"cache_identifiers": [r"^blocks\.\d+\.attn1$"]}) is not None
    assert [m for m, _, _ in cache_hooks(model)] == ["blocks.0.attn1", "blocks.1.attn1"]


@pytest.mark.parametrize(
    "flags,words",
    [
        (
            ["--cache-backend", "tea_cache"],
            "cache_backend 'tea_cache' is not supported: diffusers has no TeaCache hook",
        ),
        (["--cache-backend", "first_block_cache", "--cache-config", "{threshold: 1}"], "invalid --cache-config"),
        (["--cache-backend", "taylorseer", "--cache-config", '{"interval": 2}'], "unknown cache_config key 'interval'"),
        (["--cache-config", '{"threshold": 0.1}'], "given without a cache_backend"),
        (["--ulysses-degree", "2"], "needs 2 processes.*torchrun --nproc-per-node 2"),
    ],
)
def test_examples_refuse_bad_pipeline_flags_before_loading(flags, words, monkeypatch, capsys):
    """vLLM-Omni's flags on the examples: what diffusers lacks or rejects is one line naming the
    value (exit status 2, as fx-fp8), before any model is loaded."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, loader in (("text_to_image", "load_pipeline"), ("text_to_video", "load")):
        example = load_example(name)
        monkeypatch.setattr(example, loader, lambda *a, **k: pytest.fail("loaded a model before checking the flags"))
        assert example.main(flags) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert re.search(words, line) and line.startswith(f"{name}.py: error: "), line
