"""benchmarks/cuda_bench.py --dry-run: every row of the GPU benchmark runs on CPU at tiny shapes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~20 s: Triton interpreter, three torch.compile'd models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "cuda_bench.py")


def test_dry_run_runs_every_row(tmp_path):
    out = tmp_path / "results.md"
    out.write_text("# Benchmark results\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for title in ("(a) linear", "(b) attention", "(c) Flux-sized transformer", "(d) weight-only (W8A16) linear"):
        assert title in text
    for column in ("BF16 mm ms", "BF16 Inductor ms", "torchao FP8 row ms", "fx_fp8 FP8 fast ms",
                   "fx_fp8 FP8 exact-acc ms", "fx_fp8 INT8 ms", "cuDNN BF16 ms", "flash BF16 ms", "Triton FP8 ms",
                   "cuDNN FP8 ms", "fused fp8-ch ms", "unfused fp8-ch ms", "fused int8-g32 ms"):
        assert column in text, column
    assert "error:" not in text
    assert "A GPU run fills these cells" in text and "Triton interpreter" in text
    assert "(d) 1x96->160 fused W8A16 fp8-ch" in text  # the fused kernel's cells are listed for the GPU run
    appended = out.read_text()
    assert appended.startswith("# Benchmark results\n") and "## cuda_bench.py — " in appended
    assert "- torch: " in appended and "- device: CPU dry run" in appended and "(b) attention" in appended


def test_without_gpu_and_without_dry_run_it_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the real benchmark")
    proc = subprocess.run([sys.executable, SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
