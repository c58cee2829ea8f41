"""The formatter pinned in pyproject.toml (`ruff format`, its [tool.ruff] settings) leaves every .py
file of the repository as it is: code is formatted once, by the tool, never by hand."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True)


def _pinned() -> str:
    test_extra = re.search(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert test_extra, "pyproject.toml has no test extra"
    pin = re.search(r'"ruff==([0-9.]+)"', test_extra.group(1))
    assert pin, "the test extra pins no ruff (ruff==X.Y.Z): another ruff formats differently"
    return pin.group(1)


def test_the_installed_ruff_is_the_pinned_one():
    out = _ruff("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == _pinned(), f"installed {out.stdout.strip()}; pip install -e '.[test]'"


def test_every_python_file_is_formatted():
    out = _ruff("format", "--check", "--diff", ".")
    assert "file" in (out.stdout + out.stderr), "ruff checked no files"
    assert out.returncode == 0, (
        "files not formatted (run `ruff format .` at the repository root):\n" + (out.stdout + out.stderr)[-6000:]
    )


def test_the_check_catches_an_unformatted_file(tmp_path):
    """Not vacuous: the same settings refuse a file written by hand."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "hand.py").write_text("x = {  'a':1 }\n")
    out = _ruff("format", "--check", "hand.py", cwd=tmp_path)
    assert out.returncode == 1 and "hand.py" in out.stdout + out.stderr
