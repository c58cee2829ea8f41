"""Step selectors relative to the run ("first:2,last:2"), the run's number of steps published next
to the step, and the shipped tiny model's own config (its step policy)."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

import fx_fp8
from fx_fp8 import steps
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.selectors import Selector, parse_selector, step_patterns
from fx_fp8.tools.tiny_model import TINY_MODEL_CONFIG, TINY_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATTN = "diffusion_kv_cache_skip_steps"


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- grammar -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, total, expected",
    [
        ("first:2,last:2", 10, {0, 1, 8, 9}),
        ("first:2,last:2", 30, {0, 1, 28, 29}),
        ("0,last:3", 10, {0, 7, 8, 9}),
        ("last:1", 4, {3}),
        ("first:3", 10, {0, 1, 2}),
        ("first:2, 5-6 ,last:2", 10, {0, 1, 5, 6, 8, 9}),
        ("first:2,last:2", 3, {0, 1, 2}),
        ("last:12", 10, set(range(10))),
        ("first:1,first:3,last:2,last:1", 10, {0, 1, 2, 8, 9}),
    ],
)
def test_relative_tokens_resolve_with_the_total(text, total, expected):
    sel = parse_selector(text, what=ATTN, relative=True)
    assert sel.resolve(total) == expected
    assert {s for s in range(total) if sel.contains(s, total)} == expected
    assert parse_selector(str(sel), what=ATTN, relative=True) == sel  # prints back as it parses


def test_relative_selectors_print_as_written_and_compare_by_what_they_select():
    sel = parse_selector("first:2,last:2", what=ATTN, relative=True)
    assert str(sel) == "first:2,last:2" and str(parse_selector("0,last:3", relative=True)) == "0,last:3"
    assert sel and sel.needs_total and not parse_selector("first:2", relative=True).needs_total
    # first:k is steps 0..k-1 (no total needed); last:k is not a fixed set
    assert parse_selector("first:2", relative=True) == {0, 1} == parse_selector("0-1")
    assert 1 in parse_selector("first:2", relative=True)
    assert sel != {0, 1} and sel != parse_selector("first:2", relative=True)
    assert parse_selector([0, "last:2"], relative=True) == parse_selector("0,last:2", relative=True)


def test_config_keys_take_relative_tokens_and_round_trip():
    cfg = FP8Config.from_kwargs(diffusion_kv_cache_skip_steps="first:2,last:2", quantization_skip_steps="0,last:1")
    assert cfg.attention_enabled and cfg.linear_enabled
    assert cfg.to_dict()["diffusion_kv_cache_skip_steps"] == "first:2,last:2"
    assert cfg.to_dict()["quantization_config"]["skip_steps"] == "0,last:1"
    assert FP8Config.from_kwargs(**cfg.to_dict()) == cfg
    assert FP8Config.load({"quantization_config": {"skip_steps": "last:3"}}).quantization_config.skip_steps.last == 3
    from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args
    import argparse

    args = add_fp8_flags(argparse.ArgumentParser()).parse_args(["--diffusion-kv-cache-skip-steps", "first:1,last:1"])
    assert str(config_from_args(args).diffusion_kv_cache_skip_steps) == "first:1,last:1"


@pytest.mark.parametrize(
    "key, kwargs",
    [
        ("diffusion_kv_cache_skip_steps", lambda v: dict(diffusion_kv_cache_skip_steps=v)),
        ("quantization_config.skip_steps", lambda v: dict(quantization_config={"skip_steps": v})),
        ("quantization_skip_steps", lambda v: dict(quantization_skip_steps=v)),
    ],
)
@pytest.mark.parametrize(
    "bad, says",
    [
        ("first:2,lats:2", "unknown relative token 'lats' (did you mean 'last'?)"),
        ("first:0", "first:k with k an integer >= 1"),
        ("last:x", "last:k with k an integer >= 1"),
        ("last:", "last:k with k an integer >= 1"),
        ("last:-1", "last:k with k an integer >= 1"),
        ("middle:2", "unknown relative token 'middle'"),
    ],
)
def test_bad_relative_tokens_name_the_key_and_the_token(key, kwargs, bad, says):
    with pytest.raises(ValueError) as e:
        FP8Config.from_kwargs(**kwargs(bad))
    msg = str(e.value)
    assert key in msg and says in msg, msg
    token = next(t for t in bad.split(",") if t not in ("first:2",))
    assert repr(token) in msg and repr(bad) in msg, msg


def test_layer_selectors_refuse_relative_tokens():
    with pytest.raises(
        ValueError,
        match=r"invalid token 'last:2' in diffusion_kv_cache_skip_layers 'last:2': "
        r"first:k / last:k select denoising steps only",
    ):
        FP8Config.from_kwargs(diffusion_kv_cache_skip_layers="last:2")


def test_a_last_selector_has_no_membership_without_a_total():
    sel = parse_selector("first:2,last:2", what=ATTN, relative=True)
    for op in (lambda: 3 in sel, lambda: list(sel), lambda: len(sel), lambda: sel.at_least(1)):
        with pytest.raises(ValueError, match=r"diffusion_kv_cache_skip_steps 'first:2,last:2' counts from the end"):
            op()
    with pytest.raises(ValueError, match="invalid number of steps 0"):
        sel.resolve(0)


# -- the closed set of variants --------------------------------------------------------------------
def test_step_variants_of_relative_selectors():
    def variants(**kw):
        return set(FP8Config.from_kwargs(**kw).step_variants())

    assert variants(diffusion_kv_cache_skip_steps="first:2,last:2") == {"fp8", "native"}
    assert variants(quantization_skip_steps="last:2") == {"fp8", "linear_weight_only"}
    # the same relative steps for both: no step runs only one of them
    assert variants(diffusion_kv_cache_skip_steps="first:2,last:2", quantization_skip_steps="first:2,last:2") == {
        "fp8",
        "native+linear_weight_only",
    }
    # last:2 vs absolute 8-9: the same steps in a 10-step run, apart in others
    assert variants(diffusion_kv_cache_skip_steps="last:2", quantization_skip_steps="8-9") == {
        "fp8",
        "native",
        "native+linear_weight_only",
        "linear_weight_only",
    }
    # last:3 always covers last:1's step; first:1 never reaches past step 0
    assert variants(diffusion_kv_cache_skip_steps="last:3", quantization_skip_steps="last:1") == {
        "fp8",
        "native",
        "native+linear_weight_only",
    }
    # a huge absolute range next to last:k: ranges, never steps
    assert step_patterns(parse_selector("0-1000000000"), parse_selector("last:1", relative=True)) == {
        (True, False),
        (True, True),
        (False, True),
        (False, False),
    }


# -- publishing the total ------------------------------------------------------------------------
def test_set_step_and_denoising_step_publish_the_total():
    assert steps.current_total() is None
    fx_fp8.set_step(3, total=10)
    assert (fx_fp8.current_step(), steps.current_total()) == (3, 10)
    fx_fp8.set_step(4)  # a step published without a total has none (no stale total from another run)
    assert steps.current_total() is None
    with fx_fp8.denoising_step(1, total=30):
        assert (fx_fp8.current_step(), steps.current_total()) == (1, 30)
    assert (fx_fp8.current_step(), steps.current_total()) == (4, None)
    fx_fp8.set_step(None)
    for bad, says in (
        ((10, 10), "invalid denoising step 10 for total=10: steps of a 10-step run are 0-9"),
        ((0, 0), "invalid number of denoising steps total=0"),
        ((None, 5), "total=5 given without a step"),
        ((0, True), "invalid number of denoising steps total=True"),
    ):
        with pytest.raises(ValueError, match=says):
            fx_fp8.set_step(bad[0], total=bad[1])
        with pytest.raises(ValueError, match=says):
            with fx_fp8.denoising_step(bad[0], total=bad[1]):
                pass


def _variants_of_a_run(selector, total, linear=None):
    """The variant variant_for_step picks on each step of a run of `total` steps, heard by a listener."""
    attn = parse_selector(selector, what=ATTN, relative=True)
    lin = parse_selector(linear, what="quantization_config.skip_steps", relative=True)
    heard = []
    with steps.variant_listener(heard.append):
        for i in range(total):
            with fx_fp8.denoising_step(i, total=total):
                steps.variant_for_step(attn, lambda: None, lin)
    return heard


@pytest.mark.parametrize("total, native", [(10, [0, 1, 8, 9]), (30, [0, 1, 28, 29])])
def test_first_and_last_two_pick_their_steps_in_any_run_length(total, native):
    heard = _variants_of_a_run("first:2,last:2", total)
    assert [i for i, v in enumerate(heard) if v == "native"] == native
    assert heard.count("fp8") == total - 4


def test_attention_and_linear_relative_selectors_combine():
    heard = _variants_of_a_run("first:1", 6, linear="last:2")
    assert heard == ["native", "fp8", "fp8", "fp8", "linear_weight_only", "linear_weight_only"]


def test_last_without_a_published_total_is_an_error_naming_the_key():
    attn = parse_selector("first:2,last:2", what=ATTN, relative=True)
    fx_fp8.set_step(3)
    with pytest.raises(ValueError) as e:
        steps.variant_for_step(attn, lambda: None)
    msg = str(e.value)
    assert "diffusion_kv_cache_skip_steps 'first:2,last:2'" in msg and "no number of steps was published" in msg
    assert "fx_fp8.set_step(i, total=N)" in msg and "denoising_step(i, total=N)" in msg
    lin = parse_selector("last:1", what="quantization_config.skip_steps", relative=True)
    with pytest.raises(ValueError, match=r"quantization_config\.skip_steps 'last:1' counts from the end"):
        steps.variant_for_step((), lambda: None, lin)
    # first:k alone needs no total
    assert steps.variant_for_step(parse_selector("first:4", relative=True), lambda: None) == "native"
    # a published step past the published total cannot be placed
    steps_token = steps._TOTAL.set(3)
    try:
        with pytest.raises(ValueError, match="denoising step 3 is past the run's 3 steps"):
            steps.variant_for_step(attn, lambda: None)
    finally:
        steps._TOTAL.reset(steps_token)


class _Scheduler:
    """A scheduler as diffusers' pipelines drive it: set_timesteps, maybe set_begin_index, step."""

    def __init__(self):
        self.timesteps, self.begin_index = None, None

    def set_timesteps(self, n):
        self.timesteps, self.begin_index = torch.linspace(1, 0, n), None

    def step(self, out, t, x):
        return x - 0.1 * out


class _Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((fx_fp8.current_step(), steps.current_total()))
        return x


class _Pipeline:
    """Two transformer calls per step (CFG); `start` skips the first timesteps like img2img's strength,
    calling set_begin_index unless `tell_scheduler` is false."""

    def __init__(self):
        self.transformer, self.scheduler = _Transformer(), _Scheduler()

    def __call__(self, num_inference_steps=4, start=0, tell_scheduler=True):
        self.scheduler.set_timesteps(num_inference_steps)
        if start and tell_scheduler:
            self.scheduler.begin_index = start
        x = torch.zeros(1)
        for t in self.scheduler.timesteps[start:]:
            x = self.scheduler.step(self.transformer(x) - self.transformer(x), t, x)
        return x


def test_pipeline_runs_publish_the_schedulers_number_of_steps():
    """compile_pipeline's publishing (the same mechanism as publish_steps): every call of a run,
    both calls of a CFG step included, sees the run's number of steps once set_timesteps ran;
    an img2img start index (set_begin_index) counts only the steps the run makes."""
    pipe = _Pipeline()
    with fx_fp8.publish_steps(pipe):
        pipe(num_inference_steps=3)
        assert pipe.transformer.seen == [(s, 3) for s in (0, 0, 1, 1, 2, 2)]
        pipe.transformer.seen.clear()
        pipe(num_inference_steps=5, start=2)
        assert pipe.transformer.seen == [(s, 3) for s in (0, 0, 1, 1, 2, 2)]
    assert steps.current_total() is None and fx_fp8.current_step() is None


def test_a_run_whose_scheduler_disagrees_with_its_steps_warns():
    """A pipeline that starts part-way without telling its scheduler: last:k would miss the run's
    last steps; the run says so."""
    pipe = _Pipeline()
    with fx_fp8.publish_steps(pipe):
        with pytest.warns(
            RuntimeWarning,
            match=r"made 3 scheduler steps but its scheduler gave 5 as the run's number "
            r"of steps",
        ):
            pipe.transformer.forward = lambda x: (steps.current_total(), x)[1]  # a selector reads the total
            pipe(num_inference_steps=5, start=2, tell_scheduler=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pipe(num_inference_steps=5, start=2)  # told: 3 of 3


def test_a_scheduler_without_timesteps_is_a_clear_error():
    from fx_fp8.pipeline.step_publishing import scheduler_total

    with pytest.raises(
        ValueError,
        match=r"_Scheduler.timesteps \(None\) gives no number of steps .* "
        r"fx_fp8.set_step\(i, total=N\)",
    ):
        scheduler_total(_Scheduler())
    s = _Scheduler()
    s.set_timesteps(10)
    s.begin_index = 4
    assert scheduler_total(s) == 6


# -- the shipped model's config --------------------------------------------------------------------
def test_the_shipped_config_is_the_library_default_plus_its_step_policy():
    cfg = FP8Config.load(TINY_MODEL_CONFIG)
    assert str(cfg.diffusion_kv_cache_skip_steps) == "first:2,last:2"
    assert cfg.replace(diffusion_kv_cache_skip_steps="") == FP8Config()  # nothing else differs
    assert os.path.dirname(TINY_MODEL_CONFIG) == str(TINY_MODEL_DIR)
    assert FP8Config().diffusion_kv_cache_skip_steps == set()  # the library default keeps no step skipped


def test_the_shipped_config_is_packaged_with_the_weights():
    import fnmatch

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["fx_fp8.tools.tiny_model"]
    assert any(fnmatch.fnmatch("weights/fx_fp8.yaml", pattern) for pattern in data), data


def _example_config(monkeypatch, argv):
    """The FP8Config examples/text_to_image.py would compile with (its model work stubbed out)."""
    from PIL import Image

    image = _load("examples/text_to_image.py", "example_text_to_image_rel")
    seen = {}

    def fake_run(pipe, run, cfg, *, backend, device, compare, metrics):
        seen["cfg"] = cfg
        return None, Image.new("RGB", (8, 8)), [dict(run="fp8", first=0.0)]

    monkeypatch.setattr(image, "load_pipeline", lambda *a, **k: object())
    monkeypatch.setattr(image._common, "run_native_and_fp8", fake_run)
    monkeypatch.setattr(image._common, "print_fp8_summary", lambda pipe: None)
    assert image.main(argv) == 0
    return seen["cfg"]


def test_the_main_example_uses_the_models_own_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _example_config(monkeypatch, []) == FP8Config.load(TINY_MODEL_CONFIG)
    out = capsys.readouterr().out
    assert f"config: {TINY_MODEL_CONFIG} (the model's own" in out and "native at steps first:2,last:2" in out
    assert _example_config(monkeypatch, ["--library-default"]) == FP8Config()
    # flags apply on top of the model's config, as on top of --config
    cfg = _example_config(monkeypatch, ["--quantization-skip-steps", "last:1"])
    assert (
        str(cfg.diffusion_kv_cache_skip_steps) == "first:2,last:2"
        and str(cfg.quantization_config.skip_steps) == "last:1"
    )
    flat = os.path.join(ROOT, "examples", "configs", "fp8_flat.yaml")
    assert _example_config(monkeypatch, ["--config", flat]) == FP8Config.load(flat)
    with pytest.raises(AssertionError):  # main(argv) returned 2: one line on stderr, before any model loads
        _example_config(monkeypatch, ["--config", flat, "--library-default"])
    assert "error: --library-default and --config" in capsys.readouterr().err


def test_tiny_quality_measures_the_shipped_config_by_default(monkeypatch):
    tq = _load("benchmarks/tiny_quality.py", "tiny_quality_rel")
    seen = []

    def fake_evaluate(cfg, cases, steps_, native, backend):
        seen.append(cfg)
        return {
            name: dict(
                psnr=30.0,
                psnr_min=30.0,
                ssim=0.97,
                ssim_min=0.97,
                seconds=0.0,
                attn="4/4",
                linear="34/48",
                fp8_flops=0.84,
            )
            for name in cases
        }

    monkeypatch.setattr(tq, "evaluate", fake_evaluate)
    monkeypatch.setattr(tq, "generate", lambda pipe, cases, steps_: [None] * len(cases))
    monkeypatch.setattr(
        tq, "load_tiny_pipeline", lambda: type("P", (), {"set_progress_bar_config": lambda *a, **k: None})()
    )
    assert tq.main(["--num-prompts", "1"]) == 0
    assert seen[-1] == FP8Config.load(TINY_MODEL_CONFIG)
    assert tq.main(["--num-prompts", "1", "--library-default"]) == 0
    assert seen[-1] == FP8Config()
    # the step-policy rows set both selectors: the shipped policy does not leak into "all FP8"
    assert tq.main(["--num-prompts", "1", "--step-policies"]) == 0
    assert not seen[-4].has_step_skips
    assert tq.with_resolved_steps("x", FP8Config.load(TINY_MODEL_CONFIG), 10) == (
        "x (attention native on first:2,last:2 = 0-1,8-9)"
    )
    with pytest.raises(SystemExit):
        tq.main(["--library-default", "--config", str(TINY_MODEL_CONFIG)])


# -- compiled runs ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_compiled_model_picks_first_and_last_two_in_10_and_30_step_runs():
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux", layers=1, seed=0)
    kw = example_inputs("flux", model)
    compiled = torch.compile(model, backend="fp8", options={ATTN: "first:2,last:2"})
    for total, native in ((10, [0, 1, 8, 9]), (30, [0, 1, 28, 29])):
        heard = []
        with torch.no_grad(), steps.variant_listener(heard.append):
            for i in range(total):
                with fx_fp8.denoising_step(i, total=total):
                    compiled(**kw)
        assert [i for i, v in enumerate(heard) if v == "native"] == native and len(heard) == total
    with torch.no_grad(), fx_fp8.denoising_step(2), pytest.raises(ValueError, match="no number of steps was published"):
        compiled(**kw)


@pytest.mark.slow
def test_compile_pipeline_publishes_the_total_to_a_cfg_batch():
    """SD3 batches both CFG halves into one call; every call of a 6-step run sees total 6."""
    from fx_fp8.tools.model_zoo.pipelines import tiny_sd3

    pipe, kwargs = tiny_sd3()
    fx_fp8.compile_pipeline(pipe, diffusion_kv_cache_skip_steps="first:2,last:2")
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda *_: seen.append((fx_fp8.current_step(), steps.current_total())))
    with torch.no_grad():
        pipe(**kwargs, num_inference_steps=6, output_type="latent")
    assert seen == [(i, 6) for i in range(6)]
    assert [v for (v,) in fx_fp8.pipeline_state(pipe).step_variants()] == [
        "native",
        "native",
        "fp8",
        "fp8",
        "native",
        "native",
    ]


@pytest.mark.slow
def test_wan22_experts_see_one_total():
    """Wan2.2: two experts, two CFG calls per step, one scheduler: last:2 is the run's last two steps
    whichever expert runs them."""
    from fx_fp8.tools.model_zoo.pipelines import tiny_wan22

    pipe, kwargs = tiny_wan22()
    fx_fp8.compile_pipeline(pipe, diffusion_kv_cache_skip_steps="last:2")
    with torch.no_grad():
        pipe(**kwargs, num_inference_steps=5, output_type="latent")
    calls = fx_fp8.pipeline_state(pipe).calls
    assert {c.transformer for c in calls} == {"transformer", "transformer_2"}
    assert [(c.step, c.variant) for c in calls] == [
        (s, "native" if s >= 3 else "fp8") for s in range(5) for _ in (0, 1)
    ]


@pytest.mark.slow
def test_the_shipped_config_runs_native_attention_on_the_first_and_last_two_steps():
    from fx_fp8.tools.tiny_model import load_tiny_pipeline

    pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    fx_fp8.compile_pipeline(pipe, TINY_MODEL_CONFIG)
    for num_steps, native in ((10, [0, 1, 8, 9]), (6, [0, 1, 4, 5])):  # one compile: the selector resolves per run
        pipe(
            "a red circle on a blue background",
            num_inference_steps=num_steps,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        )
        per_step = fx_fp8.pipeline_state(pipe).step_variants()
        assert len(per_step) == num_steps
        assert [i for i, vs in enumerate(per_step) if vs == ["native"]] == native
        assert all(vs == ["fp8"] for i, vs in enumerate(per_step) if i not in native)


def test_the_sensitivity_search_resolves_a_relative_base_config_on_its_steps():
    """A base config written with "last:k" is searched on the steps it means for the run's
    step count (without resolving, its step items could not be counted at all)."""
    from fx_fp8.tools.sensitivity import resolve_step_selectors

    base = fx_fp8.FP8Config.load(
        {
            "diffusion_kv_cache_dtype": "fp8",
            "quantization": "fp8",
            "diffusion_kv_cache_skip_steps": "first:1,last:2",
            "quantization_config": {"skip_steps": "last:1"},
        }
    )
    resolved = resolve_step_selectors(base, 8)
    assert list(resolved.diffusion_kv_cache_skip_steps) == [0, 6, 7]
    assert list(resolved.quantization_config.skip_steps) == [7]
    assert resolve_step_selectors(resolved, 8) is resolved  # absolute already: unchanged
