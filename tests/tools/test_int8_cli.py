"""`fx-fp8 inspect --quantization int8` reports INT8 rows (in-process, like tests/tools/test_cli.py)."""

from __future__ import annotations

import re

import pytest

from fx_fp8.tools.cli import main


@pytest.mark.slow
def test_inspect_flux_int8_reports_int8_rows(capsys):
    code = main(["inspect", "--model", "flux", "--quantization", "int8"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if re.search(r"\slinear\s", line)]
    actions = [re.search(r"\slinear\s+(\S+)", line).group(1) for line in rows]
    assert actions.count("int8") >= 10 and "fp8" not in actions, out
    assert any(True for (line, a) in zip(rows, actions) if a == 'int8')  # not vacuous: all() of nothing is True
    assert all("INT8 W8A8" in line for line, a in zip(rows, actions) if a == "int8")
    assert not re.search(r"\sattention\s+fp8\s", out)  # --quantization alone: attention stays native
    summary = out[out.index("summary") :]
    assert re.search(r"linear\s+0\s+\d+\s+\d+", summary) and "int8" in summary.splitlines()[1]
