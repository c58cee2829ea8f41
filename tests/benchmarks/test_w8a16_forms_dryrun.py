"""benchmarks/w8a16_forms.py --dry-run: every row runs on CPU (Triton's interpreter), both kernel forms
appear, every quantized row is as exact as the old tile, and --out appends a dated section."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dry_run_prints_every_row_and_appends_a_section(tmp_path):
    out = tmp_path / "R.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "w8a16_forms.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        [c.strip() for c in ln.strip().strip("|").split("|")] for ln in proc.stdout.splitlines() if ln.startswith("| M")
    ]
    kernels = [r[2] for r in rows]
    assert sum(k.startswith("F.linear") for k in kernels) == 4  # one BF16 row per (shape, M)
    assert sum(k.startswith("old tile") for k in kernels) == 8  # 2 shapes x (M1: 3 storages, M2: 1)
    assert any(k.startswith("FMA 1x") for k in kernels) and any(k.startswith("dot ") for k in kernels)
    for r in rows:
        if r[1] != "bf16":
            assert float(r[7]) < 4e-3, r  # err column: bf16 output rounding of the float64 product
    text = out.read_text()
    assert "## w8a16_forms.py: the weight-only kernel on the conditioning linears" in text
    assert "CPU dry run" in text and "| M1 96->160 |" in text
