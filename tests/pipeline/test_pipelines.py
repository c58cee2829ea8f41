"""compile_pipeline / restore_pipeline on real diffusers pipelines (tiny random, offline) and on a toy.

The real pipelines check what matters to users: the step variant at every step
follows diffusion_kv_cache_skip_steps, a run compiles one Dynamo graph (two step
variants) and a second run compiles nothing, the output stays close to the
uncompiled pipeline's. The toy pipeline checks the publishing mechanism's edges
(exceptions, swapped schedulers, missing scheduler.step) at a fraction of the cost.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8 import compile_pipeline, pipeline_state, restore_pipeline
from fx_fp8.pipeline.state import TransformerCall
from fx_fp8.quant.quantized_linear import QuantizedLinear

from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

from toy_models import ToyScheduler

STEPS = 5
SKIP = "0,1"
EXPECTED_VARIANTS = ["native", "native", "fp8", "fp8", "fp8"]
# transformer calls per denoising step: Qwen-Image's true CFG and Wan's CFG call it twice,
# SD3 and Z-Image batch cond and uncond into one call, Flux (no CFG) calls it once.
CALLS_PER_STEP = {"flux": 1, "qwen-image": 2, "wan2.1": 2, "wan2.2": 2, "z-image": 1, "sd3": 1}
# Latent relative error of the FP8 pipeline (FP8 linears + FP8 attention on steps 2-4) against
# the uncompiled one, measured at 0.1-0.8% (Flux, Qwen, SD3, Wan) and 2.7% (Z-Image: its
# refiner and main layers quantize every block linear). 6% leaves room for seed/platform
# differences while an expert running with the other expert's weights gives ~30%.
MAX_REL_ERROR = 0.06


def _output(out):
    return out.images if hasattr(out, "images") else out.frames


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _graph_counters(pipe):
    from torch._dynamo.utils import counters

    graphs = sum(len(r) for r in pipeline_state(pipe).reports().values())
    return graphs, counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CALLS_PER_STEP))
def test_pipeline_publishes_steps(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe, kwargs = build_tiny_pipeline(name)
    run = dict(kwargs, num_inference_steps=STEPS, output_type="latent")
    ref = _output(pipe(**run, generator=torch.Generator().manual_seed(0)))
    originals = {a: getattr(pipe, a) for a in ("transformer", "transformer_2") if getattr(pipe, a, None) is not None}
    base_class = type(pipe)

    compile_pipeline(pipe, diffusion_kv_cache_skip_steps=SKIP)
    seen = []

    def callback(p, i, t, tensors):
        seen.append((i, fx_fp8.current_step()))
        return {}

    g0, u0 = _graph_counters(pipe)
    out = _output(pipe(**run, generator=torch.Generator().manual_seed(0), callback_on_step_end=callback))
    g1, u1 = _graph_counters(pipe)
    calls = pipeline_state(pipe).calls

    # steps 0..4 once each, in order; every call of a step (both CFG calls) ran the same variant
    assert [c.step for c in calls] == [s for s in range(STEPS) for _ in range(CALLS_PER_STEP[name])]
    assert pipeline_state(pipe).step_variants() == [[v] * CALLS_PER_STEP[name] for v in EXPECTED_VARIANTS]
    # the user's callback still runs, with diffusers' indices; the published step is already the next one
    assert seen == [(i, i + 1) for i in range(STEPS)]
    assert fx_fp8.current_step() is None
    # two step variants of the transformer's graph, reported for each transformer (Wan2.2's experts
    # share Dynamo's graph: same class, and their weights are graph inputs, but each has its own
    # record); Dynamo also traced the model for prepare_model's structural analysis (a capturing
    # backend, nothing compiled)
    assert g1 - g0 == 2 * (2 if name == "wan2.2" else 1) and u1 > u0
    assert _rel(out, ref) < MAX_REL_ERROR

    if name == "wan2.2":
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        experts = ["transformer" if t >= boundary else "transformer_2" for t in pipe.scheduler.timesteps]
        # both experts run, transformer_2 for most steps, so a wrong expert weight shows in the error
        assert experts == ["transformer"] * 2 + ["transformer_2"] * 3
        assert [c.transformer for c in calls] == [e for e in experts for _ in range(2)]

    again = _output(pipe(**run, generator=torch.Generator().manual_seed(0)))
    assert _graph_counters(pipe) == (g1, u1), "the second run recompiled"
    assert torch.equal(again, out)
    assert pipeline_state(pipe).step_variants() == [[v] * CALLS_PER_STEP[name] for v in EXPECTED_VARIANTS]

    restore_pipeline(pipe, linears="quantized")  # prepared without keep_weights: the originals were freed
    assert type(pipe) is base_class
    assert originals  # not vacuous: all() of nothing is True
    assert all(getattr(pipe, a) is m for a, m in originals.items())
    assert "step" not in vars(pipe.scheduler)
    assert not hasattr(pipe, "_fx_fp8")


# -- a toy pipeline: the mechanism's edges, cheaply ---------------------------------------
class ToyDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(32, 96)
        self.to_out = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.to_qkv(x).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(o.transpose(1, 2).reshape(1, -1, 32))


class ToyPipeline:
    """Calls the transformer twice per step (CFG) like Qwen-Image, then scheduler.step, then the callback."""

    def __init__(self, transformer=None, scheduler=None):
        self.transformer = transformer if transformer is not None else ToyDiT()
        self.scheduler = scheduler if scheduler is not None else ToyScheduler()

    def __call__(self, num_inference_steps=4, call_scheduler=True, callback=None):
        x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for i in range(num_inference_steps):
                out = self.transformer(x) - 0.5 * self.transformer(0.5 * x)
                x = self.scheduler.step(out, i, x) if call_scheduler else x - 0.1 * out
                if callback is not None:
                    callback(self, i)
        return x


def _toy():
    torch.manual_seed(0)
    return ToyPipeline()


def test_toy_variants_follow_selector():
    pipe = compile_pipeline(_toy(), diffusion_kv_cache_skip_steps="1,3")
    pipe()
    calls = pipeline_state(pipe).calls
    assert [(c.step, c.variant) for c in calls] == [
        (0, "fp8"),
        (0, "fp8"),
        (1, "native"),
        (1, "native"),
        (2, "fp8"),
        (2, "fp8"),
        (3, "native"),
        (3, "native"),
    ]
    assert all(isinstance(c, TransformerCall) and c.transformer == "transformer" for c in calls)


def test_toy_without_step_skips_records_no_variant():
    pipe = compile_pipeline(_toy())
    pipe(num_inference_steps=2)
    assert [(c.step, c.variant) for c in pipeline_state(pipe).calls] == [(0, None), (0, None), (1, None), (1, None)]


def test_exception_in_run_clears_the_step():
    pipe = compile_pipeline(_toy(), diffusion_kv_cache_skip_steps="0")

    def boom(p, i):
        if i == 1:
            raise KeyError("user callback failed")

    with pytest.raises(KeyError):
        pipe(callback=boom)
    assert fx_fp8.current_step() is None
    assert not pipeline_state(pipe).running
    pipe(num_inference_steps=2)  # a new run counts from 0 again
    assert [c.step for c in pipeline_state(pipe).calls] == [0, 0, 1, 1]


def test_scheduler_step_outside_a_run_publishes_nothing():
    pipe = compile_pipeline(_toy(), diffusion_kv_cache_skip_steps="0")
    pipe.scheduler.step(torch.zeros(1), 0, torch.zeros(1))
    assert fx_fp8.current_step() is None


def test_swapped_scheduler_is_hooked_at_the_next_run():
    pipe = compile_pipeline(_toy(), diffusion_kv_cache_skip_steps="0")
    old = pipe.scheduler
    pipe.scheduler = ToyScheduler()
    pipe(num_inference_steps=3)
    assert [c.step for c in pipeline_state(pipe).calls] == [0, 0, 1, 1, 2, 2]
    assert "step" not in vars(old)


def test_pipelines_sharing_a_scheduler_keep_their_steps():
    first, second = _toy(), _toy()
    second.scheduler = first.scheduler  # as DiffusionPipeline.from_pipe does
    compile_pipeline(first, diffusion_kv_cache_skip_steps="0")
    compile_pipeline(second, diffusion_kv_cache_skip_steps="0")
    restore_pipeline(first)  # unhooks the shared scheduler under `second`
    second(num_inference_steps=2)
    assert [c.step for c in pipeline_state(second).calls] == [0, 0, 1, 1]


def test_pipeline_that_never_steps_its_scheduler_warns():
    pipe = compile_pipeline(_toy(), diffusion_kv_cache_skip_steps="0")
    with pytest.warns(RuntimeWarning, match="never pipe.scheduler.step"):
        pipe(num_inference_steps=2, call_scheduler=False)


def test_replaced_transformer_is_refused():
    pipe = compile_pipeline(_toy())
    pipe.transformer = ToyDiT()
    with pytest.raises(RuntimeError, match="pipe.transformer was replaced"):
        pipe()


class _NoSteps:
    pass


class _StepIsData:
    step = 3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: object(), "no denoising transformer"),
        (lambda: ToyPipeline.__new__(ToyPipeline), "no denoising transformer"),
        (lambda: ToyPipeline(scheduler=_NoSteps()), "without a callable step"),
        (lambda: ToyPipeline(scheduler=_StepIsData()), "without a callable step"),
        (lambda: _with(ToyPipeline(), scheduler=None), "has no scheduler"),
        (lambda: _with(ToyPipeline(), transformer=torch.compile(ToyDiT())), "already torch.compile'd"),
        (lambda: _with(ToyPipeline(), transformer="not a module"), "not a torch.nn.Module"),
    ],
)
def test_compile_refuses_what_it_cannot_handle(make, match):
    with pytest.raises(ValueError, match=match):
        compile_pipeline(make())


def _with(pipe, **attrs):
    for k, v in attrs.items():
        setattr(pipe, k, v)
    return pipe


def test_compile_refuses_bad_arguments():
    with pytest.raises(ValueError, match="invalid backend 'inductor'"):
        compile_pipeline(_toy(), backend="inductor")
    with pytest.raises(ValueError, match="unknown config key 'skip_steps'"):
        compile_pipeline(_toy(), skip_steps="0")
    with pytest.raises(ValueError, match="compile_kwargs may not set 'backend'"):
        compile_pipeline(_toy(), compile_kwargs={"backend": "eager"})
    pipe = compile_pipeline(_toy())
    with pytest.raises(ValueError, match="already compiled"):
        compile_pipeline(pipe)


def test_unprepared_experts_of_one_class_keep_their_own_weights():
    # Dynamo reuses one graph for both experts (same class); each must still use its own FP8 weights.
    pipe = _toy()
    pipe.transformer_2 = ToyDiT()
    with torch.no_grad():
        refs = [
            m(torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0)))
            for m in (pipe.transformer, pipe.transformer_2)
        ]
    compile_pipeline(pipe, prepare=False)
    with torch.no_grad():
        outs = [
            m(torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0)))
            for m in (pipe.transformer, pipe.transformer_2)
        ]
    errs = [((out - ref).norm() / ref.norm()).item() for ref, out in zip(refs, outs)]
    # FP8 error of a 32-wide toy is ~7%; the other expert's weights would give ~100%
    assert max(errs) < 0.15, errs


def test_restore_with_kept_weights_is_exact():
    pipe = _toy()
    ref = pipe()
    original = pipe.transformer
    compile_pipeline(pipe, keep_weights=True)
    assert type(original.to_qkv) is nn.Linear  # prepared on the first call, with its inputs
    assert not torch.equal(pipe(), ref)
    assert isinstance(original.to_qkv, QuantizedLinear)  # prepared in place
    restore_pipeline(pipe)
    assert pipe.transformer is original and type(pipe) is ToyPipeline
    assert type(original.to_qkv) is nn.Linear
    assert torch.equal(pipe(), ref)


def test_restore_without_kept_weights_refuses_unless_told_to_keep_fp8_linears():
    pipe = _toy()
    compile_pipeline(pipe)
    pipe(num_inference_steps=1)
    compiled = pipe.transformer
    with pytest.raises(ValueError, match=r"were freed .*linears='quantized'"):
        restore_pipeline(pipe)
    assert pipe.transformer is compiled and pipeline_state(pipe)  # the refusal changed nothing
    with pytest.raises(ValueError, match="invalid linears 'fp8'"):
        restore_pipeline(pipe, linears="fp8")
    restore_pipeline(pipe, linears="quantized")
    assert isinstance(pipe.transformer.to_qkv, QuantizedLinear)
    # the final projection: found by structure, weight-only by default (kept out of W8A8)
    assert isinstance(pipe.transformer.to_out, QuantizedLinear) and pipe.transformer.to_out.weight_only
    assert not pipe.transformer.to_qkv.weight_only
    pipe()  # still runs, eagerly
    with pytest.raises(ValueError, match="not compiled"):
        restore_pipeline(pipe)


def test_config_sources_agree(tmp_path):
    path = tmp_path / "fp8.yaml"
    fx_fp8.FP8Config.from_kwargs(diffusion_kv_cache_dtype="fp8", diffusion_kv_cache_skip_steps="0").to_yaml(path)
    from_yaml = pipeline_state(compile_pipeline(_toy(), str(path))).config
    from_mapping = pipeline_state(
        compile_pipeline(_toy(), {"diffusion_kv_cache_dtype": "fp8", "diffusion_kv_cache_skip_steps": "0"})
    ).config
    assert from_yaml == from_mapping
    assert not from_yaml.linear_enabled and from_yaml.diffusion_kv_cache_skip_steps == {0}


class SlowScheduler(ToyScheduler):
    """Yields the CPU between steps so two pipelines in two threads really interleave."""

    def __init__(self, barrier=None):
        self.barrier = barrier

    def step(self, out, t, x):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
        return super().step(out, t, x)


def test_two_pipelines_in_two_threads_each_run_their_own_steps():
    """The published step is per thread: pipeline A (skip steps 1,3) and pipeline B (skip 0,1) run
    at once, step for step in lockstep, and each runs exactly its own variant sequence and output."""
    import threading

    def make(skip, barrier=None):
        torch.manual_seed(0)
        return compile_pipeline(ToyPipeline(scheduler=SlowScheduler(barrier)), diffusion_kv_cache_skip_steps=skip)

    solo = {}
    for name, skip in (("a", "1,3"), ("b", "0,1")):
        pipe = make(skip)
        solo[name] = (pipe(), [(c.step, c.variant) for c in pipeline_state(pipe).calls])
    torch._dynamo.reset()

    barrier = threading.Barrier(2)
    pipes = {"a": make("1,3", barrier), "b": make("0,1", barrier)}
    results, errors = {}, []

    def run(name):
        try:
            out = pipes[name]()
            results[name] = (out, [(c.step, c.variant) for c in pipeline_state(pipes[name]).calls])
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(n,)) for n in pipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and set(results) == {"a", "b"}
    for name in ("a", "b"):
        out, sequence = results[name]
        assert sequence == solo[name][1], (name, sequence)
        assert torch.equal(out, solo[name][0]), name
    assert results["a"][1][:2] == [(0, "fp8"), (0, "fp8")] and results["b"][1][:2] == [(0, "native"), (0, "native")]
    assert fx_fp8.current_step() is None  # nothing leaked into this thread


def test_compile_kwargs_are_checked_before_anything_changes():
    pipe = _toy()
    linear = pipe.transformer.to_qkv
    with pytest.raises(ValueError, match="unknown torch.compile keyword 'fullgrap'"):
        compile_pipeline(pipe, compile_kwargs={"fullgrap": True})
    with pytest.raises(ValueError, match="invalid mode 'fastest'"):
        compile_pipeline(pipe, compile_kwargs={"mode": "fastest"})
    assert pipe.transformer.to_qkv is linear and not hasattr(pipe, "_fx_fp8")


def test_mode_keyword_reaches_the_backend_options(monkeypatch):
    """compile_pipeline(pipe, mode=...) is compile_kwargs={"mode": ...}: torch.compile gets it inside
    the backend's options (it refuses mode= with options=)."""
    calls = []
    real = torch.compile

    @functools.wraps(real)  # compile_pipeline checks keywords against torch.compile's signature
    def spy(model, **kw):
        calls.append(kw)
        return real(model, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    compile_pipeline(_toy(), mode="max-autotune")
    (kw,) = calls
    assert kw["options"]["mode"] == "max-autotune" and "mode" not in kw and kw["backend"] == "fp8"
    with pytest.raises(ValueError, match="invalid mode 'fastest': expected one of default, reduce-overhead"):
        compile_pipeline(_toy(), mode="fastest")
    with pytest.raises(ValueError, match=r"mode='default' and compile_kwargs\['mode'\]='max-autotune' disagree"):
        compile_pipeline(_toy(), mode="default", compile_kwargs={"mode": "max-autotune"})
    compile_pipeline(_toy(), mode="default", compile_kwargs={"mode": "default", "dynamic": False})
    assert calls[-1]["options"]["mode"] == "default" and calls[-1]["dynamic"] is False


@pytest.mark.slow
def test_mode_with_a_non_default_config_works():
    """torch.compile refuses mode= together with options=: compile_pipeline passes the mode
    through the backend options (Inductor downstream)."""
    pipe = compile_pipeline(_toy(), diffusion_kv_cache_skip_steps="1", compile_kwargs={"mode": "default"})
    pipe(num_inference_steps=2)
    reports = pipeline_state(pipe).reports()["transformer"]
    assert reports  # not vacuous: all() of nothing is True
    assert reports and all(r.downstream == "inductor" for r in reports)


def test_inductor_options_reach_the_backend_options_and_are_checked_first(monkeypatch):
    calls = []
    real = torch.compile

    @functools.wraps(real)
    def spy(model, **kw):
        calls.append(kw)
        return real(model, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    pipe = _toy()
    linear = pipe.transformer.to_qkv
    with pytest.raises(ValueError, match="unknown Inductor setting 'cpp_wraper'"):
        compile_pipeline(pipe, inductor_options={"cpp_wraper": True})
    with pytest.raises(ValueError, match="configure Inductor, but downstream is 'eager'"):
        compile_pipeline(pipe, inductor_options={"size_asserts": False}, downstream="eager")
    assert pipe.transformer.to_qkv is linear and not hasattr(pipe, "_fx_fp8") and not calls
    compile_pipeline(pipe, inductor_options={"size_asserts": False})
    (kw,) = calls
    assert kw["options"]["inductor_options"] == {"size_asserts": False}
