"""The CUDA lowering's linear graphs executed on CPU: every `aten._scaled_mm` the lowering writes
into the graph handed to Inductor runs through a stand-in that refuses what CUDA's op refuses
(tests/helpers/scaled_mm_contract.py: torch's shape, dtype, stride, bias and flag rules), for each
weight granularity x activation scale form the lowering emits, with fast_accum on and off and with
and without bias; the outputs match the reference lowering's on the same graph, and the flags each
GEMM was given match the configuration (exact accumulation when fast_accum is false)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import cuda as cuda_mod
from fx_fp8.ops import cuda_graph_gemms
from cuda_on_cpu import cuda_on_cpu as patch_cuda_on_cpu
from graph_capture import Capture, compile_stored
from scaled_mm_contract import ScaledMM, ScaledMMContractError, run_with_stand_in

IN, OUT = 512, 256  # ceil(512 / 128) = 4 K blocks: the block-wise GEMM's 16-byte aligned scale rows


class BiasAndNoBias(nn.Module):
    """Two linears reading one input (one activation quantization), one with a bias, one without."""

    def __init__(self):
        super().__init__()
        self.with_bias = nn.Linear(IN, OUT, bias=True)
        self.without_bias = nn.Linear(IN, OUT, bias=False)

    def forward(self, x):
        return self.with_bias(x) + self.without_bias(x)


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    """The CUDA lowering's compile-time decisions for an sm90 GPU on CPU tensors; the graph it hands
    downstream kept, not compiled."""
    return patch_cuda_on_cpu(monkeypatch)


def _config(weights: str, acts: str, fast_accum: bool, tmp_path, model, x) -> dict:
    qc = {"weight_granularity": weights, "fast_accum": fast_accum}
    if acts == "static":
        path = tmp_path / "scales.json"
        fx_fp8.save_activation_scales(fx_fp8.calibrate(model, lambda m: m(x)), path)
        qc.update(activation_scheme="static", activation_scales=str(path))
    else:
        qc["activation_granularity"] = acts
    return qc


#: (weight granularity, activation scales) -> the torch._scaled_mm recipe the lowering must emit;
#: dynamic activations with block weights are quantized per 1x128 group whatever their granularity
#: (the block-wise GEMM's recipe); static ones keep fx_fp8's opaque op (next test)
FORMS = {
    ("tensor", "static"): "tensorwise",
    ("tensor", "tensor"): "tensorwise",
    ("tensor", "token"): "rowwise",
    ("channel", "static"): "rowwise",
    ("channel", "tensor"): "rowwise",
    ("channel", "token"): "rowwise",
    ("block", "tensor"): "block_1x128_128x128",
    ("block", "token"): "block_1x128_128x128",
}


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "exact"])
@pytest.mark.parametrize("weights, acts", list(FORMS))
def test_graph_gemms_keep_torch_contract_and_match_the_reference(
    weights, acts, fast_accum, cuda_on_cpu, tmp_path, monkeypatch
):
    torch.manual_seed(0)
    model = BiasAndNoBias().to(torch.bfloat16)
    x = torch.randn(6, IN, dtype=torch.bfloat16)  # 6 rows: the block form pads them to a multiple of 4
    cap = Capture()
    torch.compile(model, backend=cap)(x)
    gm, inputs = cap.graphs[0]
    cfg = FP8Config.from_kwargs(
        quantization="fp8", quantization_config=_config(weights, acts, fast_accum, tmp_path, model, x)
    )

    reference, _ = compile_stored(gm, inputs, cfg)
    _, report = compile_stored(gm, inputs, cfg, lowering="cuda")
    cuda_gm, cuda_inputs = cuda_on_cpu[-1]
    stand_in = ScaledMM()
    assert run_with_stand_in(cuda_gm, stand_in) == 2, "one torch._scaled_mm per FP8 linear in the graph"
    got = cuda_gm(*cuda_inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = reference(*inputs)
    want = want[0] if isinstance(want, (tuple, list)) else want

    recipe = FORMS[weights, acts]
    assert [c.recipe for c in stand_in.calls] == [recipe, recipe]
    exact = recipe.startswith("block") or not fast_accum  # the block-wise GEMM always runs exact
    assert [c.use_fast_accum for c in stand_in.calls] == [not exact] * 2, (
        "the GEMM's accumulation must be the configured one"
    )
    assert sorted(c.bias_dtype is not None for c in stand_in.calls) == [False, True] or recipe != "rowwise"
    entries = [e for e in report.entries if e.action == "fp8"]
    assert len(entries) == 2
    assert all(("exact accumulation" in e.reason) == (exact and not recipe.startswith("block")) for e in entries)
    # bf16 GEMM outputs against the reference's fp32 ones: a few bf16 ulps
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.isfinite(got).all() and got.abs().max() > 0


def test_block_weights_with_static_activations_run_the_block_gemm_through_the_opaque_op(
    cuda_on_cpu, tmp_path, monkeypatch
):
    """Block weights with a calibrated per-tensor activation scale: the graph keeps fx_fp8's op (the
    report says so), and its eager call runs the block-wise torch._scaled_mm with that scale for every
    1x128 group, rather than failing there and switching every block linear of the device to the
    dequantizing fallback."""
    torch.manual_seed(0)
    model = BiasAndNoBias().to(torch.bfloat16)
    x = torch.randn(6, IN, dtype=torch.bfloat16)
    cap = Capture()
    torch.compile(model, backend=cap)(x)
    gm, inputs = cap.graphs[0]
    cfg = FP8Config.from_kwargs(
        quantization="fp8", quantization_config=_config("block", "static", True, tmp_path, model, x)
    )
    reference, _ = compile_stored(gm, inputs, cfg)
    _, report = compile_stored(gm, inputs, cfg, lowering="cuda")
    cuda_gm, cuda_inputs = cuda_on_cpu[-1]
    stand_in = ScaledMM()
    assert run_with_stand_in(cuda_gm, stand_in) == 0
    assert sum(1 for n in cuda_gm.graph.nodes if "fx_fp8" in str(n.target)) >= 2
    assert any(True for e in report.entries if e.action == 'fp8')  # not vacuous: all() of nothing is True
    assert all("opaque op" in e.reason for e in report.entries if e.action == "fp8")
    monkeypatch.setattr(cuda_graph_gemms, "_MM", stand_in)
    monkeypatch.setattr(cuda_mod.LOWERING, "_blockwise_failed", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback's warning would fail here
        got = cuda_gm(*cuda_inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = reference(*inputs)
    want = want[0] if isinstance(want, (tuple, list)) else want
    assert [c.recipe for c in stand_in.calls] == ["block_1x128_128x128"] * 2
    assert cuda_mod.LOWERING._blockwise_failed == {}
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("weights, acts", list(FORMS) + [("block", "static")])
def test_every_form_keeps_torch_contract(weights, acts, monkeypatch):
    """The forms themselves (what the graph holds, called eagerly by the CUDA lowering), fast: each
    scale form x output dtype x accumulation, with and without bias, through the stand-in, against
    exact math on the same quantized operands."""
    from fx_fp8.ops import quant

    stand_in = ScaledMM()
    monkeypatch.setattr(cuda_graph_gemms, "_MM", stand_in)
    monkeypatch.setattr(cuda_mod, "capability", lambda device=None: (9, 0))
    torch.manual_seed(0)
    x, w, b = torch.randn(6, IN), torch.randn(OUT, IN), torch.randn(OUT)
    if acts == "static":
        xq, xs = quant.quantize_activation_static(x, torch.tensor(0.03), "fp8")
    elif weights == "block":
        xq, xs = quant.quantize_activation(x, "group", "fp8", group=128)
    else:
        xq, xs = quant.quantize_activation(x, acts, "fp8")
    block = (128, 128) if weights == "block" else None
    wq, ws = quant.quantize_weight(w, weights, block, "fp8")
    exact = quant.dequantize_activation(xq, xs, group=128) @ quant.dequantize_weight(wq, ws, weights, block).t()
    flags = []
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fast_accum in (True, False):
            for bias in (None, b.to(out_dtype)):
                got = cuda_mod.LOWERING.scaled_mm(
                    xq,
                    xs,
                    wq,
                    ws,
                    bias,
                    method="fp8",
                    weight_granularity=weights,
                    weight_block=block or (128, 128),
                    out_dtype=out_dtype,
                    fast_accum=fast_accum,
                )
                assert got.dtype == out_dtype
                torch.testing.assert_close(got.float(), exact + (b if bias is not None else 0), rtol=1e-2, atol=2e-2)
                flags.append(fast_accum and weights != "block")  # the block-wise GEMM always runs exact
    recipe = FORMS.get((weights, acts), "block_1x128_128x128")
    assert [c.recipe for c in stand_in.calls] == [recipe] * len(flags)
    assert [c.use_fast_accum for c in stand_in.calls] == flags


def _operands(m=8, k=64, n=32):
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()  # column-major, as a weight's transpose
    return a, b


@pytest.mark.parametrize(
    "break_it, message",
    [
        (
            lambda a, b, sa, sb: (a, b, sb.reshape(-1, 1), sa.reshape(1, -1)),
            "invalid scaling configuration",
        ),  # the activation and weight scale shapes swapped
        (lambda a, b, sa, sb: (a, b.contiguous(), sa, sb), "column-major"),
        (lambda a, b, sa, sb: (a, b, sa.double(), sb), "float32"),
        (lambda a, b, sa, sb: (a, b, sa, sb.reshape(-1, 1)), "invalid scaling configuration"),
    ],
)
def test_the_stand_in_refuses_what_cuda_refuses(break_it, message):
    torch.manual_seed(0)
    a, b = _operands()
    sa, sb = torch.rand(8, 1) + 0.5, torch.rand(1, 32) + 0.5
    ScaledMM()(a, b, sa, sb, None, None, torch.bfloat16, True)  # the correct call runs
    with pytest.raises(ScaledMMContractError, match=message):
        ScaledMM()(*break_it(a, b, sa, sb), None, None, torch.bfloat16, True)


def test_the_stand_in_refuses_bias_and_flag_misuse():
    torch.manual_seed(0)
    a, b = _operands()
    one = torch.ones(())
    with pytest.raises(ScaledMMContractError, match="float32"):
        ScaledMM()(a, b, one, one, torch.zeros(32, dtype=torch.bfloat16), None, torch.float32, False)
    with pytest.raises(ScaledMMContractError, match="bf16 for bf16"):
        ScaledMM()(a, b, one, one, torch.zeros(32, dtype=torch.float16), None, torch.bfloat16, False)
    a4, b4 = _operands(m=4, k=512, n=256)
    sa = torch.ones(4, 4).t().contiguous().t()  # outer-dim-major, strides (1, 4)
    sb = torch.ones(2, 4).t()  # scale_b.t() row-major
    ScaledMM()(a4, b4, sa, sb, None, None, torch.bfloat16, False)
    with pytest.raises(ScaledMMContractError, match="fast accumulation"):
        ScaledMM()(a4, b4, sa, sb, None, None, torch.bfloat16, True)
    with pytest.raises(ScaledMMContractError, match="invalid scaling configuration"):
        ScaledMM()(a4, b4, torch.ones(4, 4), sb, None, None, torch.bfloat16, False)  # row-major scale_a


def test_the_stand_in_computes_what_the_scales_say():
    torch.manual_seed(0)
    a, b = _operands()
    sa, sb = torch.rand(8, 1) + 0.5, torch.rand(1, 32) + 0.5
    want = (a.double() * sa.double()) @ (b.double() * sb.double())
    torch.testing.assert_close(ScaledMM()(a, b, sa, sb, None, None, torch.float32, False), want.float())
    # and the CPU torch._scaled_mm agrees where it takes the recipe (tensor-wise)
    s = torch.tensor(0.5)
    torch.testing.assert_close(
        ScaledMM()(a, b, s, s, None, None, torch.float32, False),
        torch._scaled_mm(a, b, s, s, out_dtype=torch.float32),
        rtol=1e-5,
        atol=1e-4,
    )
