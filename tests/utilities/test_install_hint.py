"""Install hints name a command that works where fx_fp8 was installed from (a checkout, not a
published `fx-fp8` package)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fx_fp8 import install_hint as hint


@pytest.fixture(autouse=True)
def _fresh():
    hint.install_hint.cache_clear()
    yield
    hint.install_hint.cache_clear()


def test_from_a_checkout_the_hint_names_the_checkout():
    root = Path(hint.__file__).resolve().parent.parent
    assert hint.checkout_root() == root and (root / "pyproject.toml").is_file()
    cmd = hint.install_hint("cuda")
    assert shlex.split(cmd) == ["pip", "install", "-e", f"{root}[cuda]"], cmd
    assert "fx-fp8[" not in cmd


def test_without_a_checkout_the_hint_lists_the_extras_requirements(monkeypatch):
    monkeypatch.setattr(hint, "checkout_root", lambda: None)
    pyproject = (Path(hint.__file__).resolve().parent.parent / "pyproject.toml").read_text()
    for extra in ("cuda", "cache-dit", "npu"):
        declared = re.search(rf'^{re.escape(extra)} = \[(.*)\]$', pyproject, re.M).group(1)
        want = [r.strip().strip('"') for r in declared.split('",')]
        hint.install_hint.cache_clear()
        pip, install, *got = shlex.split(hint.install_hint(extra))
        assert (pip, install) == ("pip", "install") and [_norm(r) for r in got] == [_norm(r) for r in want]


def _norm(requirement: str) -> tuple:
    """name and its version specifiers, in any order (the metadata reorders them)"""
    name = re.match(r"[\w.-]+", requirement).group(0)
    return name, sorted(filter(None, requirement[len(name) :].replace(" ", "").split(",")))


def test_nothing_installed_and_no_checkout_still_says_what_to_install(monkeypatch):
    monkeypatch.setattr(hint, "checkout_root", lambda: None)
    monkeypatch.setattr(hint, "extra_requirements", lambda extra: [])
    assert "[cuda] extra" in hint.install_hint("cuda")


def test_no_message_asks_for_a_published_package():
    from fx_fp8.pipeline.cache_dit_config import MISSING

    assert hint.install_hint("cache-dit") in MISSING and "fx-fp8[" not in MISSING
