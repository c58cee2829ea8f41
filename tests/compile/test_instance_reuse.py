"""Regional compilation without re-running the passes per block: an instance whose facts (what
the passes' decisions read through its names and inputs: layer selectors, ignored_layers hits,
static scales) equal an earlier instance's reuses that one's rewritten graph and renamed report,
and gets the per-weight work (quantized copy, static scale) done on its own weights. Every test
here also runs the passes for each reused instance (option check_reuse, here from FX_FP8_CHECK_REUSE) and fails on any
difference; each fact that can differ gets a block that differs, with its report row and the
kernel that really runs for it."""

import warnings

import pytest
import torch

import fx_fp8
from fx_fp8.compile.backend import CHECK_REUSE_ENV
from fx_fp8.report import ModelRecord
from fx_fp8.quant.weight_state import state_of
from fx_fp8.quant.linear_scales import method_scale
from fx_fp8.ops.lowering import get_lowering
from fx_fp8.ops import library

from checks import linear_rows
from toy_models import BLOCKS, compile_regionally, regional_toy, toy_inputs


@pytest.fixture(autouse=True)
def _check_reuse(monkeypatch):
    monkeypatch.setenv(CHECK_REUSE_ENV, "1")


@pytest.fixture
def plans():
    """A model's planned instances: {"passes": n, "reused": n} (its record counts them)."""
    return lambda model: dict(ModelRecord.of(model).plans)


@pytest.fixture
def kernels(monkeypatch):
    """What runs: the weights fx_fp8's quantized matmuls read (by op), FP8 attention calls."""
    seen = {"scaled_mm": [], "weight_only_linear": [], "attention": 0}
    lowering = type(get_lowering("reference"))
    real_mm, real_wo, real_attention = lowering.scaled_mm, lowering.weight_only_linear, library._attention

    def scaled_mm(self, xq, xs, wq, *args, **kwargs):
        seen["scaled_mm"].append(wq)
        return real_mm(self, xq, xs, wq, *args, **kwargs)

    def weight_only_linear(self, x2d, wq, *args, **kwargs):
        seen["weight_only_linear"].append(wq)
        return real_wo(self, x2d, wq, *args, **kwargs)

    def attention(*args, **kwargs):
        seen["attention"] += 1
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(lowering, "scaled_mm", scaled_mm)
    monkeypatch.setattr(lowering, "weight_only_linear", weight_only_linear)
    monkeypatch.setattr(library, "_attention", attention)
    return seen


def _fp8_linears(model, seen) -> set:
    """Names of the linears whose quantized copy reached fx_fp8::scaled_mm."""
    ids = {id(w) for w in seen["scaled_mm"]}
    found = set()
    for n, m in model.named_modules():
        st = state_of(model, m.weight) if isinstance(m, torch.nn.Linear) else None
        if st is not None and any(id(c.wq) in ids for c in st.copies.values()):
            found.add(n)
    return found


def _run(model, kw, **options):
    with torch.no_grad():
        compile_regionally(model, **options)(**kw)


def test_alike_instances_run_the_passes_once(plans, kernels, downstream_compiles):
    model, kw = regional_toy(), toy_inputs()
    _run(model, kw)
    assert plans(model) == {"passes": 1, "reused": BLOCKS - 1}
    assert len(downstream_compiles) == 1
    reports = fx_fp8.get_reports(model)
    assert len(reports) == BLOCKS
    # each report is its instance's: its names, its layer index
    for i, report in enumerate(reports):
        assert {e.module.split(".")[1] for e in report.entries} == {str(i)}
        assert {e.layer for e in report.entries} == {i}
    assert {f"blocks.{i}.{p}" for i in range(BLOCKS) for p in ("q", "fc1", "fc2")} <= _fp8_linears(model, kernels)
    for i in range(BLOCKS):  # every block's own weights were quantized, not only the planned one's
        assert state_of(model, model.blocks[i].fc1.weight).copies


def test_a_skipped_layer_gets_its_own_plan_and_runs_native_attention(plans, kernels, downstream_compiles):
    model, kw = regional_toy(), toy_inputs()
    _run(model, kw, diffusion_kv_cache_skip_layers="3")
    attention = {e.module: e for r in fx_fp8.get_reports(model) for e in r.entries if e.op == "attention"}
    assert attention["blocks.3"].action == "native"
    assert attention["blocks.3"].reason.startswith("layer 3 in diffusion_kv_cache_skip_layers; ")
    assert [attention[f"blocks.{i}"].action for i in range(BLOCKS) if i != 3] == ["fp8"] * (BLOCKS - 1)
    assert plans(model) == {"passes": 2, "reused": BLOCKS - 2}  # block 0, and block 3
    assert len(downstream_compiles) == 2
    kernels["attention"] = 0
    with torch.no_grad():
        model(**kw)
    assert kernels["attention"] == BLOCKS - 1  # block 3's attention ran native


@pytest.mark.parametrize("pattern, native", [("blocks.3.fc1", {3}), ("re:blocks\\.\\d+\\.fc1", set(range(BLOCKS)))])
def test_an_ignored_layer_pattern(pattern, native, plans, kernels):
    model, kw = regional_toy(), toy_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(model, kw, quantization_config={"ignored_layers": [pattern]})
    entries = linear_rows(fx_fp8.get_reports(model))
    for i in range(BLOCKS):
        e = entries[f"blocks.{i}.fc1"]
        ignored = f"ignored_layers pattern {pattern!r} (remove it from quantization_config.ignored_layers to quantize this layer)"
        assert (e.action, e.reason) == (("native", ignored) if i in native else ("fp8", e.reason)), (i, e.reason)
        assert (f"blocks.{i}.fc1" in _fp8_linears(model, kernels)) == (i not in native)
    # one pattern naming every block: one plan; naming one block: that block plans on its own
    assert plans(model) == (
        {"passes": 1, "reused": BLOCKS - 1} if len(native) == BLOCKS else {"passes": 2, "reused": BLOCKS - 2}
    )


def test_a_pattern_for_one_block_is_not_warned_about_but_a_typo_is(plans):
    """Block by block, "blocks.3.fc1" matches no linear in the other blocks' graphs: that is no
    mistake (it names a linear of the model). A pattern naming nothing in the model still is."""
    model, kw = regional_toy(), toy_inputs()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(model, kw, quantization_config={"ignored_layers": ["blocks.3.fc1", "blocks.3.fc9"]})
    unmatched = [str(w.message) for w in record if "matched no linear" in str(w.message)]
    assert unmatched  # not vacuous: all() of nothing is True
    assert unmatched and all("['blocks.3.fc9']" in m and "of the model" in m for m in unmatched), unmatched
    assert linear_rows(fx_fp8.get_reports(model))["blocks.3.fc1"].action == "native"


def test_static_scales_are_each_instances_own(plans, kernels, monkeypatch):
    # without the check (its passes would attach the scales too): the reuse alone must attach them
    monkeypatch.setenv(CHECK_REUSE_ENV, "0")
    model, kw = regional_toy(), toy_inputs()
    scales = {
        f"blocks.{i}.{p}": 0.01 * (i + 1) + 0.001 * j
        for i in range(BLOCKS)
        for j, p in enumerate(("q", "k", "v", "o", "fc1", "fc2"))
    }
    del scales["blocks.3.fc1"]  # block 3 has no calibrated scale for fc1: native there, and only there
    _run(model, kw, quantization_config={"activation_scheme": "static", "activation_scales": scales})
    entries = linear_rows(fx_fp8.get_reports(model))
    assert entries["blocks.3.fc1"].action == "native" and "no static activation scale" in entries["blocks.3.fc1"].reason
    assert "static activations" in entries["blocks.4.fc1"].reason
    assert "blocks.3.fc1" not in _fp8_linears(model, kernels) and "blocks.5.fc1" in _fp8_linears(model, kernels)
    assert plans(model) == {"passes": 2, "reused": BLOCKS - 2}
    for i in (0, 1, 2, 4, 5):  # each reused instance's weight carries its own layer's scale
        got = state_of(model, model.blocks[i].fc1.weight).input_scale.item()
        assert got == pytest.approx(method_scale(scales[f"blocks.{i}.fc1"], "fp8"))


def test_step_variants_are_reused_together(plans, downstream_compiles):
    model, kw = regional_toy(), toy_inputs()
    with torch.no_grad():
        compile_regionally(model, diffusion_kv_cache_skip_steps="0")
        for step in (0, 1):
            with fx_fp8.denoising_step(step):
                model(**kw)
    reports = fx_fp8.get_reports(model)
    assert len(reports) == 2 * BLOCKS and {r.step_variant for r in reports} == {"fp8", "native"}
    assert plans(model) == {"passes": 1, "reused": BLOCKS - 1}
    assert len(downstream_compiles) == 2  # one per variant, shared by every block


def test_a_plan_whose_passes_warned_is_not_carried_to_other_names(plans):
    """Prepared linears named by ignored_layers warn, naming the layers: such a plan is not
    reused under another instance's names (its warning would name the wrong block)."""
    model, kw = regional_toy(), toy_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.prepare_model(model, quantization="fp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, kw, quantization_config={"ignored_layers": ["re:blocks\\.\\d+\\.fc1"]})
    assert plans(model) == {"passes": BLOCKS, "reused": 0}
    named = [i for i in range(BLOCKS) if any(f"blocks.{i}.fc1 (pattern" in str(w.message) for w in caught)]
    assert named == list(range(BLOCKS))


def test_a_warning_that_names_no_layer_is_carried_to_every_instance(plans, kernels, monkeypatch):
    """A device without FP8 matrix units warns once, naming no layer: the plan is reused (the
    check compares the reused warnings with the passes' own) and every linear runs weight-only."""
    reference = type(get_lowering("reference"))
    monkeypatch.setattr(reference, "weight_only", lambda self, w, qcfg: "no FP8 matrix units here (test)")
    model, kw = regional_toy(), toy_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, kw)
    assert plans(model) == {"passes": 1, "reused": BLOCKS - 1}
    assert sum("no FP8 matrix units here (test)" in str(w.message) for w in caught) == 1  # once per model
    assert not kernels["scaled_mm"] and {id(w) for w in kernels["weight_only_linear"]} >= {
        id(c.wq) for i in range(BLOCKS) for c in state_of(model, model.blocks[i].fc1.weight).copies.values()
    }
