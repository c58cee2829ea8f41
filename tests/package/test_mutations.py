"""Mutation check: each guarantee the README and docs/configuration.md make is guarded by fast tests
that fail when the product breaks it. Each mutation below is one plausible product edit that breaks
one guarantee; it is applied alone to a scratch copy of fx_fp8/, and the tests it names run against
that copy (the copy's folder first on sys.path). A mutation the tests survive fails this test. The
named tests are the fast ones that guard the guarantee (two of them take over 0.4 s, so the fast run
leaves them to the full suite: the P scale's and the sensitive-layer analysis's).

Slow (a pytest process per mutation: minutes); run it after changing a guarded rule or its tests:

    python -m pytest -q tests/package/test_mutations.py

A snippet that no longer occurs exactly once in the product is an error, not a pass: when the code
moves, move the mutation with it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fx_fp8"


@dataclass(frozen=True)
class Mutation:
    guarantee: str
    path: str  # under fx_fp8/
    old: str  # occurs exactly once there
    new: str
    tests: tuple  # pytest node ids or files


MUTATIONS = [
    Mutation(
        "passthrough is bit-identical: passes never run a whole-graph clean-up",
        "passes/manager.py",
        '            self._dump(inputs, out, f"after_{p.name}")\n            log.debug(',
        '            self._dump(inputs, out, f"after_{p.name}")\n            gm.graph.eliminate_dead_code()\n            gm.recompile()\n            log.debug(',
        ("tests/package/test_transparency.py::test_in_place_side_effects_and_vmap_survive",),
    ),
    Mutation(
        "ignored_layers are honoured",
        "config/patterns.py",
        '        if matches(p, name):',
        '        if False:',
        (
            "tests/config/test_filters.py::test_first_match_reports_the_pattern",
            "tests/config/test_filters.py::test_ignored_beats_eligibility",
        ),
    ),
    Mutation(
        "a weight written after compiling is followed (the version counter in the fingerprint)",
        "quant/weight_state.py",
        '        version = weight._version',
        '        version = 0',
        ("tests/quant/test_weight_changes.py::test_weight_writes_after_torch_compile_are_seen",),
    ),
    Mutation(
        "skip_steps run their steps native",
        "steps.py",
        '        variant = variant_name(\n            _selected(skip_steps, step, total), _selected(linear_skip_steps, step, total), linear_mode\n        )',
        '        variant = variant_name(False, _selected(linear_skip_steps, step, total), linear_mode)',
        ("tests/config/test_steps.py::test_variant_for_step",),
    ),
    Mutation(
        "sensitive layers (conditioning, modulation, final projection) stay out of W8A8",
        "graph/sensitive.py",
        '        return _Analysis(gm, model_output).run()',
        '        return {}',
        ("tests/graph/test_sensitive_layers.py::test_the_analysis_finds_the_toy_structure_on_its_dynamo_graph",),
    ),
    Mutation(
        "attention keeps an explicit softmax scale",
        "passes/attention.py",
        '        softmax_scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])',
        '        softmax_scale = 1.0 / math.sqrt(q.shape[-1])',
        ("tests/passes/test_attention_pass.py::test_explicit_scale_is_kept",),
    ),
    Mutation(
        "attention quantizes P with its fixed scale",
        "ops/quant.py",
        '        p = (p * p_scale).to(FP8_DTYPE).float() / p_scale',
        '        p = p.to(FP8_DTYPE).float()',
        ("tests/ops/test_attention_numerics.py::test_p_quantization_costs_under_1_db_with_its_fixed_scale",),
    ),
    Mutation(
        "CUDA GEMMs pass scale_a per token [M, 1] and scale_b per channel [1, N]",
        "ops/cuda_graph_gemms.py",
        '        sb = ws.reshape(1, 1).expand(1, wq.shape[0]).contiguous() if ws_scalar else ws.reshape(1, -1)',
        '        sb = ws.reshape(1, 1).expand(1, wq.shape[0]).contiguous() if ws_scalar else ws.reshape(-1, 1)',
        ("tests/ops/test_cuda_graph_linears_run.py::test_every_form_keeps_torch_contract",),
    ),
    Mutation(
        "fast_accum: false gives exact accumulation",
        "ops/cuda_graph_gemms.py",
        '            return _MM(\n                xq, wq.t(), xs.float().reshape(1, 1), ws.float().reshape(1, 1), None, None, out_dtype, fast_accum\n            )',
        '            return _MM(xq, wq.t(), xs.float().reshape(1, 1), ws.float().reshape(1, 1), None, None, out_dtype, True)',
        ("tests/ops/test_cuda_graph_linears_run.py::test_every_form_keeps_torch_contract",),
    ),
    Mutation(
        "the diffusers quantizer quantizes the layers the rules pick",
        "quant/layer_quantize.py",
        '    plan = plan_linear(name, in_features, out_features, dtype, qcfg, lowering=lowering)',
        '    plan = LinearPlan("native", "mutated")',
        ("tests/pipeline/test_diffusers_quantizer.py::test_loading_quantizes_the_linears_the_rules_pick",),
    ),
]


def _scratch(tmp_path: Path, m: Mutation) -> Path:
    root = tmp_path / "scratch"
    shutil.copytree(PACKAGE, root / "fx_fp8", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = root / "fx_fp8" / m.path
    text = target.read_text()
    assert text.count(m.old) == 1, f"{m.path}: the mutation's snippet occurs {text.count(m.old)} times: move it"
    target.write_text(text.replace(m.old, m.new))
    init = root / "fx_fp8" / "__init__.py"  # a probe: proves the tests imported this copy, not the checkout
    init.write_text(
        init.read_text() + "\nimport os as _os\nif _os.environ.get(\"FX_FP8_SCRATCH_PROBE\"):\n"
        "    open(_os.environ[\"FX_FP8_SCRATCH_PROBE\"], \"w\").write(__file__)\n"
    )
    return root


def _run(tests, pythonpath: Path, probe: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{pythonpath}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": "1",
        "FX_FP8_SCRATCH_PROBE": str(probe),
    }
    # run from the copy's folder: `python -m` puts the working directory first on sys.path
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(ROOT),
            "-c",
            str(ROOT / "pyproject.toml"),
            *(str(ROOT / t) for t in tests),
        ],
        cwd=pythonpath,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_mutation_names_a_distinct_guarantee():
    assert len({m.guarantee for m in MUTATIONS}) == len(MUTATIONS) >= 8
    for m in MUTATIONS:
        assert (PACKAGE / m.path).read_text().count(m.old) == 1, f"{m.path}: snippet of '{m.guarantee}' moved"


@pytest.mark.slow
@pytest.mark.parametrize("m", MUTATIONS, ids=[m.guarantee.split(":")[0][:50] for m in MUTATIONS])
def test_the_fast_tests_catch_the_mutation(m, tmp_path):
    scratch = _scratch(tmp_path, m)
    probe = tmp_path / "imported_from"
    res = _run(m.tests, scratch, probe)
    assert probe.exists() and probe.read_text().startswith(str(scratch)), "the tests did not import the scratch copy"
    assert res.returncode == 1, (
        f"the mutation breaking '{m.guarantee}' survived {m.tests} "
        f"(pytest exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}"
    )
