"""`fx-fp8` in-process for the CLI tests: exit status and output of one command, strict JSON,
the one-line error, and a fixture that fails a command which starts working before refusing."""

from __future__ import annotations

import json

import pytest

from fx_fp8.tools.cli import main
from fx_fp8.tools.model_source import ModelSource


def cli(capsys, *argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `fx-fp8 ARGV`, in-process."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _not_json(constant):
    raise ValueError(f"not strict JSON: bare {constant}")


def strict_json(text: str):
    """json.loads that refuses the non-standard Infinity / -Infinity / NaN."""
    return json.loads(text, parse_constant=_not_json)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fx-fp8: error: "), err
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command loads a model: its bad input must be found before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command started working before rejecting its input")

    monkeypatch.setattr(ModelSource, "load_transformer", refuse)
    monkeypatch.setattr(ModelSource, "load_pipeline", refuse)
