"""Never slower by the measurement: with a tune table that says FP8 loses at one shape, the CUDA
lowering's graph (checked on CPU, as tests/ops/test_cuda_graph_linears.py does) keeps that linear
native and the others FP8, counted by op target; a weight-only pick becomes the weight-only op;
`quantization_config.kernel: rules` ignores the table. prepare_model given example inputs takes the
same decision at the same M (the linear the table keeps native stays an nn.Linear); without them,
and at load time, it says the table was not applied."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.forms import LINEAR_TARGETS
from fx_fp8.ops import tune_table
from fx_fp8.quant import prepare
from fx_fp8.quant.layer_quantize import TABLE_NOT_APPLIED, layer_plan
from fx_fp8.quant.quantized_linear import QuantizedLinear
from cuda_on_cpu import cuda_on_cpu as patch_cuda_on_cpu
from graph_capture import Capture, compile_stored

SCALED_MM = torch.ops.aten._scaled_mm.default
WEIGHT_ONLY = torch.ops.fx_fp8.weight_only_linear.default


class ThreeShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.mix = nn.Linear(64, 64)

    def forward(self, x):
        return self.mix(self.down(torch.relu(self.up(x))))


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    """The CUDA lowering's compile-time decisions on CPU tensors; the graph it hands downstream kept."""
    return patch_cuda_on_cpu(monkeypatch)


def row(k, n, native, fp8, weight_only=9.0):
    return {
        "m": 8,
        "k": k,
        "n": n,
        "dtype": "bfloat16",
        "bias": True,
        "role": "w8a8",
        "candidates": {
            "native": {"ms": native, "err": 0.0},
            "fp8_rowwise": {"ms": fp8, "err": 0.03},
            "weight_only_int8": {"ms": weight_only, "err": 0.01},
        },
    }


def cpu_table(tmp_path, rows):
    """A table of this CPU (its key, as `fx-fp8 tune --dry-run` writes it), given as tune_table."""
    t = {
        "format": tune_table.FORMAT,
        "key": tune_table.device_key(torch.device("cpu")),
        "bar": 1.5,
        "source": {"what": "test", "date": "2026-12-07", "tool": "pytest"},
        "linears": rows,
        "attention": [],
    }
    return str(tune_table.write(t, tmp_path / "cpu.json"))


def compiled_graph(kept, prepare=False, model=None, **qc):
    model = ThreeShapes().to(torch.bfloat16) if model is None else model
    if prepare:
        fx_fp8.prepare_model(model, quantization="fp8", quantization_config={"min_features": 16})
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    cap = Capture()
    torch.compile(model, backend=cap)(x)
    gm, inputs = cap.graphs[0]
    cfg = FP8Config.from_kwargs(quantization="fp8", quantization_config={"min_features": 16, **qc})
    _, report = compile_stored(gm, inputs, cfg, lowering="cuda")
    return kept[-1][0], report


def count(gm, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def test_the_linear_fp8_loses_at_stays_native_and_the_others_run_fp8(cuda_on_cpu, tmp_path):
    path = cpu_table(tmp_path, [row(64, 128, 1.0, 0.6), row(128, 64, 1.0, 1.2), row(64, 64, 1.0, 0.8)])
    gm, report = compiled_graph(cuda_on_cpu, tune_table=path)
    assert count(gm, {SCALED_MM}) == 2 and count(gm, LINEAR_TARGETS) == 1
    rows = {e.module: e for e in report.entries if e.op == "linear"}
    assert rows["down"].action == "native" and rows["down"].timing == {"pick": 1.0, "native": 1.0}
    assert rows["down"].reason.startswith("tuned: native (no FP8 candidate more than 3% faster"), rows["down"].reason
    assert "fp8_rowwise 1.200 ms" in rows["down"].reason
    assert rows["up"].action == "fp8" and rows["up"].timing == {"pick": 0.6, "native": 1.0}
    assert rows["up"].reason.startswith(
        "tuned: fp8_rowwise (1.67x native); fp8_rowwise 0.600 ms, native 1.000 ms, "
        "weight_only_int8 9.000 ms (measured at M 8;"
    ), rows["up"].reason
    # the table is what decided: the fixed rules quantize all three
    gm, report = compiled_graph(cuda_on_cpu, tune_table=path, kernel="rules")
    assert count(gm, {SCALED_MM}) == 3 and count(gm, LINEAR_TARGETS) == 0


def test_a_weight_only_pick_runs_the_weight_only_op(cuda_on_cpu, tmp_path):
    path = cpu_table(tmp_path, [row(64, 128, 1.0, 0.6), row(128, 64, 1.0, 0.6), row(64, 64, 1.0, 0.8, 0.5)])
    gm, report = compiled_graph(cuda_on_cpu, tune_table=path)
    assert count(gm, {SCALED_MM}) == 2 and count(gm, {WEIGHT_ONLY}) == 1 and count(gm, LINEAR_TARGETS) == 0
    mix = next(e for e in report.entries if e.module == "mix")
    assert mix.action == "weight-only" and mix.reason.startswith("tuned: weight_only_int8 (2.00x native)")


def test_a_prepared_linear_runs_as_prepared_and_its_row_says_what_was_measured(cuda_on_cpu, tmp_path):
    """prepare_model freed the original weight: the table's native pick cannot be followed; the row says so."""
    path = cpu_table(tmp_path, [row(64, 128, 1.0, 0.6), row(128, 64, 1.0, 1.2), row(64, 64, 1.0, 0.8)])
    gm, report = compiled_graph(cuda_on_cpu, prepare=True, tune_table=path)
    assert count(gm, {SCALED_MM}) == 3
    rows = {e.module: e for e in report.entries if e.op == "linear"}
    assert rows["down"].action == "fp8" and "tuned: native (no FP8 candidate" in rows["down"].reason
    assert "quantized before compiling (prepare_model or a checkpoint), so it runs as they are" in rows["down"].reason
    assert "tuned" not in rows["up"].reason  # the table agrees with what runs: nothing to say


def prepared_model(path, example_inputs=None):
    model = ThreeShapes().to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    result = fx_fp8.prepare_model(
        model,
        quantization="fp8",
        lowering="cuda",
        quantization_config={"min_features": 16, "tune_table": path},
        example_inputs=(x,) if example_inputs else None,
    )
    return model, result


def test_prepare_model_keeps_native_the_linear_the_compiled_graph_keeps_native(cuda_on_cpu, tmp_path, recwarn):
    path = cpu_table(tmp_path, [row(64, 128, 1.0, 0.6), row(128, 64, 1.0, 1.2), row(64, 64, 1.0, 0.8)])
    model, result = prepared_model(path, example_inputs=True)
    # exactly the linear FP8 loses at keeps its original weight, as an nn.Linear
    assert type(model.down) is nn.Linear and model.down.weight.dtype == torch.bfloat16
    assert isinstance(model.up, QuantizedLinear) and isinstance(model.mix, QuantizedLinear)
    assert result["quantized"] == ["up", "mix"] and list(result["native"]) == ["down"]
    assert result["native"]["down"].startswith("tuned: native (no FP8 candidate more than 3% faster"), result
    assert result["tune_table"]["applied"] == ["up", "down", "mix"] and result["tune_table"]["not_applied"] == {}
    assert result["tune_table"]["source"].startswith(f"{path}: test (2026-12-07")
    # the compiled graph of the prepared model agrees: two FP8 matmuls, one native linear, nothing to say
    gm, report = compiled_graph(cuda_on_cpu, model=model, tune_table=path)
    assert count(gm, {SCALED_MM}) == 2 and count(gm, LINEAR_TARGETS) == 1
    rows = {e.module: e for e in report.entries if e.op == "linear"}
    assert rows["down"].action == "native" and rows["down"].reason.startswith("tuned: native")
    assert rows["up"].action == rows["mix"].action == "fp8"
    reasons = [e.reason for e in rows.values()]
    assert reasons and not any("quantized before compiling" in r for r in reasons), reasons
    assert not [w for w in recwarn if "fx_fp8" in str(w.message) and "prepare" in str(w.message)]


def test_prepare_model_makes_the_table_s_weight_only_pick_weight_only(cuda_on_cpu, tmp_path, recwarn):
    path = cpu_table(tmp_path, [row(64, 128, 1.0, 0.6), row(128, 64, 1.0, 0.6), row(64, 64, 1.0, 0.8, 0.5)])
    model, result = prepared_model(path, example_inputs=True)
    assert result["weight_only"] == ["mix"] and model.mix.weight_only and not model.up.weight_only
    gm, report = compiled_graph(cuda_on_cpu, model=model, tune_table=path)
    assert count(gm, {SCALED_MM}) == 2 and count(gm, {WEIGHT_ONLY}) == 1 and count(gm, LINEAR_TARGETS) == 0
    mix = next(e for e in report.entries if e.module == "mix")
    assert mix.action == "weight-only" and mix.reason.startswith("tuned: weight_only_int8 (2.00x native)"), mix.reason
    # the weight-only layer is the table's pick, not a recipe that disagrees with this compile's config
    assert not [w for w in recwarn if "prepared by prepare_model with another method" in str(w.message)]


def test_without_example_inputs_prepare_model_says_the_table_was_not_applied(cuda_on_cpu, tmp_path, caplog):
    path = cpu_table(tmp_path, [row(64, 128, 1.0, 0.6), row(128, 64, 1.0, 1.2), row(64, 64, 1.0, 0.8)])
    with caplog.at_level("INFO", logger="fx_fp8"):
        model, result = prepared_model(path)
    assert result["quantized"] == ["up", "down", "mix"]  # the rules: M is unknown
    assert result["tune_table"]["applied"] == []
    assert result["tune_table"]["not_applied"] == dict.fromkeys(["up", "down", "mix"], prepare.NO_EXAMPLE_INPUTS)
    assert "prepare_model did not apply the tune table" in caplog.text and "to 3 linear(s)" in caplog.text
    # no table for this device (kernel rules): nothing to say
    rules = fx_fp8.prepare_model(
        ThreeShapes().to(torch.bfloat16),
        quantization="fp8",
        lowering="cuda",
        quantization_config={"min_features": 16, "tune_table": path, "kernel": "rules"},
    )
    assert rules["tune_table"] is None and rules["quantized"] == ["up", "down", "mix"]


def test_load_time_quantization_records_that_the_table_was_not_applied(tmp_path, caplog):
    path = cpu_table(tmp_path, [row(128, 64, 1.0, 1.2)])
    cfg = FP8Config.from_kwargs(quantization="fp8", quantization_config={"min_features": 16, "tune_table": path})
    with caplog.at_level("INFO", logger="fx_fp8"):
        plan = layer_plan("down", 128, 64, torch.bfloat16, cfg, "cpu")
    assert (
        plan.w8a8
        and plan.reason
        == f"tune table not applied ({TABLE_NOT_APPLIED}): {path}: test (2026-12-07; "
        f"torch {torch.__version__}, Triton {tune_table.device_key(torch.device('cpu'))['triton']})"
    ), plan.reason
    assert "load-time quantization did not apply the tune table" in caplog.text
    # without a table the plan is the rules' own, nothing added
    assert layer_plan("down", 128, 64, torch.bfloat16, FP8Config.from_kwargs(quantization="fp8")).reason is None
