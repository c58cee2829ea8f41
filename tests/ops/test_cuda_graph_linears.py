"""The CUDA lowering's linears as Inductor sees them, checked on CPU: the graph handed to the
downstream compiler holds, per FP8 linear, the activation quantization as plain ops and one
aten._scaled_mm on a quantized weight and scale that are graph inputs (appended by fx_fp8,
flagged static for CUDA graphs, or a prepared layer's own parameters): no fx_fp8 custom op and
no weight lookup at run time. (The GEMMs themselves run on a GPU: tests marked cuda.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import quant
from fx_fp8.ops.cuda_graph_gemms import blockwise_gemm, rowwise_gemm, tensorwise_gemm
from fx_fp8.quant.weight_feeds import STATIC_INPUT, Fed
from cuda_on_cpu import cuda_on_cpu as patch_cuda_on_cpu
from graph_capture import Capture, compile_stored

SCALED_MM = torch.ops.aten._scaled_mm.default


class ThreeLinears(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.a = nn.Linear(64, 128, bias=bias)
        self.b = nn.Linear(64, 128, bias=bias)  # reads the same input as a: one quantization for both
        self.c = nn.Linear(128, 64, bias=bias)

    def forward(self, x):
        return self.c(torch.relu(self.a(x)) * self.b(x))


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    """The CUDA lowering's compile-time decisions on CPU tensors of an sm90 GPU, and the graph
    it hands downstream kept instead of compiled."""
    return patch_cuda_on_cpu(monkeypatch)


def _rewritten(model, x, kept, **config):
    cap = Capture()
    torch.compile(model, backend=cap)(x)
    gm, inputs = cap.graphs[0]
    cfg = FP8Config.from_kwargs(quantization="fp8", **config)
    fn, report = compile_stored(gm, inputs, cfg, lowering="cuda")
    return kept[-1][0], kept[-1][1], fn, report


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _fx_fp8_ops(gm) -> list:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "fx_fp8" in str(n.target)]


def test_unprepared_linears_are_scaled_mm_on_appended_static_inputs(cuda_on_cpu):
    model = ThreeLinears().to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    gm, examples, fn, report = _rewritten(model, x, cuda_on_cpu)
    assert report.count("linear", "fp8") == 3
    assert _count(gm, SCALED_MM) == 3
    assert _fx_fp8_ops(gm) == [], "no opaque fx_fp8 op may stay in the CUDA linears' graph"
    appended = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("fx_fp8_")]
    assert len(appended) == 6  # a quantized weight and its scale per linear
    assert all(n.meta["tensor_dict"] == STATIC_INPUT for n in appended)
    assert [t.dtype for t in examples[-6:]].count(torch.float8_e4m3fn) == 3
    # one activation quantization per input read: a and b share x's, c has its own
    assert _count(gm, torch.Tensor.amax) + sum(1 for n in gm.graph.nodes if n.target == "amax") == 2
    # the GEMM reads the appended weight (transposed) and bias directly: nothing looks it up per call
    for n in gm.graph.nodes:
        if n.target == SCALED_MM:
            assert n.args[1].target in (torch.Tensor.t, "t") and n.args[1].args[0] in appended
            assert n.args[4] is not None and n.args[7] is True  # bias fused, fast accumulation
    assert isinstance(getattr(fn, "first", fn), Fed)
    assert "torch._scaled_mm in the graph (row-wise scales, fast accumulation)" in report.entries[0].reason


def test_prepared_linears_are_scaled_mm_on_their_own_parameters(cuda_on_cpu):
    model = ThreeLinears().to(torch.bfloat16)
    fx_fp8.prepare_model(model, quantization="fp8")
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    gm, examples, fn, report = _rewritten(model, x, cuda_on_cpu)
    assert _count(gm, SCALED_MM) == 3 and _fx_fp8_ops(gm) == []
    assert not [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("fx_fp8_")]
    # the prepared weights are checked once per call (outside the graph), by the feeder
    assert len(getattr(fn, "first", fn).feeder.prepared) == 3


def test_static_activations_with_tensor_weights_use_one_tensor_wise_gemm(cuda_on_cpu, tmp_path):
    model = ThreeLinears(bias=False).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    scales = fx_fp8.calibrate(model, lambda m: m(x))
    path = tmp_path / "scales.json"
    fx_fp8.save_activation_scales(scales, path)
    gm, examples, fn, report = _rewritten(
        model,
        x,
        cuda_on_cpu,
        quantization_config={
            "activation_scheme": "static",
            "activation_scales": str(path),
            "weight_granularity": "tensor",
        },
    )
    assert _count(gm, SCALED_MM) == 3 and _fx_fp8_ops(gm) == []
    assert any(True for e in report.entries if e.action == 'fp8')  # not vacuous: all() of nothing is True
    assert all("tensor-wise scales" in e.reason for e in report.entries if e.action == "fp8")


@pytest.mark.parametrize("xs_scalar, ws_scalar", [(False, False), (True, False), (False, True)])
def test_rowwise_form_matches_the_reference_numerics(xs_scalar, ws_scalar):
    """The row-wise form's scale layouts, run through CPU torch._scaled_mm where that takes row-wise
    scales (torch >= 2.13), against exact fp32 math on the same quantized operands."""
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32)
    xq, xs = (
        quant.quantize_activation_static(x, torch.tensor(0.02), "fp8")
        if xs_scalar
        else quant.quantize_activation(x, "token", "fp8")
    )
    wq, ws = quant.quantize_weight(w, "tensor" if ws_scalar else "channel", None, "fp8")
    exact = (xq.float() * xs) @ (wq.float() * ws).t() + b
    gemm = rowwise_gemm(xs_scalar, ws_scalar, True, torch.float32, False)
    try:
        got = gemm(xq, xs, wq, ws, b.to(torch.bfloat16))
    except RuntimeError as e:
        if "per-tensor" in str(e):
            pytest.skip(f"this torch's CPU _scaled_mm takes per-tensor scales only ({torch.__version__})")
        raise
    torch.testing.assert_close(got, exact, rtol=1e-2, atol=1e-2)  # bf16 GEMM output


def test_forms_trace_into_the_graph_without_python_branches_on_sizes():
    """insert_function traces each form once with torch.fx; a branch on a symbolic size would fail here."""
    from fx_fp8.graph.fx_utils import _traced

    for fn, n in [
        (rowwise_gemm(False, False, True, torch.bfloat16, True), 5),
        (rowwise_gemm(True, True, False, torch.float16, True), 4),
        (tensorwise_gemm(True, torch.float32, True), 5),
        (blockwise_gemm(True, torch.bfloat16), 5),
    ]:
        graph = _traced(fn, n)
        assert sum(1 for node in graph.nodes if node.target == SCALED_MM) == 1
