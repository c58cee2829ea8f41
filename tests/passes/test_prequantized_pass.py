"""The pre-quantized pass (fx_fp8/passes/prequantized.py): linears on FP8 weights that a module dequantizes
in its forward (diffusers' BFL fp8r layer, a module holding a ModelOpt FP8 export) become prepared
FP8 linears on the stored bytes; look-alikes that are something else stay as they are."""

import collections
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8.compile.graph_copies import copy_graph as _copy_graph
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.names import LayerMap, module_name
from fx_fp8.ops import quant
from fx_fp8.ops.lowering import get_lowering
from fx_fp8.ops.reference import ReferenceLowering
from fx_fp8.passes.base import compile_contexts
from fx_fp8.passes.manager import PassManager
from fx_fp8.passes.prequantized import PrequantizedLinearPass
from fx_fp8.passes.base import WEIGHT_ORIGIN
from fx_fp8.graph.forms import LINEAR_TARGETS
from fx_fp8.passes.prequantized import find_prequantized
from fx_fp8.report import CompileReport
from fx_fp8.quant.weight_state import compile_quantizations
from graph_capture import Capture, compile_stored, graph_module_of
from prequantized_layouts import (
    FP8,
    bfl_checkpoint,
    bfl_flux,
    bfl_stack,
    fake_quant_input,
    float_stack,
    modelopt_stack,
    modelopt_state_dict,
)

QLINEAR = torch.ops.fx_fp8.quantized_linear.default
SCALED_MM = torch.ops.fx_fp8.scaled_mm.default
DIMS = (64, 96, 64)
BFL_ORIGIN = "BFL fp8r checkpoint (per-channel weight scales)"


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def capture(module, x):
    """(Dynamo's graph of module(x), its example inputs)."""
    cap = Capture()
    with torch.no_grad():
        torch.compile(module, backend=cap, fullgraph=True)(x)
    ((gm, inputs),) = cap.graphs
    return gm, inputs


def op_counts(gm) -> collections.Counter:
    """How many call nodes of each target the graph holds (method names for call_method)."""
    return collections.Counter(
        n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method")
    )


def run_pass(gm, inputs, **options):
    """(rewritten copy of gm, number rewritten) after the pre-quantized pass alone (reference lowering)."""
    graph = _copy_graph(gm)
    cfg = FP8Config.from_kwargs(**{"quantization": "fp8", **options})
    names = [module_name(n) for n in graph.graph.nodes]
    contexts = compile_contexts(
        graph,
        inputs,
        cfg,
        get_lowering("reference"),
        CompileReport(backend="fp8", lowering="reference", downstream="eager", step_variant=None),
        LayerMap.from_graph([], names),
        lambda m: None,
    )
    manager = PassManager([PrequantizedLinearPass])
    manager.run(*contexts)
    return graph, manager.counts["prequantized_linear"]


def prepared_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == QLINEAR]


def placeholder_tensor(gm, inputs, node):
    return inputs[[n for n in gm.graph.nodes if n.op == "placeholder"].index(node)]


@pytest.fixture
def bfl():
    """(BFLFP8RLinear stack holding an fp8r checkpoint, the checkpoint, an input), bf16."""
    sd = bfl_checkpoint(float_stack(DIMS))
    return bfl_stack(sd, 2, DIMS), sd, torch.randn(3, 5, DIMS[0], dtype=torch.bfloat16)


def test_bfl_layers_become_prepared_fp8_linears_on_their_stored_weights(bfl):
    model, sd, x = bfl
    gm, inputs = capture(model, x)
    before = op_counts(gm)
    assert before["linear"] == 2 and before["mul"] == 2 and before["float"] == 2  # w.float() * scale[:, None]
    after, rewritten = run_pass(gm, inputs)
    counts = op_counts(after)
    assert rewritten == 2
    assert counts["linear"] == 0 and counts["mul"] == 0 and counts["quantized_linear.default"] == 2
    assert counts["getitem"] == 0 and counts["to"] == 0  # the dequantization is gone, not left dead
    for i, node in enumerate(prepared_nodes(after)):
        x_arg, w_arg, scale_arg, bias_arg, input_scale, smoothing = node.args
        assert w_arg.op == "placeholder" and placeholder_tensor(after, inputs, w_arg) is model.layers[i].weight
        assert placeholder_tensor(after, inputs, w_arg).data_ptr() == sd[f"layers.{i}.weight"].data_ptr()
        assert input_scale is None and smoothing is None and bias_arg.op == "placeholder"
        assert node.kwargs["method"] == "fp8" and node.kwargs["weight_granularity"] == "channel"
        assert node.kwargs["act_granularity"] == "token"
        assert node.meta[WEIGHT_ORIGIN] == BFL_ORIGIN
        assert module_name(node) == f"layers.{i}"


@pytest.mark.parametrize(
    "per_channel,static,scale_shape,origin",
    [
        (False, True, (), "(per-tensor weight scales, static input scale)"),
        (False, False, (1,), "(per-tensor weight scales)"),
        (True, False, None, "(per-channel weight scales)"),
        (True, True, (-1, 1), "(per-channel weight scales, static input scale)"),
    ],
)
def test_modelopt_layouts(per_channel, static, scale_shape, origin):
    x = torch.randn(3, 5, DIMS[0], dtype=torch.bfloat16)
    layer = float_stack(DIMS[:2])
    sd = modelopt_state_dict(layer, per_channel=per_channel, static_x=x if static else None, scale_shape=scale_shape)
    model = modelopt_stack(sd, 1)
    gm, inputs = capture(model, x)
    before = op_counts(gm)
    after, rewritten = run_pass(gm, inputs)
    counts = op_counts(after)
    assert rewritten == 1 and counts["linear"] == 0 and counts["quantized_linear.default"] == 1
    assert counts["mul"] == 0 and counts["clamp"] == 0 and counts["truediv"] == 0
    assert before["clamp"] == (1 if static else 0)
    (node,) = prepared_nodes(after)
    x_arg, w_arg, _, _, input_scale, _ = node.args
    assert x_arg.op == "placeholder" and placeholder_tensor(after, inputs, x_arg) is x  # the raw input
    assert placeholder_tensor(after, inputs, w_arg).data_ptr() == sd["layers.0.weight"].data_ptr()
    assert (input_scale is not None) == static
    if static:  # the stored static scale, through a view and a no-op fp32 cast
        assert (
            placeholder_tensor(after, inputs, input_scale.all_input_nodes[0].all_input_nodes[0])
            is model.layers[0].input_scale
        )
    assert node.kwargs["weight_granularity"] == ("channel" if per_channel else "tensor")
    assert node.meta[WEIGHT_ORIGIN] == f"pre-quantized FP8 weights of ModelOptLayoutLinear {origin}"


class Dequant(nn.Module):
    """linear(x, dequantize(w, s), b) with the dequantization given as a function: look-alikes."""

    def __init__(self, weight, scale, dequant, bias=True):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = nn.Parameter(torch.randn(weight.shape[0]), requires_grad=False) if bias else None
        self.dequant = dequant

    def forward(self, x):
        return F.linear(x, self.dequant(self.weight, self.scale), self.bias)


def _w(n=48, k=64, dtype=FP8):
    return (torch.randn(n, k) * 4).to(dtype)


LOOK_ALIKES = {
    "bf16 weight": (lambda: _w(dtype=torch.bfloat16), lambda: torch.rand(48), lambda w, s: w.float() * s[:, None]),
    "e5m2 weight": (lambda: _w(dtype=torch.float8_e5m2), lambda: torch.rand(48), lambda w, s: w.float() * s[:, None]),
    "int8 weight": (
        lambda: torch.randint(-127, 127, (48, 64), dtype=torch.int8),
        lambda: torch.rand(48),
        lambda w, s: w.float() * s[:, None],
    ),
    "scale over columns": (lambda: _w(), lambda: torch.rand(64), lambda w, s: w.float() * s),
    "row scale used as column scale": (lambda: _w(64, 64), lambda: torch.rand(64), lambda w, s: w.float() * s[None, :]),
    "scale of another shape": (lambda: _w(), lambda: torch.rand(48, 2), lambda w, s: w.float() * s[:, :1]),
    "one more factor": (lambda: _w(), lambda: torch.rand(48), lambda w, s: (w.float() * s[:, None]) * 2.0),
    "an offset": (lambda: _w(), lambda: torch.rand(48), lambda w, s: w.float() * s[:, None] + 0.5),
    "abs of the weight": (lambda: _w(), lambda: torch.rand(48), lambda w, s: w.float().abs() * s[:, None]),
    "computed scale": (lambda: _w(), lambda: torch.rand(48), lambda w, s: w.float() * (s * 2)[:, None]),
    "transposed weight": (lambda: _w(64, 64), lambda: torch.rand(64), lambda w, s: w.float().t() * s[:, None]),
    "fp64 scale": (
        lambda: _w(),
        lambda: torch.rand(48, dtype=torch.float64),
        lambda w, s: (w.double() * s[:, None]).float(),
    ),
}


@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_look_alikes_are_left_alone(case):
    weight, scale, dequant = LOOK_ALIKES[case]
    model = Dequant(weight(), scale(), dequant)
    gm, inputs = capture(model, torch.randn(2, 64))
    (linear,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
    assert find_prequantized(linear) is None
    after, rewritten = run_pass(gm, inputs)
    assert rewritten == 0 and op_counts(after) == op_counts(gm)


def _static(x, s_div, s_mul, lo=-448.0, hi=448.0):
    return (x / s_div).clamp(lo, hi).to(FP8).to(x.dtype) * s_mul


class FakeQuantInput(nn.Module):
    """A pre-quantized linear whose input goes through `fq(x, s1, s2)` first."""

    def __init__(self, fq):
        super().__init__()
        self.weight = nn.Parameter(_w(), requires_grad=False)
        self.register_buffer("weight_scale", torch.rand(48) / 100)
        self.register_buffer("s1", torch.tensor(0.01))
        self.register_buffer("s2", torch.tensor(0.02))
        self.fq = fq

    def forward(self, x):
        return F.linear(self.fq(x, self.s1, self.s2), self.weight.float() * self.weight_scale[:, None])


@pytest.mark.parametrize(
    "case,fq",
    [
        ("two different scales", lambda x, a, b: _static(x, a, b)),
        ("another clamp range", lambda x, a, b: _static(x, a, a, -400.0, 400.0)),
        ("no clamp", lambda x, a, b: (x / a).to(FP8).to(x.dtype) * a),
        ("e5m2 cast", lambda x, a, b: (x / a).clamp(-448.0, 448.0).to(torch.float8_e5m2).to(x.dtype) * a),
    ],
)
def test_input_look_alikes_keep_their_fake_quantization(case, fq):
    """The weight is still pre-quantized (rewritten), but the input's quantization is not a static
    scale the GEMM may take over: it stays in the graph and the prepared linear quantizes its result."""
    gm, inputs = capture(FakeQuantInput(fq), torch.randn(2, 64))
    before = op_counts(gm)
    after, rewritten = run_pass(gm, inputs)
    (node,) = prepared_nodes(after)
    assert rewritten == 1 and node.args[4] is None
    assert node.args[0].op != "placeholder"  # the fake-quantized value, not the raw input
    counts = op_counts(after)
    assert counts["truediv"] == before["truediv"] and counts["clamp"] == before["clamp"]
    assert counts["mul"] == before["mul"] - 1  # only the weight's dequantization went


def test_matched_static_scale_is_the_one_for_division_and_product():
    gm, inputs = capture(FakeQuantInput(lambda x, a, b: _static(x, a, a)), torch.randn(2, 64))
    after, _ = run_pass(gm, inputs)
    (node,) = prepared_nodes(after)
    assert node.args[4] is not None and node.args[0].op == "placeholder"
    assert op_counts(after)["clamp"] == 0 and op_counts(after)["truediv"] == 0


@pytest.mark.parametrize(
    "options,kept",
    [
        ({"quantization": None}, ["layers.0", "layers.1"]),
        ({"ignored_layers": ["layers.1"]}, ["layers.1"]),
        ({"quantization_config": {"min_features": 80}}, ["layers.0", "layers.1"]),
    ],
)
def test_layers_the_config_keeps_native_stay_the_modules_forward(bfl, options, kept):
    model, _, x = bfl
    gm, inputs = capture(model, x)
    after, rewritten = run_pass(gm, inputs, **options)
    linears = [n for n in after.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
    assert sorted(module_name(n) for n in linears) == kept
    assert rewritten == 2 - len(kept) and op_counts(after)["mul"] == len(kept)  # their dequantization stays
    assert all(n.meta[WEIGHT_ORIGIN] == BFL_ORIGIN for n in linears)  # the row can still say what they hold


def _gemm_weights(monkeypatch, kind="scaled_mm"):
    """The weights every reference `kind` call (scaled_mm / weight_only_linear) receives (the tensors themselves)."""
    seen = []
    real = getattr(ReferenceLowering, kind)

    def recording(self, x, *args, **kw):
        seen.append(args[1] if kind == "scaled_mm" else args[0])
        return real(self, x, *args, **kw)

    monkeypatch.setattr(ReferenceLowering, kind, recording)
    return seen


def test_compiled_bfl_model_runs_fp8_gemms_on_the_checkpoint_bytes(bfl, monkeypatch):
    model, sd, x = bfl
    seen = _gemm_weights(monkeypatch)
    made = compile_quantizations(model)
    with torch.no_grad():
        eager = model(x)
        out = torch.compile(model, backend="fp8")(x)
    assert compile_quantizations(model) == made  # nothing re-quantized
    assert [w.data_ptr() for w in seen] == [sd[f"layers.{i}.weight"].data_ptr() for i in range(2)]
    assert seen  # not vacuous: all() of nothing is True
    assert all(
        w.dtype == FP8 and torch.equal(w.view(torch.uint8), sd[f"layers.{i}.weight"].view(torch.uint8))
        for i, w in enumerate(seen)
    )
    assert rel(out, eager) < 0.08  # per-token FP8 activations against the bf16 dequantized forward
    # the first layer alone, against dequantize(W) @ x with x quantized per token as the GEMM takes it
    layer = model.layers[0]
    xq, xs = quant.quantize_activation(x.reshape(-1, DIMS[0]), "token")
    w = layer.weight.double() * layer.weight_scale.double()[:, None]
    expected = (xq.double() * xs.double()) @ w.t() + layer.bias.double()
    with torch.no_grad():
        first = torch.compile(layer, backend="fp8")(x)
    assert rel(first.reshape(-1, DIMS[1]), expected) < 0.005  # bf16 output rounding only


def test_compiled_static_modelopt_layer_matches_its_eager_forward_exactly(monkeypatch):
    """fp32, static input scale: the module's eager forward fake-quantizes x with the stored scale and
    multiplies by the dequantized stored weight; the FP8 GEMM multiplies the same e4m3 codes with the
    same scales, so only the summation order differs."""
    x = torch.randn(4, 6, DIMS[0])
    sd = modelopt_state_dict(float_stack(DIMS[:2], dtype=torch.float32), per_channel=False, static_x=x)
    model = modelopt_stack(sd, 1)
    seen = _gemm_weights(monkeypatch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model(x)
        out = torch.compile(model, backend="fp8")(x)
    assert [w.data_ptr() for w in seen] == [sd["layers.0.weight"].data_ptr()]  # an FP8 GEMM ran, on the stored bytes
    assert rel(out, eager) < 1e-5
    layer = model.layers[0]
    truth = fake_quant_input(x, layer.input_scale).double() @ (layer.weight.double() * layer.weight_scale.double()).t()
    assert rel(out, truth + layer.bias.double()) < 1e-5


def test_report_row_says_where_the_weights_came_from(bfl):
    model, _, x = bfl
    gm, inputs = capture(model, x)
    fn, report = compile_stored(gm, inputs, FP8Config.from_kwargs(quantization="fp8"))
    mm = [n for n in graph_module_of(fn).graph.nodes if n.op == "call_function" and n.target == SCALED_MM]
    assert mm  # not vacuous: all() of nothing is True
    assert len(mm) == 2 and all(n.meta[WEIGHT_ORIGIN] == BFL_ORIGIN for n in mm)
    rows = [e for e in report.entries if e.op == "linear"]
    assert [e.action for e in rows] == ["fp8", "fp8"]


def test_report_text_names_the_checkpoint(bfl):
    model, _, x = bfl
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        compiled(x)
    rows = [e for e in fx_fp8.get_reports(compiled)[-1].entries if e.op == "linear"]
    assert rows  # not vacuous: all() of nothing is True
    assert all(BFL_ORIGIN in e.reason for e in rows), [e.reason for e in rows]


def test_no_prepare_model_warning_for_checkpoint_layouts():
    x = torch.randn(2, 5, DIMS[0], dtype=torch.bfloat16)
    model = modelopt_stack(modelopt_state_dict(float_stack(DIMS[:2]), per_channel=False, static_x=x), 1)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(model, backend="fp8")(x)
    assert not [w for w in caught if "prepare_model" in str(w.message)]


def test_flux_loaded_through_diffusers_bfl_path(tmp_path, monkeypatch):
    """A tiny Flux written as an fp8r checkpoint (its block linears) and loaded by diffusers'
    from_single_file with BFLQuantizationConfig: every block linear runs an FP8 GEMM on the
    checkpoint's bytes except the adaLN modulation, which (sensitive) runs weight-only on them; the
    embedders and final projection, bf16 in this checkpoint, weight-only as the defaults say."""
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    from fx_fp8.tools.model_zoo.registry import example_inputs

    model, sd = bfl_flux(tmp_path)
    bfl = {n: m for n, m in model.named_modules() if isinstance(m, BFLFP8RLinear)}
    assert len(bfl) == 40
    kw = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in example_inputs("flux", model).items()}
    seen, seen_wo = _gemm_weights(monkeypatch), _gemm_weights(monkeypatch, "weight_only_linear")
    made = compile_quantizations(model)
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        eager = model(**kw).sample
        out = compiled(**kw).sample
    report = fx_fp8.get_reports(compiled)[-1]
    rows = {e.module: e for e in report.entries if e.op == "linear"}
    fp8 = {n for n, e in rows.items() if e.action == "fp8"}
    weight_only = {n for n, e in rows.items() if e.action == "weight-only"}
    modulation = {n for n in bfl if n.endswith(("norm1.linear", "norm1_context.linear", "norm.linear"))}
    assert fp8 == set(bfl) - modulation and len(modulation) == 6
    assert modulation <= weight_only  # sensitive: weight-only, on the stored weight
    assert {w.data_ptr() for w in seen} == {sd[f"{n}.weight"].data_ptr() for n in fp8}
    assert {sd[f"{n}.weight"].data_ptr() for n in modulation} <= {w.data_ptr() for w in seen_wo}
    # only the sensitive layers the checkpoint left in bf16 (embedders, final projection) were quantized here
    assert compile_quantizations(model) - made == len(weight_only - modulation) == 8
    assert rows["proj_out"].action == "weight-only" and not any(e.action == "native" for e in rows.values())
    assert rel(out, eager) < 0.03  # measured 0.0098: FP8 activations (linears and attention)


class SensitiveBFL(nn.Module):
    """A BFL fp8r layer named like a final projection (a sensitive layer)."""

    def __init__(self, layer):
        super().__init__()
        self.proj_out = layer

    def forward(self, x):
        return self.proj_out(x)


@pytest.mark.parametrize("sensitive,act", [("weight_only", "weight_only"), ("fp8", "token"), ("native", None)])
def test_sensitive_layers_follow_the_config_on_the_stored_weight(bfl, sensitive, act):
    model = SensitiveBFL(bfl[0].layers[0])
    gm, inputs = capture(model, bfl[2])
    after, rewritten = run_pass(gm, inputs, quantization_config={"sensitive": sensitive})
    nodes = prepared_nodes(after)
    assert rewritten == len(nodes) == (0 if act is None else 1)
    if act is not None:
        assert nodes[0].kwargs["act_granularity"] == act
        assert placeholder_tensor(after, inputs, nodes[0].args[1]) is model.proj_out.weight
