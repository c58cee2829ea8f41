"""benchmarks/tune_run.py --dry-run on CPU: the Wan-14B step's code path at tiny width (the script
gpu_run.sh's `tune` step runs on a GPU): a summary per model, its table written and parseable, and
--compare's fixed configurations against auto."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from fx_fp8.ops import tune_table

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tune_run.py"


def test_dry_run_tunes_the_wan_shapes_writes_their_table_and_compares_auto(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--only",
            "wan",
            "--compare",
            "--out-dir",
            str(tmp_path),
            "--results",
            str(results),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "== wan: tune took" in proc.stdout and "CPU dry run: CPU timings, not a GPU's" in proc.stdout
    # --compare: the fixed configurations and auto, timed alike, and auto's predicted total
    assert "== wan: fixed configurations against auto" in proc.stdout and "auto / best fixed:" in proc.stdout
    assert re.search(r"auto predicted [\d.]+ ms over \d+ measured nodes", proc.stdout), proc.stdout[-1500:]
    table = tune_table.load(tmp_path / "wan.json")
    assert table["key"]["gpu"] == "cpu" and table["linears"] and table["attention"]
    assert "## tune_run.py" in results.read_text()


def test_without_gpu_and_without_dry_run_it_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is present: the script would tune on it")
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
