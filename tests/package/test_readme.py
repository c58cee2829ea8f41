"""The README as a front door: short, its commands runnable as given, its links and generated table current."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fences(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return set(out.stdout.splitlines())


def test_readme_is_short():
    assert len(_text(README).splitlines()) <= 250


def test_ci_test_command_is_where_ci_reads_it():
    """.ci/run runs the second line after the marker: the opening fence, then the command."""
    lines = _text(README).splitlines()
    i = lines.index("<!-- test-command -->")
    assert lines[i + 1] == "```bash"
    cmd = lines[i + 2]
    assert 'pip install -e ".[test]"' in cmd and "python -m pytest" in cmd
    assert cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==")


def test_ci_runs_the_suite_on_two_xdist_workers():
    """CI's 2-core machine: `-n 2` (pytest-xdist, from the [test] extra) keeps the suite under 20 min."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    lines = _text(README).splitlines()
    cmd = lines[lines.index("<!-- test-command -->") + 2]
    assert cmd.endswith("python -m pytest -q -n 2"), cmd
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("pytest-xdist") for d in extras["test"]), extras["test"]


def test_fast_test_command_comes_with_its_install():
    for block in _fences(_text(README), "bash"):
        for line in block.splitlines():
            if '-m "not slow"' in line:
                assert 'pip install -e ".[test]"' in line
                return
    pytest.fail("README gives no fast test command")


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(path):
    text = _text(path)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        file = target.split("#")[0]
        assert (path.parent / file).exists(), f"{path.name}: broken link {target}"


def _writes(words: list[str]) -> list[str]:
    """Paths a README command line names as outputs (flags that take an output path)."""
    outs = []
    for flag in ("--out", "--output", "--chart", "--yaml", "--readme"):
        for i, w in enumerate(words[:-1]):
            if w == flag:
                outs.append(words[i + 1])
            elif w.startswith(flag + "="):
                outs.append(w.split("=", 1)[1])
    return outs


def test_readme_commands_write_no_tracked_file():
    tracked = _tracked()
    for block in _fences(_text(README), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            words = shlex.split(line)
            for out in _writes(words):
                assert out.rstrip("/") not in tracked, f"README command writes tracked {out}: {line}"
            assert "--append" not in words and "RESULTS.md" not in line, line


def test_supported_models_excerpt_matches_the_generated_page():
    def cells(text: str) -> dict:  # class -> the row's cells
        rows = (
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines()
            if line.startswith("| `")
        )
        return {c[0].strip("`"): c for c in rows}

    page = cells(_text(DOCS / "supported_models.md"))
    assert len(page) >= 50
    block = _text(README).split("<!-- supported-models -->")[1].split("<!-- /supported-models -->")[0]
    excerpt = cells(block)
    assert excerpt, "the README's supported-models block is empty"
    for cls, (_, attn, lin, err, real) in excerpt.items():
        # the page: class, zoo name, kind, attention, linears, error, real width, not FP8
        assert page[cls][3:7] == [attn, lin, err, real], (cls, page[cls])
        assert re.fullmatch(r"[\d.]+ %", err) and (
            real == "-" or re.fullmatch(r"\d+/\d+ attn, \d+/\d+ lin, [\d.]+ %", real)
        )


def test_sensitivity_without_matplotlib_is_one_line_naming_the_extra(monkeypatch, capsys, tmp_path):
    from fx_fp8.install_hint import install_hint
    from fx_fp8.tools import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = cli.main(["sensitivity", "--model", "tiny", "--out", str(tmp_path / "sens")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and install_hint("cli") in err, err
    assert not (tmp_path / "sens").exists()
