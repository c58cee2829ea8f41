"""The package's plan: its layers, written once here, lowest first. A module may import its own
layer or a lower one, never a higher one (imports inside functions included), and the modules'
import-time imports form no cycle (an import inside a function runs when it is called, after both
modules loaded: fx_fp8.pipeline.diffusers_registration's hook imports the quantizer it registers
that way). Built from the source, an AST walk over fx_fp8/; imports under `if TYPE_CHECKING:`
(annotations only) are not imports."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fx_fp8"

#: the layers, lowest first: module name prefixes (the longest matching prefix decides)
LAYERS = [
    ("utilities", ["fx_fp8.install_hint", "fx_fp8.progress"]),
    ("config", ["fx_fp8.config", "fx_fp8.steps"]),          # settings, and the published step they select by
    ("graph", ["fx_fp8.graph", "fx_fp8.report"]),           # reading graphs (never rewriting), reports of decisions
    ("ops", ["fx_fp8.ops"]),                                # numerics, custom ops, lowerings and their kernels
    ("quant", ["fx_fp8.quant"]),                            # quantized weights, prepare, checkpoints, calibration
    ("passes", ["fx_fp8.passes"]),                          # rewriting graphs
    ("compile", ["fx_fp8.compile"]),                        # the Dynamo backends
    ("pipeline", ["fx_fp8.pipeline"]),                      # the diffusers glue
    ("api", ["fx_fp8"]),                                    # the package's public names
    ("tools", ["fx_fp8.tools", "fx_fp8.__main__"]),         # CLI, sensitivity, model zoo, the tiny model (users of the API)
]
#: at most this many modules at the top of fx_fp8/ besides __init__ and __main__
MAX_TOP_LEVEL = 8


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("fx_fp8",) + path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module an imported dotted name refers to (a name imported from a module: that module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _runtime_nodes(tree):
    """Every node, but not those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _import_time_nodes(tree):
    """The nodes that run when the module is imported: not function bodies."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, import_time: bool = False) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    nodes = set(map(id, _import_time_nodes(tree))) if import_time else None
    for node in _runtime_nodes(tree):
        if nodes is not None and id(node) not in nodes:
            continue
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name) for a in node.names if a.name.startswith("fx_fp8")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.startswith("fx_fp8"):
                out |= {_resolve(f"{mod}.{a.name}") for a in node.names}
    out.discard(name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}
IMPORT_TIME = {name: _imports(name, import_time=True) for name in MODULES}


def layer_of(name: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{name} belongs to no declared layer"
    return layer


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not upward, "imports of a higher layer:\n  " + "\n  ".join(upward)


def test_no_import_cycle():
    # Tarjan's strongly connected components: any component of more than one module is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in IMPORT_TIME.get(v, ()):
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in MODULES:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_top_level_is_small():
    top = sorted(n for n in MODULES if n.count(".") == 1 and MODULES[n].name != "__init__.py"
                 and n != "fx_fp8.__main__" and MODULES[n].parent == PACKAGE)
    assert len(top) <= MAX_TOP_LEVEL, top


def test_reading_graphs_never_imports_the_rewriting_layer():
    assert not {t for m in GRAPH if m.startswith("fx_fp8.graph") for t in GRAPH[m] if t.startswith("fx_fp8.passes")}


def test_settings_never_import_the_published_step():
    """config/ names the step variants (config/step_variants.py); the published step (fx_fp8.steps)
    selects by the settings, never the other way round."""
    assert not {m for m in GRAPH if m.startswith("fx_fp8.config") and "fx_fp8.steps" in GRAPH[m]}


def test_the_checker_sees_real_edges():
    """Not vacuously green: known imports are in the graph, and their layers are ordered as declared."""
    assert "fx_fp8.passes.manager" in GRAPH["fx_fp8.compile.graph_plan"]
    assert "fx_fp8.quant.recipe" in GRAPH["fx_fp8.quant.weight_state"]
    assert layer_of("fx_fp8.ops.cuda") < layer_of("fx_fp8.quant.prepare") < layer_of("fx_fp8.compile.backend")
