"""`assert all(... for x in xs)` passes when xs is empty: a test claiming "every fp8 row says X" stays
green when no row is fp8. Every such assert in the suite sits in a test that also asserts something
about the same iterable (its root name or its text in another assert of the function: typically
`assert xs` or `assert any(...)` of the same filter), or iterates a non-empty literal. Read from
the source (an AST walk over tests/), so a new vacuous `all` fails here."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _root_names(it: ast.AST) -> set[str]:
    names = {ast.unparse(it)}
    node = it
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.args:  # zip(xs, ...), enumerate(xs), sorted(xs)
                node = node.args[0]
                names.add(ast.unparse(node))
                continue
            node = node.func
        else:
            node = node.value
        names.add(ast.unparse(node))
    if isinstance(node, ast.Name):
        names.add(node.id)
    return names


def vacuous_alls(source: str, where: str = "") -> list[str]:
    """`assert all(<comprehension>)` whose iterable no other assert of the same function mentions."""
    out = []
    if "all(" not in source:
        return out
    tree = ast.parse(source)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        asserts = [n for n in ast.walk(fn) if isinstance(n, ast.Assert)]
        texts = None
        for a in asserts:
            for call in ast.walk(a.test):
                if not (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "id", None) == "all"
                    and call.args
                    and isinstance(call.args[0], (ast.GeneratorExp, ast.ListComp))
                ):
                    continue
                it = call.args[0].generators[0].iter
                if isinstance(it, (ast.List, ast.Tuple, ast.Set)) and it.elts:
                    continue
                names = _root_names(it)
                texts = texts or {id(o): ast.unparse(o) for o in asserts}  # once per function
                others = [t for i, t in texts.items() if i != id(a)]
                if not any(n in o for n in names for o in others):
                    out.append(f"{where}:{a.lineno}: all() over {ast.unparse(it)}")
    return out


def test_no_test_asserts_all_of_a_possibly_empty_iterable():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50
    found = [v for f in files for v in vacuous_alls(f.read_text(), str(f.relative_to(TESTS.parent)))]
    assert not found, "assert all(...) with no check that the iterable is non-empty:\n  " + "\n  ".join(found)


def test_the_check_sees_a_vacuous_all_and_accepts_its_fix():
    vacuous = "def test_x(report):\n    rows = [e for e in report if e.fp8]\n    assert all(r.ok for r in rows)\n"
    assert vacuous_alls(vacuous) == [":3: all() over rows"]
    fixed = vacuous.replace("    assert all", "    assert rows\n    assert all")
    assert vacuous_alls(fixed) == []
    assert vacuous_alls("def test_y():\n    assert all(x > 0 for x in [1, 2])\n") == []
