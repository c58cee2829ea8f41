"""benchmarks/dispatch_overhead.py runs on CPU and prints both tables: it reaches into the dispatchers
(fx_fp8.compile.dispatch), which a restructure can move from under it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~15 s: four compiled block setups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "dispatch_overhead.py")


def test_runs_and_measures_each_dispatcher():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--calls", "2", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| fp8")]
    dispatchers = {line.split("|")[2].strip() for line in rows if "Dispatch" in line}
    assert dispatchers == {"InstanceDispatch", "StepDispatch"}, proc.stdout
    assert any("step skips" in line and "StepDispatch" in line for line in rows), proc.stdout
