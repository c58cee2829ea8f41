"""CUDA graphs (mode="reduce-overhead") on a GPU: with and without prepare_model, through
torch.compile and compile_pipeline. A capture that kept tensors it allocated outside the graph
fails at record time ("tensors in the cudagraph pool not tracked as outputs"); replays must be
deterministic; a weight written between replays must be followed (its quantized copy is
rewritten in place, outside the graph, so the recorded address stays valid). Marked cuda:
skipped without a GPU (the CPU side of the same contract is tests/compile/test_cuda_graph_readiness.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fx_fp8

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
TARGET = "transformer_blocks.0.ff.net.2"


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _flux():
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux").to("cuda", torch.bfloat16)
    kw = {
        k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.to("cuda"))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in example_inputs("flux", model).items()
    }
    return model, kw


def _replays(compiled, kw, n=3) -> list:
    outs = []
    for _ in range(n):
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(**kw)
        outs.append((out[0] if isinstance(out, tuple) else out.sample).clone())
    return outs


@pytest.mark.parametrize("prepared", [False, True], ids=["compile-time-copies", "prepared"])
def test_reduce_overhead_records_replays_and_follows_a_weight_write(prepared):
    model, kw = _flux()
    with torch.no_grad():
        native = model(**kw).sample
        if prepared:
            fx_fp8.prepare_model(model, quantization="fp8")
        default = torch.compile(model, backend="fp8")(**kw).sample
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fp8", mode="reduce-overhead")
        outs = _replays(compiled, kw)
    report = fx_fp8.get_reports(compiled)[-1]
    assert report.lowering == "cuda" and report.downstream == "inductor" and report.count("linear", "fp8") > 0
    assert torch.equal(outs[1], outs[2]), "replays are deterministic"
    assert rel(outs[2], default) < 1e-2 and rel(outs[2], native) < 0.1
    if prepared:
        return
    layer = model.get_submodule(TARGET)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place on the parameter: its quantized copy is rewritten in place
        after = _replays(compiled, kw, 2)
    torch._dynamo.reset()
    with torch.no_grad():
        eager_fp8 = torch.compile(model, backend="fp8")(**kw).sample
    assert rel(outs[2], after[1]) > 1e-3, "the write must change the output"
    assert rel(after[1], eager_fp8) < 1e-2, "the replay read the rewritten copy"
    assert torch.equal(after[0], after[1])


@pytest.mark.parametrize("prepare", [True, False])
def test_compile_pipeline_with_reduce_overhead(prepare):
    from fx_fp8.tools.model_zoo.pipelines import tiny_flux

    pipe, kwargs = tiny_flux()
    pipe.to("cuda", torch.bfloat16)
    kwargs = {k: v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def run():
        out = pipe(
            **kwargs, num_inference_steps=3, output_type="latent", generator=torch.Generator("cuda").manual_seed(0)
        ).images
        return out.clone()

    with torch.no_grad():
        native = run()
        fx_fp8.compile_pipeline(pipe, prepare=prepare, compile_kwargs={"mode": "reduce-overhead"})
        first, second, third = run(), run(), run()  # warm-up and recording, then replays
    state = fx_fp8.pipeline_state(pipe)
    assert any(r.count("linear", "fp8") > 0 for rs in state.reports().values() for r in rs)
    assert torch.equal(second, third), "replays are deterministic"
    assert rel(first, native) < 0.1 and rel(third, first) < 1e-2
