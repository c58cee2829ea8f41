"""Two instances of one class share a Dynamo graph: each must still use its own weights."""

import warnings

import pytest
import torch

import fx_fp8
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_second_instance_uses_its_own_fp8_weights(static):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experts = [build_tiny_transformer("wan", seed=s) for s in (0, 1)]
    kw = example_inputs("wan", experts[0])
    options = {}
    if static:
        # one file for both experts would mix their scales: calibrate each on its own
        options = [
            {"quantization_config": {"activation_scheme": "static", "activation_scales": fx_fp8.calibrate(e, [kw])}}
            for e in experts
        ]
    compiled = []
    with torch.no_grad():
        for i, expert in enumerate(experts):
            eager = output_tensor(expert(**kw))
            opts = options[i] if static else {}
            compiled.append(torch.compile(expert, backend="fp8", options=opts))
            out = output_tensor(compiled[-1](**kw))
            err = _rel(out, eager)
            assert 1e-5 < err < 0.05, f"expert {i}: relative error {err:.4f} against its own eager output"
    # each expert has its own record, and its graph rewrote the linears
    for c in compiled:
        reports = fx_fp8.get_reports(c)
        assert len(reports) == 1 and reports[0].count("linear", "fp8") > 0
