"""Two transformers of one class in one pipeline (Wan2.2's `transformer` and `transformer_2`):
each is its own model (reports, warnings, static scales, decisions), and the graphs compiled
are no more than backend="eager" compiles for the same run."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import fx_fp8
from fx_fp8 import pipeline_state
from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline
from fx_fp8.quant.weight_state import state_of

STEPS = 5


def _pipe():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_pipeline("wan2.2")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(pipe, kwargs):
    return pipe(
        **kwargs, num_inference_steps=STEPS, output_type="latent", generator=torch.Generator().manual_seed(0)
    ).frames


def _eager_graphs() -> int:
    pipe, kwargs = _pipe()
    torch._dynamo.reset()
    for attr in ("transformer", "transformer_2"):
        setattr(pipe, attr, torch.compile(getattr(pipe, attr), backend="eager"))
    with torch.no_grad():
        _run(pipe, kwargs)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    return graphs


@pytest.mark.slow
@pytest.mark.parametrize("prepare", [False, True], ids=["compile-only", "prepared"])
def test_two_experts_each_their_own_model(prepare):
    eager_graphs = _eager_graphs()
    pipe, kwargs = _pipe()
    with torch.no_grad():
        ref = _run(pipe, kwargs)
        # one calibration for both experts: the high-noise expert's inputs (names are shared)
        scales = fx_fp8.calibrate(pipe.transformer, lambda m: _run(pipe, kwargs))
    experts = {a: getattr(pipe, a) for a in ("transformer", "transformer_2")}
    fx_fp8.compile_pipeline(
        pipe,
        prepare=prepare,
        diffusion_kv_cache_skip_steps="0",
        quantization_config={"activation_scheme": "static", "activation_scales": scales},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = _run(pipe, kwargs)
    reports = pipeline_state(pipe).reports()
    # each expert has its own reports: two step variants each, every one rewriting linears
    assert sorted(reports) == ["transformer", "transformer_2"]
    assert all(len(r) == 2 and all(x.count("linear", "fp8") > 0 for x in r) for r in reports.values())
    # ... and its own static scales, on its own weights
    if not prepare:
        name = next(e.module for e in reports["transformer_2"][0].entries if e.op == "linear" and e.action == "fp8")
        for expert in experts.values():
            assert float(state_of(expert, expert.get_submodule(name).weight).input_scale) > 0
    assert not [w for w in caught if "no static activation scale" in str(w.message)]
    # no more Dynamo graphs than plain eager compiles of the same run (the prepare trace aside)
    assert counters["stats"]["unique_graphs"] - (2 if prepare else 0) <= eager_graphs
    assert _rel(out, ref) < 0.06
