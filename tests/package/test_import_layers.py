"""The package's plan: its layers, written once here, lowest first. A module may import its own
layer or a lower one, never a higher one (imports inside functions and dynamic imports included),
every module belongs to a declared layer (a new subpackage must be placed), and the modules'
import-time imports form no cycle (an import inside a function runs when it is called, after both
modules loaded: fx_fp8.pipeline.diffusers_registration's hook imports the quantizer it registers
that way). The checker (tests/helpers/import_layers.py) is an AST walk over fx_fp8/; each rule also
runs on a temporary copy of the package with a violation planted, and must report it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import import_layers as il

PACKAGE = Path(__file__).resolve().parents[2] / "fx_fp8"

#: the layers, lowest first: module names; an entry below the package covers its submodules (the
#: longest matching entry decides); "fx_fp8" is the package's own __init__ only
LAYERS = [
    ("utilities", ["fx_fp8.install_hint", "fx_fp8.progress", "fx_fp8.after_import"]),
    ("config", ["fx_fp8.config", "fx_fp8.steps"]),  # settings, and the published step they select by
    ("graph", ["fx_fp8.graph", "fx_fp8.report"]),  # reading graphs (never rewriting), reports of decisions
    ("ops", ["fx_fp8.ops"]),  # numerics, custom ops, lowerings and their kernels
    ("quant", ["fx_fp8.quant"]),  # quantized weights, prepare, checkpoints, calibration
    ("passes", ["fx_fp8.passes"]),  # rewriting graphs
    ("compile", ["fx_fp8.compile"]),  # the Dynamo backends
    ("pipeline", ["fx_fp8.pipeline"]),  # the diffusers glue
    ("tuning", ["fx_fp8.tuning"]),  # fx_fp8.tune: measuring every candidate on this GPU
    ("api", ["fx_fp8"]),  # the package's public names
    ("tools", ["fx_fp8.tools", "fx_fp8.__main__"]),  # CLI, sensitivity, model zoo, the tiny model (users of the API)
]
#: at most this many modules at the top of fx_fp8/ besides __init__ and __main__
MAX_TOP_LEVEL = 8

SCAN = il.scan(PACKAGE)
MODULES, GRAPH = SCAN.modules, SCAN.graph


def layer_of(name: str) -> int:
    layer = il.layer_of(name, LAYERS)
    assert layer is not None, f"{name} belongs to no declared layer"
    return layer


def _unreadable(scan) -> list[str]:
    """Dynamic imports the checker cannot read, outside the top layer (nothing is above that one)."""
    top = len(LAYERS) - 1
    return [u for u in scan.unresolved if il.layer_of(u.split(":")[0], LAYERS) != top]


def test_every_module_has_a_layer():
    assert MODULES
    assert not il.undeclared(SCAN, LAYERS), "modules in no declared layer (add them to LAYERS)"


def test_no_module_imports_a_higher_layer():
    upward = il.upward_imports(SCAN, LAYERS)
    assert not upward, "imports of a higher layer:\n  " + "\n  ".join(upward)
    unreadable = _unreadable(SCAN)
    assert not unreadable, f"dynamic imports whose target the checker cannot read: {unreadable}"


def test_no_import_cycle():
    cycles = il.import_cycles(SCAN)
    assert not cycles, f"import cycles: {cycles}"


def test_the_top_level_is_small():
    top = il.top_level_modules(SCAN, PACKAGE)
    assert len(top) <= MAX_TOP_LEVEL, top


def test_reading_graphs_never_imports_the_rewriting_layer():
    assert not il.imports_between(SCAN, "fx_fp8.graph", "fx_fp8.passes")


def test_settings_never_import_the_published_step():
    """config/ names the step variants (config/step_variants.py); the published step (fx_fp8.steps)
    selects by the settings, never the other way round."""
    assert not {m for m in GRAPH if m.startswith("fx_fp8.config") and "fx_fp8.steps" in GRAPH[m]}


def test_the_checker_sees_real_edges():
    """Not vacuously green: known imports are in the graph, and their layers are ordered as declared."""
    assert "fx_fp8.passes.manager" in GRAPH["fx_fp8.compile.graph_plan"]
    assert "fx_fp8.quant.recipe" in GRAPH["fx_fp8.quant.weight_state"]
    assert {"fx_fp8.ops.cuda", "fx_fp8.ops.npu"} <= GRAPH["fx_fp8.ops.lowering"]  # import_module(_MODULES[name])
    assert layer_of("fx_fp8.ops.cuda") < layer_of("fx_fp8.quant.prepare") < layer_of("fx_fp8.compile.backend")


# -- each rule fails on a planted violation ---------------------------------------------------------
def _write(package: Path, relative: str, text: str, append: bool = False) -> None:
    path = package / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as f:
        f.write(text)


#: one violation per rule, each in its own modules of one copy: (rule, where, text, appended to it)
PLANTED = {
    "undeclared subpackage": ("newpart/__init__.py", "from fx_fp8.pipeline import compile_pipeline\n", False),
    "upward import in a function": (
        "config/values.py",
        "\n\ndef _planted():\n    from fx_fp8.compile import backend\n",
        True,
    ),
    "importlib.import_module": (
        "ops/formats.py",
        "\n\ndef _planted():\n    import importlib\n    return importlib.import_module('fx_fp8.pipeline.compile')\n",
        True,
    ),
    "__import__": ("graph/shapes.py", "\n\ndef _planted():\n    return __import__('fx_fp8.quant.prepare')\n", True),
    "import_module of a module constant": (
        "quant/recipe.py",
        "\n_PLANTED = {'x': 'fx_fp8.passes.linear'}\n\n\n"
        "def _planted(k):\n    from importlib import import_module\n"
        "    return import_module(_PLANTED[k])\n",
        True,
    ),
    "unreadable dynamic import": (
        "steps.py",
        "\n\ndef _planted(name):\n    import importlib\n    return importlib.import_module(name)\n",
        True,
    ),
    "import cycle": ("install_hint.py", "\nimport fx_fp8.progress  # noqa\n", True),
    "graph imports passes": ("graph/names.py", "\n\ndef _planted():\n    from fx_fp8.passes import base\n", True),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    package = tmp_path_factory.mktemp("planted") / "fx_fp8"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.json"))
    for where, text, append in PLANTED.values():
        _write(package, where, text, append)
    _write(package, "progress.py", "\nimport fx_fp8.install_hint  # noqa\n", append=True)  # the cycle's other half
    for i in range(MAX_TOP_LEVEL + 1):
        _write(package, f"planted_top_{i}.py", "")
    return package, il.scan(package)


def test_the_planted_copy_differs_from_the_package_only_where_planted(planted):
    package, scan = planted
    assert set(scan.modules) - set(MODULES) == {"fx_fp8.newpart"} | {
        f"fx_fp8.planted_top_{i}" for i in range(MAX_TOP_LEVEL + 1)
    }


@pytest.mark.parametrize(
    "rule, found",
    [
        ("undeclared subpackage", lambda s, p: "fx_fp8.newpart" in il.undeclared(s, LAYERS)),
        (
            "upward import in a function",
            lambda s, p: (
                "fx_fp8.config.values (config) -> fx_fp8.compile.backend (compile)" in il.upward_imports(s, LAYERS)
            ),
        ),
        (
            "importlib.import_module",
            lambda s, p: (
                "fx_fp8.ops.formats (ops) -> fx_fp8.pipeline.compile (pipeline)" in il.upward_imports(s, LAYERS)
            ),
        ),
        (
            "__import__",
            lambda s, p: "fx_fp8.graph.shapes (graph) -> fx_fp8.quant.prepare (quant)" in il.upward_imports(s, LAYERS),
        ),
        (
            "import_module of a module constant",
            lambda s, p: "fx_fp8.quant.recipe (quant) -> fx_fp8.passes.linear (passes)" in il.upward_imports(s, LAYERS),
        ),
        ("unreadable dynamic import", lambda s, p: any(u.startswith("fx_fp8.steps:") for u in _unreadable(s))),
        ("import cycle", lambda s, p: ["fx_fp8.install_hint", "fx_fp8.progress"] in il.import_cycles(s)),
        (
            "graph imports passes",
            lambda s, p: (
                "fx_fp8.graph.names -> fx_fp8.passes.base" in il.imports_between(s, "fx_fp8.graph", "fx_fp8.passes")
            ),
        ),
        ("too many top-level modules", lambda s, p: len(il.top_level_modules(s, p)) > MAX_TOP_LEVEL),
    ],
)
def test_each_rule_reports_its_planted_violation(planted, rule, found):
    package, scan = planted
    assert found(scan, package), f"the rule '{rule}' did not report the violation planted for it"
