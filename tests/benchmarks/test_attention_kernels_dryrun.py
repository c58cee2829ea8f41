"""benchmarks/attention_kernels.py --dry-run: every row and candidate of the GPU probe runs (or says why it
is skipped) on CPU at tiny shapes, with fx_fp8's kernels in the Triton interpreter, and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~15 s: the Triton interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "attention_kernels.py")


def test_dry_run_runs_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import attention_kernels as ak

    res = json.loads((tmp_path / "attention_kernels.json").read_text())
    assert "dry run" in res["meta"]["device"]
    plan = {(d, s, False, "gaussian") for d, s in ak.DRY_GRID} | {(d, s, True, "gaussian") for d, s in ak.DRY_MASK_ROWS}
    plan |= {(d, s, False, "outlier x5") for d, s in ak.DRY_OUTLIER_ROWS}
    assert {(r["d"], r["s"], r["mask"], r["inputs"]) for r in res["rows"]} == plan
    for r in res["rows"]:
        assert set(r["cells"]) == set(ak.CANDIDATES), r["cells"].keys()
        assert r["ref_err"] and 0 < r["ref_err"] < 0.08, r  # the reference lowering against float64
        for name, c in r["cells"].items():
            assert "error" not in c, (name, c)
            if name in ak.GPU_ONLY:
                assert c["skipped"] == "needs a GPU", (name, c)
        for name in ("triton", "triton_kernel", "triton_qtma") + (
            () if r["inputs"] != "gaussian" else ("triton_m64n128",)
        ):
            # fx_fp8's kernels ran in the interpreter (the candidate tile too), as accurate as ref
            c = r["cells"][name]
            assert c["ms"] > 0 and c["err"] < 1.1 * r["ref_err"], (name, c, r["ref_err"])
        assert all(
            "ms" in r["cells"][n] for n in ("triton_prepass", "triton_prepass_one_launch", "triton_prepass_narrow")
        )
    variants = [r for r in res["rows"] if (r["d"], r["s"], r["mask"]) == ak.DRY_VARIANT_ROW]
    assert len(variants) == 1
    for name, *_ in ak.VARIANTS:
        assert variants[0]["cells"][name]["err"] < 1.1 * variants[0]["ref_err"], name
    text = proc.stdout
    assert "x cuDNN" in text and "(reference)" in text and "skipped: needs a GPU" in text
    assert "error:" not in text


def test_table_refuses_a_dry_run(tmp_path):
    results = {"meta": {"device": "CPU dry run (Triton interpreter; timings meaningless)"}, "rows": []}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--table-from", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "dry run" in proc.stderr


def test_without_gpu_and_without_dry_run_it_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the real probe")
    proc = subprocess.run([sys.executable, SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
