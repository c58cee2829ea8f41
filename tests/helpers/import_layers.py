"""The import-layer checker of tests/package/test_import_layers.py, as functions of a package
directory (the real fx_fp8/, or a temporary copy with a violation planted in it).

Built from the source, an AST walk: `import` and `from ... import` statements anywhere (inside
functions too), imports under `if TYPE_CHECKING:` excepted (annotations only), and dynamic imports:
`importlib.import_module(...)` / `__import__(...)` whose argument is a string literal, an f-string
with a literal head, or a module-level name (or a subscript of one) bound to strings or a dict /
tuple / list of them. A dynamic import whose target cannot be read that way is reported as
unresolved: the checker does not guess.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

ROOT_PACKAGE = "fx_fp8"
DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def module_paths(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = (ROOT_PACKAGE,) + path.relative_to(package).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _runtime_nodes(tree):
    """Every node, but not those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING"
            ):
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


def _module_strings(tree) -> dict[str, set[str]]:
    """Module-level names bound to a string, or to a dict / tuple / list / set of strings: their strings."""
    out: dict[str, set[str]] = {}
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        items = (
            value.values
            if isinstance(value, ast.Dict)
            else value.elts
            if isinstance(value, (ast.Tuple, ast.List, ast.Set))
            else [value]
        )
        strings = {v.value for v in items if isinstance(v, ast.Constant) and isinstance(v.value, str)}
        for t in targets:
            if isinstance(t, ast.Name) and strings:
                out[t.id] = strings
    return out


def _dynamic_targets(call: ast.Call, strings: dict[str, set[str]]) -> set[str] | None:
    """The module names a dynamic import call may load, or None when the argument cannot be read."""
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value}
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = arg.values[0].value  # f"fx_fp8.ops.{name}": at least the package its head names
        return {head.rstrip(".")}
    base = arg.value if isinstance(arg, ast.Subscript) else arg
    if isinstance(base, ast.Name) and base.id in strings:
        return strings[base.id]
    return None


def _is_dynamic_import(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id in DYNAMIC_IMPORTERS) or (
        isinstance(f, ast.Attribute) and f.attr in DYNAMIC_IMPORTERS
    )


@dataclass
class Scan:
    modules: dict[str, Path]
    graph: dict[str, set[str]] = field(default_factory=dict)  # every import (functions included)
    import_time: dict[str, set[str]] = field(default_factory=dict)  # what runs when the module loads
    unresolved: list[str] = field(default_factory=list)  # dynamic imports the checker cannot read

    def resolve(self, name: str) -> str:
        """The module an imported dotted name refers to (a name imported from a module: that module)."""
        while name not in self.modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name


@functools.lru_cache(maxsize=None)
def _raw_imports(name: str, package: str, text: str):
    """(every fx_fp8 name imported, those imported at import time, unreadable dynamic imports), before
    resolving names to modules: cached by source text, so a copy of the package re-walks only what changed."""
    tree = ast.parse(text)
    strings = _module_strings(tree)
    at_import = set(map(id, _import_time_nodes(tree)))
    every, import_time, unresolved = set(), set(), []
    for node in _runtime_nodes(tree):
        names = set()
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names if a.name.startswith(ROOT_PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.startswith(ROOT_PACKAGE):
                names = {f"{mod}.{a.name}" for a in node.names}
        elif _is_dynamic_import(node):
            targets = _dynamic_targets(node, strings)
            if targets is None:
                unresolved.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
                continue
            names = {t for t in targets if t.split(".")[0] == ROOT_PACKAGE}
        every |= names
        if id(node) in at_import:
            import_time |= names
    return frozenset(every), frozenset(import_time), tuple(unresolved)


def scan(package: Path) -> Scan:
    s = Scan(module_paths(package))
    for name, path in s.modules.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        every, import_time, unresolved = _raw_imports(name, pkg, path.read_text())
        s.graph[name] = {s.resolve(n) for n in every} - {name}
        s.import_time[name] = {s.resolve(n) for n in import_time} - {name}
        s.unresolved.extend(unresolved)
    return s


def layer_of(name: str, layers) -> int | None:
    """The index of the layer declaring `name` (the longest matching entry decides), or None. An entry
    names a module and, when it is a subpackage or module below the package, everything under it; the
    package itself (the public names of fx_fp8/__init__.py) covers only itself, so a new subpackage
    must be declared."""
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            under = "." in p and name.startswith(p + ".")
            if (name == p or under) and len(p) > best:
                best, layer = len(p), i
    return layer


def undeclared(s: Scan, layers) -> list[str]:
    return sorted(m for m in s.modules if layer_of(m, layers) is None)


def upward_imports(s: Scan, layers) -> list[str]:
    out = []
    for m, targets in sorted(s.graph.items()):
        lm = layer_of(m, layers)
        for t in sorted(targets):
            lt = layer_of(t, layers)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} ({layers[lm][0]}) -> {t} ({layers[lt][0]})")
    return out


def import_cycles(s: Scan) -> list[list[str]]:
    """Tarjan's strongly connected components of the import-time graph: any of more than one module."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in s.import_time.get(v, ()):
            if w not in s.modules:
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

    for v in s.modules:
        if v not in index:
            visit(v)
    return cycles


def top_level_modules(s: Scan, package: Path) -> list[str]:
    return sorted(
        n
        for n in s.modules
        if n.count(".") == 1
        and s.modules[n].name != "__init__.py"
        and n != f"{ROOT_PACKAGE}.__main__"
        and s.modules[n].parent == package
    )


def imports_between(s: Scan, importer_prefix: str, imported_prefix: str) -> list[str]:
    return sorted(
        f"{m} -> {t}"
        for m in s.graph
        if m.startswith(importer_prefix)
        for t in s.graph[m]
        if t.startswith(imported_prefix)
    )
