"""diffusion_kv_cache_skip_steps: two compiled variants, one Dynamo graph, picked per step."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import fx_fp8
from fx_fp8 import steps
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor


@pytest.fixture(scope="module")
def sd3():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("sd3")
    return model, example_inputs("sd3", model)


@pytest.fixture
def variants():
    """Records the variant each step-dispatching graph picks on each call (in this context)."""
    seen = []
    with steps.variant_listener(seen.append):
        yield seen


def loop(compiled, kw, n=6):
    outs = []
    with torch.no_grad():
        for i in range(n):
            with fx_fp8.denoising_step(i):
                outs.append(output_tensor(compiled(**kw)))
    return outs


@pytest.mark.slow
def test_skip_steps_two_variants_one_dynamo_graph(sd3, variants):
    model, kw = sd3
    counters.clear()
    compiled = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_steps": "0,1"})
    outs = loop(compiled, kw)
    assert len(fx_fp8.get_reports(compiled)) == 2
    # Dynamo converted one frame once: a single graph, no recompiles across the steps
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["total"] == counters["frames"]["ok"] == 1
    assert variants == ["native", "native", "fp8", "fp8", "fp8", "fp8"]
    reports = fx_fp8.get_reports(compiled)
    assert [r.step_variant for r in reports] == ["fp8", "native"]
    by_variant = {r.step_variant: r for r in reports}
    assert by_variant["native"].count("attention", "fp8") == 0
    assert by_variant["native"].count("attention", "native") == by_variant["fp8"].count("attention", "fp8") == 2
    assert all("skipped step variant" in e.reason for e in by_variant["native"].entries if e.op == "attention")
    # linears are FP8 in both variants
    assert by_variant["native"].count("linear", "fp8") == by_variant["fp8"].count("linear", "fp8") > 0
    # the same inputs give two different outputs: native attention at steps 0-1, FP8 after
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[5])
    assert not torch.equal(outs[1], outs[2])

    # a second request: no new graph at all
    outs2 = loop(compiled, kw)
    assert len(fx_fp8.get_reports(compiled)) == 2
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["total"] == 1
    assert variants[6:] == variants[:6]
    assert outs  # not vacuous: all() of nothing is True
    assert all(torch.equal(a, b) for a, b in zip(outs, outs2))

    # the variants equal separate compiles with attention off / with no step skips
    torch._dynamo.reset()
    native_attention = loop(torch.compile(model, backend="fp8", options={"quantization": "fp8"}), kw, n=1)[0]
    torch._dynamo.reset()
    all_fp8 = loop(torch.compile(model, backend="fp8"), kw, n=1)[0]
    assert torch.equal(outs[0], native_attention) and torch.equal(outs[2], all_fp8)


def test_no_skips_one_graph(sd3, variants):
    model, kw = sd3
    compiled = torch.compile(model, backend="fp8")
    outs = loop(compiled, kw, n=3)
    assert variants == []  # no dispatch at all
    (report,) = fx_fp8.get_reports(compiled)
    assert report.step_variant is None and report.count("attention", "fp8") == 2
    assert torch.equal(outs[0], outs[2])


@pytest.mark.slow
def test_unpublished_step_warns_once_per_compiled_model_and_runs_native(sd3, variants):
    model, kw = sd3
    compiled = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_steps": "3"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = output_tensor(compiled(**kw))
            compiled(**kw)
    msgs = [str(i.message) for i in w if "no denoising step was published" in str(i.message)]
    assert len(msgs) == 1 and "running the skipped-step graph" in msgs[0]
    assert variants == ["native", "native"]
    with torch.no_grad(), fx_fp8.denoising_step(3):
        assert torch.equal(output_tensor(compiled(**kw)), out)  # step 3 is skipped: same native variant
    assert variants[-1] == "native"
    # a second compiled model warns for itself (not once per process)
    torch._dynamo.reset()
    other = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_steps": "3"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            other(**kw)
    assert sum("no denoising step was published" in str(i.message) for i in w) == 1


def test_set_step_and_context():
    assert fx_fp8.current_step() is None
    fx_fp8.set_step(4)
    with fx_fp8.denoising_step(7):
        assert fx_fp8.current_step() == 7
    assert fx_fp8.current_step() == 4
    with pytest.raises(RuntimeError), fx_fp8.denoising_step(1):
        raise RuntimeError
    assert fx_fp8.current_step() == 4
    for bad in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match=f"invalid denoising step {bad!r}"):
            fx_fp8.set_step(bad)
    fx_fp8.set_step(None)
    assert fx_fp8.current_step() is None


def test_variant_for_step():
    told = []
    fx_fp8.set_step(2)
    assert steps.variant_for_step(frozenset({2}), lambda: told.append(1)) == "native"
    assert steps.variant_for_step(frozenset({0, 1}), lambda: told.append(1)) == "fp8"
    fx_fp8.set_step(None)
    assert steps.variant_for_step(frozenset({0}), lambda: told.append(1)) == "native" and told == [1]


def test_steps_are_per_thread():
    import threading

    fx_fp8.set_step(5)
    seen = {}

    def worker():
        seen["start"] = fx_fp8.current_step()  # a new thread has nothing published
        with fx_fp8.denoising_step(0):
            seen["inside"] = fx_fp8.current_step()
            barrier.wait()
            barrier.wait()

    barrier = threading.Barrier(2)
    t = threading.Thread(target=worker)
    t.start()
    barrier.wait()
    assert fx_fp8.current_step() == 5  # the other thread's step does not leak here
    barrier.wait()
    t.join()
    assert seen == {"start": None, "inside": 0}


def test_publish_steps_counts_each_pipeline_call_from_zero():
    """Outside compile_pipeline, `with publish_steps(pipe):` publishes the step of every pipeline
    call in the block, each from 0 (it once counted on across calls: 0..5 for two 3-step calls)."""
    from fx_fp8.tools.model_zoo.pipelines import tiny_flux

    pipe, kwargs = tiny_flux()
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda *_: seen.append(fx_fp8.current_step()))
    base = type(pipe)
    with torch.no_grad(), fx_fp8.publish_steps(pipe):
        for _ in range(2):
            pipe(**kwargs, num_inference_steps=3, output_type="latent")
    assert seen == [0, 1, 2, 0, 1, 2]
    assert type(pipe) is base and fx_fp8.current_step() is None  # the block leaves the pipeline as it was
