"""tests/slow_tests.txt names tests by id; an id that matches no test is silently not marked slow
(it would then run in the fast run, or, renamed, be measured nowhere). Checked without collecting:
each id's file exists and defines its test function (parameter ids need a collection: see
tests/helpers/slow_tests.py, which reads whole ids, spaces included)."""

from __future__ import annotations

import ast
import pathlib

from slow_tests import read_list

ROOT = pathlib.Path(__file__).resolve().parents[2]


def stale_ids(ids) -> list[str]:
    """The ids whose file is missing or defines no function of the id's test name."""
    functions: dict[str, set[str]] = {}
    stale = []
    for node_id in sorted(ids):
        path, _, name = node_id.partition("::")
        if path not in functions:
            file = ROOT / path
            functions[path] = (
                {
                    n.name
                    for n in ast.walk(ast.parse(file.read_text()))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                if file.is_file()
                else set()
            )
        if name.split("::")[-1].split("[")[0] not in functions[path]:
            stale.append(node_id)
    return stale


def test_every_listed_slow_test_names_an_existing_file_and_test_function():
    _, ids = read_list()
    assert ids
    stale = stale_ids(ids)
    assert not stale, f"{len(stale)} ids in tests/slow_tests.txt name no test: {stale[:5]}"


def test_the_check_sees_a_moved_file_and_a_renamed_test(tmp_path):
    listed = tmp_path / "slow_tests.txt"
    here = "tests/package/test_slow_tests_list.py"
    listed.write_text(
        f"# header\n{here}::test_gone[a b]\ntests/test_slow_tests_list.py::stale_ids\n"
        f"{here}::test_the_check_sees_a_moved_file_and_a_renamed_test\n"
    )
    _, ids = read_list(listed)
    assert f"{here}::test_gone[a b]" in ids  # the whole id, space included
    assert stale_ids(ids) == [
        "tests/package/test_slow_tests_list.py::test_gone[a b]",
        "tests/test_slow_tests_list.py::stale_ids",
    ]
