"""Shared fixtures: a clean Dynamo cache and report list per test, tiny models by family."""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

# the shared helpers (tiny models, graph capture, simulators, ...) import by bare name from every test folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

import fx_fp8
from fx_fp8.tools.model_zoo.registry import FAMILIES, build_tiny_transformer, example_inputs

# Under pytest-xdist (`-n 2`, one worker per core) each worker computes on one thread, so the
# workers do not fight over the cores; a single-process run uses both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# the tests never follow the user's own tune tables (`fx-fp8 tune`'s cache folder): an empty folder of their own
os.environ["FX_FP8_TUNE_DIR"] = tempfile.mkdtemp(prefix="fx_fp8_tune_")


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    fx_fp8.set_step(None)
    yield
    torch._dynamo.reset()
    fx_fp8.set_step(None)


def _watch_downstream(monkeypatch, record) -> list:
    """Calls fx_fp8's downstream compiler as before, appending record(name, gm) for each graph."""
    from fx_fp8.compile import downstream

    seen = []
    real = downstream.compile_downstream

    def watching(name, gm, inputs, mode, inductor_options=None):
        seen.append(record(name, gm))
        return real(name, gm, inputs, mode, inductor_options)

    monkeypatch.setattr(downstream, "compile_downstream", watching)
    return seen


@pytest.fixture
def downstream_compiles(monkeypatch):
    """The downstream compiler names fx_fp8's backend called, in order (one per compiled graph)."""
    return _watch_downstream(monkeypatch, lambda name, gm: name)


@pytest.fixture
def downstream_graphs(monkeypatch):
    """The rewritten graphs fx_fp8's backend handed to its downstream compiler, in order."""
    return _watch_downstream(monkeypatch, lambda name, gm: gm)


@pytest.fixture(params=[pytest.param(f, marks=() if f == "flux" else pytest.mark.slow) for f in FAMILIES])
def family(request) -> str:
    """Each of the five families; the fast run (-m "not slow") covers Flux, the full suite all five."""
    return request.param


@pytest.fixture
def tiny(family):
    """(family, model, kwargs) for a tiny random transformer of each family."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer(family)
    return family, model, example_inputs(family, model)


def pytest_collection_modifyitems(config, items):
    """Tests listed in tests/slow_tests.txt (measured over 0.4 s each) join the slow ones: the
    fast run stays fast, the full suite still runs them."""
    from slow_tests import read_list

    _, slow = read_list()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
