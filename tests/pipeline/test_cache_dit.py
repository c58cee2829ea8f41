"""compile_pipeline with cache_backend 'cache_dit' (the cache-dit library: DBCache, TaylorSeer, SCM).

The end-to-end tests run the shipped tiny pipeline (a custom DiffusionPipeline class cache-dit does
not know: fx_fp8 enables cache-dit on the transformer with its registered Flux block adapter) and a
tiny Wan2.1 pipeline (classifier-free guidance: two transformer calls per step), each against the
cache-only native run with the same cache_config, and check what a cache-dit user cares about:

* cache-dit computes and caches as often as without FP8: block runs are counted (a tensor counter
  in a pre-hook on each block's query projection, so runs inside compiled graphs count too) and
  cache-dit's own counters (computed / cached transformer calls) are compared;
* FP8 is on inside cache-dit's wrapped blocks, with the model's real names and layer indices
  (diffusion_kv_cache_skip_layers and the sensitive-layer defaults hold);
* a second run compiles nothing and computes the same (cache-dit's context is reset per run);
* the latents stay as close to the cache-only run as FP8 without a cache is to native.

The fast tests check the mapping of vLLM-Omni's cache_config keys onto cache-dit's configs and the
errors. cache-dit is in the `test` extra: these tests need it and do not skip.
"""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch

import fx_fp8
from fx_fp8 import pipeline_state, restore_pipeline
from fx_fp8.pipeline import cache_dit as fcd
from fx_fp8.pipeline.apply_options import check_pipeline_options
from fx_fp8.pipeline.cache_hooks import enable_cache
from fx_fp8.pipeline.options import PipelineOptions, diffusers_cache_config

from cache_runs import STEPS, block_counters, run_steps  # the same runs as diffusers' caches' tests
from checks import check_layer_one_native, rel_err

#: settings that cache some (not all) transformer calls of the tiny pipelines in 8 steps
CACHE_CONFIG = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "max_warmup_steps": 2,
    "residual_diff_threshold": 0.6,
    "max_continuous_cached_steps": 3,
}
SELF_ATTENTION = {
    "tiny": (
        "transformer_blocks.0.attn",
        "transformer_blocks.1.attn",
        "single_transformer_blocks.0.attn",
        "single_transformer_blocks.1.attn",
    ),
    "wan2.1": ("blocks.0.attn1", "blocks.1.attn1"),
}
SENSITIVE = {
    "tiny": (
        "time_text_embed.timestep_embedder.linear_1",
        "norm_out.linear",
        "proj_out",
        "x_embedder",
        "context_embedder",
        "transformer_blocks.0.norm1.linear",
    ),
    "wan2.1": ("condition_embedder.time_embedder.linear_1", "proj_out"),
}


# -- helpers ---------------------------------------------------------------------------------------
def _pipeline(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "tiny":
            from fx_fp8.tools.tiny_model import load_tiny_pipeline

            return load_tiny_pipeline(), {"prompt": "a red circle on a white background"}
        from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

        return build_tiny_pipeline(name)


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "wan2.1"])
def test_compile_pipeline_with_cache_dit(name):
    from torch._dynamo.utils import counters

    fp8_cfg = {"diffusion_kv_cache_skip_layers": "1", "lowering": "reference"}
    # cache-only native, then FP8 without a cache (the usual FP8 error), then both
    pipe, kwargs = _pipeline(name)
    enable_cache(pipe.transformer, "cache_dit", CACHE_CONFIG)
    native, native_calls = run_steps(pipe, kwargs, block_counters(pipe.transformer))
    native_steps = list(fcd.block_runs(pipe.transformer).values())

    pipe, kwargs = _pipeline(name)
    plain, _ = run_steps(pipe, kwargs, [])
    fx_fp8.compile_pipeline(pipe, fp8_cfg)
    fp8_only, _ = run_steps(pipe, kwargs, [])

    pipe, kwargs = _pipeline(name)
    fx_fp8.compile_pipeline(pipe, fp8_cfg, cache_backend="cache_dit", cache_config=CACHE_CONFIG)
    original = pipeline_state(pipe).originals["transformer"]
    counts = block_counters(pipe.transformer)
    counters.clear()
    out, calls = run_steps(pipe, kwargs, counts)
    graphs = counters["stats"]["unique_graphs"]
    steps = list(fcd.block_runs(original).values())
    counters.clear()
    again, calls_again = run_steps(pipe, kwargs, counts)
    print(
        f"\n{name}: block runs cache-only {native_calls}, fp8 {calls}; cache-dit computed/cached calls "
        f"{native_steps} / {steps}; graphs {graphs}; rel error vs cache-only {rel_err(out, native):.4f}, "
        f"FP8 alone vs native {rel_err(fp8_only, plain):.4f}"
    )

    # cache-dit caches exactly as without FP8, and does cache
    assert calls == native_calls and steps == native_steps
    full = STEPS * (2 if name.startswith("wan") else 1)
    assert calls[0] == full and min(calls) < full and steps[0][1] > 0
    # a second run compiles nothing, caches alike and computes the same
    assert dict(counters["frames"]) == {} and counters["stats"]["unique_graphs"] == 0
    assert calls_again == calls and torch.equal(again, out)
    # each real block is its own compiled region, named as the model names it
    regions = pipeline_state(pipe).extras["transformer"].regions.modules
    assert sorted(regions) == sorted(m.rsplit(".", 1)[0] for m in SELF_ATTENTION[name])
    rows = check_layer_one_native(pipe.transformer, SELF_ATTENTION[name])
    assert not [e for e in rows if not e.name_resolved]
    prepared = pipeline_state(pipe).prepared["transformer"]
    for layer in SENSITIVE[name]:  # weight-only by default (native where too small to quantize)
        action = "weight-only" if layer in prepared["weight_only"] else "native"
        assert layer in prepared["weight_only"] or "sensitive" not in prepared["native"][layer], layer
        assert all(e.action == action for e in rows if e.op == "linear" and e.module == layer)
    assert set(SENSITIVE[name]) & set(prepared["weight_only"])
    # FP8's error on top of the cache is FP8's usual error
    assert rel_err(out, native) <= 1.5 * rel_err(fp8_only, plain) + 0.01

    restore_pipeline(pipe, linears="quantized")
    assert not fcd.is_cache_dit_enabled(original)
    assert not [m for m in original.modules() if "_fx_fp8_region" in vars(m)]


@pytest.mark.slow
def test_cache_dit_step_skips_follow_the_pipeline_steps():
    """diffusion_kv_cache_skip_steps selects the steps the pipeline runs, cached or computed."""
    pipe, kwargs = _pipeline("tiny")
    fx_fp8.compile_pipeline(
        pipe,
        {"diffusion_kv_cache_skip_steps": "0,1", "lowering": "reference", "quantization": None},
        cache_backend="cache_dit",
        cache_config=CACHE_CONFIG,
    )
    run_steps(pipe, kwargs, [])
    variants = pipeline_state(pipe).step_variants()
    assert len(variants) == STEPS
    assert all(set(v) == {"native"} for v in variants[:2])
    assert all(set(v) == {"fp8"} for v in variants[2:])


# -- mapping and errors ----------------------------------------------------------------------------
def test_vllm_omni_keys_map_onto_cache_dit():
    import cache_dit

    cfg = diffusers_cache_config(
        "cache_dit",
        {
            "Fn_compute_blocks": 2,
            "Bn_compute_blocks": 1,
            "max_warmup_steps": 4,
            "residual_diff_threshold": 0.24,
            "max_continuous_cached_steps": 3,
            "max_cached_steps": 20,
            "enable_taylorseer": True,
            "taylorseer_order": 2,
            "scm_steps_mask_policy": "fast",
            "scm_steps_policy": "static",
            "num_inference_steps": 28,
        },
    )
    db = cfg.cache_config
    assert isinstance(db, cache_dit.DBCacheConfig)
    assert (
        db.Fn_compute_blocks,
        db.Bn_compute_blocks,
        db.max_warmup_steps,
        db.residual_diff_threshold,
        db.max_continuous_cached_steps,
        db.max_cached_steps,
    ) == (2, 1, 4, 0.24, 3, 20)
    assert db.steps_computation_mask == cache_dit.steps_mask(mask_policy="fast", total_steps=28)
    assert db.steps_computation_policy == "static" and db.num_inference_steps == 28
    assert isinstance(cfg.calibrator_config, cache_dit.TaylorSeerCalibratorConfig)
    assert cfg.calibrator_config.taylorseer_order == 2
    # vLLM-Omni's default cache_config (TaylorSeer off, no step mask) is accepted as it is
    default = diffusers_cache_config(
        "cache_dit",
        {
            "Fn_compute_blocks": 1,
            "Bn_compute_blocks": 0,
            "max_warmup_steps": 4,
            "residual_diff_threshold": 0.24,
            "max_continuous_cached_steps": 3,
            "enable_taylorseer": False,
            "taylorseer_order": 1,
            "scm_steps_mask_policy": None,
            "scm_steps_policy": "dynamic",
        },
    )
    assert default.calibrator_config is None and default.cache_config.steps_computation_mask is None
    opts = PipelineOptions(cache_backend="cache-dit", cache_config='{"Fn_compute_blocks": 1}')
    assert opts.cache_backend == "cache_dit"
    # the command line's step count fills num_inference_steps in
    opts = PipelineOptions.load(
        {"cache_backend": "cache_dit", "cache_config": {"max_warmup_steps": 2}},
        cache_defaults={"num_inference_steps": 12},
    )
    assert opts.cache_config == {"max_warmup_steps": 2, "num_inference_steps": 12}


@pytest.mark.parametrize(
    "config,words",
    [
        (
            {"Fn_compute_block": 1},
            "unknown cache_config key 'Fn_compute_block' for cache_backend 'cache_dit' "
            r"\(did you mean 'Fn_compute_blocks'\?\)",
        ),
        ({"rel_l1_thresh": 0.2}, "unknown cache_config key 'rel_l1_thresh'"),
        ({"Fn_compute_blocks": -1}, r"invalid cache_config.Fn_compute_blocks .*: -1"),
        ({"residual_diff_threshold": float("nan")}, "invalid cache_config.residual_diff_threshold"),
        ({"residual_diff_threshold": float("inf")}, "invalid cache_config.residual_diff_threshold"),
        ({"enable_taylorseer": "yes"}, "invalid cache_config.enable_taylorseer"),
        ({"taylorseer_order": 2}, "taylorseer_order 2 needs enable_taylorseer: true"),
        ({"scm_steps_mask_policy": "fast"}, "scm_steps_mask_policy 'fast' needs cache_config.num_inference_steps"),
        ({"scm_steps_mask_policy": "fast", "num_inference_steps": 5}, r"4, 6 or >= 8; got 5"),
        ({"scm_steps_mask_policy": "quick", "num_inference_steps": 8}, "invalid cache_config.scm_steps_mask_policy"),
        ({"scm_steps_policy": "static"}, "scm_steps_policy 'static' needs scm_steps_mask_policy"),
        ({"steps_computation_mask": [1, 0, 2]}, "invalid cache_config.steps_computation_mask"),
    ],
)
def test_bad_cache_dit_config_is_named(config, words):
    with pytest.raises(ValueError, match=words):
        PipelineOptions(cache_backend="cache_dit", cache_config=config)


def test_missing_cache_dit_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cache_dit", None)  # import cache_dit -> ImportError
    from fx_fp8.install_hint import install_hint

    with pytest.raises(ValueError, match=re.escape(install_hint("cache-dit"))) as e:
        PipelineOptions(cache_backend="cache_dit")
    assert "\n" not in str(e.value)


def test_tea_cache_and_cfg_parallel_stay_refused():
    with pytest.raises(ValueError, match="cache_backend 'tea_cache' is not supported: diffusers has no TeaCache"):
        PipelineOptions(cache_backend="tea_cache")
    with pytest.raises(ValueError, match="'cfg_parallel_size'=2 is not supported: CFG parallelism"):
        PipelineOptions(parallel={"cfg_parallel_size": 2})
    assert not PipelineOptions(parallel={"cfg_parallel_size": 1}).enabled  # 1 means off


def test_unknown_transformer_and_parallel_are_refused_before_any_change():
    pipe, _ = _pipeline("tiny")
    opts = PipelineOptions(cache_backend="cache_dit", parallel={"ulysses_degree": 2})
    with pytest.raises(ValueError, match="cache_backend 'cache_dit' with parallel_config is not supported"):
        check_pipeline_options(opts, [pipe.transformer], compile_kwargs={})

    class Unknown(torch.nn.Module):
        pass

    opts = PipelineOptions(cache_backend="cache_dit")
    with pytest.raises(ValueError, match="cache-dit has no block adapter for Unknown"):
        check_pipeline_options(opts, [Unknown()], compile_kwargs={})
    assert not fcd.is_cache_dit_enabled(pipe.transformer)
