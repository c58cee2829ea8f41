"""Regional compilation (each block compiled on its own, as diffusers' compile_repeated_blocks
does): every block gets the one-graph compile's decisions, instances that decide alike share
one downstream compile, and the instance is known from its parameters, not from the stack."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fx_fp8
from fx_fp8.compile.backend import CHECK_REUSE_ENV
from fx_fp8.compile import dispatch
from fx_fp8.graph import names

from checks import MOD, linear_rows, rel_err, structural
from toy_models import BLOCKS, compile_regionally, regional_toy, toy_inputs

#: these tests check the analysis' decisions: sensitive layers found by structure read "...; kept native"
NATIVE = {"quantization_config": {"sensitive": "native"}}


@pytest.fixture(autouse=True)
def _check_reuse(monkeypatch):
    """Every instance that reuses another's decisions also runs the passes here, and must agree."""
    monkeypatch.setenv(CHECK_REUSE_ENV, "1")


def test_every_block_keeps_its_modulation_native_and_blocks_share_one_compile(downstream_compiles):
    model, kw = regional_toy(), toy_inputs()
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        native = model(**kw)
        out = compile_regionally(model, **NATIVE)(**kw)
    reports = fx_fp8.get_reports(model)
    entries = linear_rows(reports)
    # the one-graph compile keeps every block's adaLN modulation native: so must each block alone
    assert [structural(entries[f"blocks.{i}.ada"]) for i in range(BLOCKS)] == [MOD] * BLOCKS
    assert all(entries[f"blocks.{i}.{p}"].action == "fp8" for i in range(BLOCKS) for p in ("q", "fc2"))
    assert len(reports) == BLOCKS  # one report per block instance
    assert counters["stats"]["unique_graphs"] - graphs == 1  # Dynamo traced the block class once
    assert len(downstream_compiles) == 1  # and every instance, deciding alike, shares its compile
    assert 0 < rel_err(out, native) < 0.05


def test_a_block_that_decides_differently_gets_its_own_compile(downstream_compiles):
    model, kw = regional_toy(), toy_inputs()
    with torch.no_grad():
        compile_regionally(model, quantization_config={"ignored_layers": ["blocks.3.fc1"]})(**kw)
    entries = linear_rows(fx_fp8.get_reports(model))
    assert entries["blocks.3.fc1"].action == "native" and entries["blocks.2.fc1"].action == "fp8"
    assert len(downstream_compiles) == 2


def test_no_stack_walk_per_call(monkeypatch):
    model, kw = regional_toy(), toy_inputs()
    with torch.no_grad():
        compile_regionally(model)(**kw)

        def forbidden(*_):
            raise AssertionError("the compiled graph walked the Python stack on a call")

        monkeypatch.setattr(names, "find_compiled_model", forbidden)
        monkeypatch.setattr(dispatch, "runtime_instance", forbidden)  # InstanceDispatch reads it there
        model(**kw)
        model(**kw)


def test_instances_generate_no_python_code(monkeypatch, downstream_compiles):
    """Each block instance's passes run on a graph copy whose Python code is never needed
    (Inductor reads the graph): generating it per instance and per pass was the main cost of a
    warm regional restart. Code is generated once per compiled artifact (eager downstream)."""
    generated = []
    real = torch.fx.Graph.python_code

    def counting(self, *args, **kwargs):
        generated.append(len(self.nodes))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Graph, "python_code", counting)
    model, kw = regional_toy(), toy_inputs()
    with torch.no_grad():
        compile_regionally(model)(**kw)
    assert len(downstream_compiles) == 1
    # Dynamo's own graph module and the one compiled artifact; nothing per instance (was 3 per instance)
    assert len(generated) <= 3, f"{len(generated)} code generations for {BLOCKS} block instances"


@pytest.mark.slow
def test_compile_pipeline_regional_compiles_blocks_and_restores():
    import warnings

    from fx_fp8 import pipeline_state
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe, kwargs = build_tiny_pipeline("flux")
    run = dict(kwargs, num_inference_steps=3, output_type="latent")
    with torch.no_grad():
        ref = pipe(**run, generator=torch.Generator().manual_seed(0)).images
    transformer = pipe.transformer
    graphs = counters["stats"]["unique_graphs"]
    fx_fp8.compile_pipeline(pipe, regional=True, diffusion_kv_cache_skip_steps="0")
    assert pipe.transformer is transformer  # the model stays the pipeline's own; its blocks are compiled
    with torch.no_grad():
        out = pipe(**run, generator=torch.Generator().manual_seed(0)).images
        pipe(**run, generator=torch.Generator().manual_seed(0))
    reports = pipeline_state(pipe).reports()["transformer"]
    blocks = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    assert {r.step_variant for r in reports} == {"fp8", "native"}
    assert len({e.module.rsplit(".attn", 1)[0] for r in reports for e in r.entries if e.op == "attention"}) == blocks
    # one Dynamo graph per block class (plus prepare's structural trace of the whole model)
    assert counters["stats"]["unique_graphs"] - graphs <= 2 + 2
    assert ((out - ref).norm() / ref.norm()).item() < 0.06
    fx_fp8.restore_pipeline(pipe, linears="quantized")
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in transformer.modules())
    with pytest.raises(ValueError, match="_repeated_blocks"):
        fx_fp8.compile_pipeline(_NoBlocks(pipe), regional=True)


class _NoBlocks:
    """A pipeline-like object whose transformer declares no repeated blocks."""

    def __init__(self, pipe):
        self.transformer = nn.Linear(4, 4)
        self.scheduler = pipe.scheduler

    def __call__(self):
        return None
