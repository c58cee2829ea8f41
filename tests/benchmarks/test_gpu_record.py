"""The GPU record (benchmarks/gpu_record.py, benchmarks/gpu_record.csv) is generated from pytest's
junit reports, and the docs show it as generated: the outcome table and the `cuda` tests no GPU has
run (collected ids minus the record's) in README.md and docs/cuda.md are what the script renders
now; gpu_run.sh's pytest step writes the junit report and merges it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_record", ROOT / "benchmarks" / "gpu_record.py")
gpu_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_record)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.ops.test_cuda_lowering" name="test_a[8-fp8]" time="0.1"/>
<testcase classname="tests.ops.test_cuda_lowering" name="test_b" time="0.1"><failure message="x">x</failure></testcase>
<testcase classname="tests.compile.test_cuda_graphs.TestReplays" name="test_c" time="0.1"/>
<testcase classname="tests.pipeline.test_offload" name="test_d" time="0"><skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>"""


def test_junit_testcases_become_node_ids_and_outcomes():
    assert gpu_record.junit_outcomes(JUNIT) == {
        "tests/ops/test_cuda_lowering.py::test_a[8-fp8]": "passed",
        "tests/ops/test_cuda_lowering.py::test_b": "failed",
        "tests/compile/test_cuda_graphs.py::TestReplays::test_c": "passed",
        "tests/pipeline/test_offload.py::test_d": "skipped",
    }
    with pytest.raises(ValueError, match="no testcase"):
        gpu_record.junit_outcomes("<testsuites><testsuite/></testsuites>")


def test_a_new_run_replaces_its_tests_rows_on_that_gpu_and_clears_their_notes():
    old = [
        dict(
            test="tests/ops/test_cuda_lowering.py::test_b",
            gpu="H200",
            torch="2.11",
            date="2026-12-04",
            outcome="failed",
            source="RESULTS.md",
            note="bound moved: to be confirmed",
        ),
        dict(
            test="tests/ops/test_cuda_lowering.py::test_b",
            gpu="H100",
            torch="2.11",
            date="2026-12-04",
            outcome="passed",
            source="RESULTS.md",
            note="",
        ),
    ]
    rows = gpu_record.merge(
        old,
        {"tests/ops/test_cuda_lowering.py::test_b": "passed", "tests/pipeline/test_offload.py::test_d": "skipped"},
        gpu="H200",
        torch="2.13",
        date="2026-12-08",
        source="junit",
    )
    assert sorted((r["gpu"], r["outcome"], r["note"], r["torch"]) for r in rows) == [
        ("H100", "passed", "", "2.11"),
        ("H200", "passed", "", "2.13"),
    ]  # a skip is not a run
    with pytest.raises(ValueError, match="--date"):
        gpu_record.merge([], {}, gpu="H200", torch="2.13", date="yesterday", source="junit")
    with pytest.raises(ValueError, match="--gpu"):
        gpu_record.merge([], {}, gpu=" ", torch="2.13", date="2026-12-08", source="junit")


def test_the_seeded_record_is_the_h200_run_results_md_reports():
    rows = gpu_record.read_record()
    h200 = [r for r in rows if r["date"] == "2026-12-04" and r["gpu"] == "NVIDIA H200"]
    assert len(h200) == 45 and sum(r["outcome"] == "passed" for r in h200) == 43
    assert all("RESULTS.md" in r["source"] for r in h200)
    failed = {r["test"].split("::")[1]: r["note"] for r in h200 if r["outcome"] == "failed"}
    assert set(failed) == {
        "test_cudnn_fp8_attention_on_gpu",
        "test_loading_onto_a_gpu_holds_the_quantized_model_and_less_than_one_bf16_layer",
    }
    assert all("to be confirmed by a GPU run" in note for note in failed.values())


def test_a_listed_test_that_ran_leaves_the_never_run_list():
    record = [
        dict(
            test="tests/test_cuda_lowering.py::test_a[1]",
            gpu="H200",
            torch="2.11",
            date="2026-12-04",
            outcome="passed",
            source="s",
            note="",
        )
    ]
    collected = ["tests/ops/test_cuda_lowering.py::test_a[1]", "tests/ops/test_cuda_lowering.py::test_a[2]"]
    assert gpu_record.never_ran(record, collected) == ["tests/ops/test_cuda_lowering.py::test_a[2]"]
    block = gpu_record.render(record, collected)
    assert "1 of 2" in block and "`tests/ops/test_cuda_lowering.py::test_a[2]`" in block


def test_gpu_run_writes_junit_and_merges_it_into_the_record():
    script = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    pytest_step = next(line for line in script.splitlines() if line.strip().startswith("pytest)"))
    assert '--junitxml "$OUT/pytest-junit.xml"' in pytest_step and "-m cuda" in pytest_step
    assert '[ "$step" = pytest ] && record_gpu_run' in script
    assert 'gpu_record.py" add "$OUT/pytest-junit.xml"' in script


def test_real_junit_output_round_trips(tmp_path):
    """pytest's own junit writer, on a throwaway test file: the ids come back as pytest names them."""
    folder = tmp_path / "tests" / "ops"
    folder.mkdir(parents=True)
    (folder / "test_tiny.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', [1, 2])\ndef test_n(n):\n    assert n == 1\n"
    )
    xml = tmp_path / "junit.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "--junitxml",
            str(xml),
            "tests/ops/test_tiny.py",
        ],
        cwd=tmp_path,
        capture_output=True,
    )
    assert gpu_record.junit_outcomes(xml.read_text()) == {
        "tests/ops/test_tiny.py::test_n[1]": "passed",
        "tests/ops/test_tiny.py::test_n[2]": "failed",
    }


def test_the_docs_show_the_record_and_the_never_run_list_as_generated():
    record, collected = gpu_record.read_record(), gpu_record.collected_cuda_ids()
    missing = gpu_record.never_ran(record, collected)
    assert missing  # today some cuda tests never ran on a GPU: the docs must say which
    for doc in gpu_record.DOCS:
        block = gpu_record.render(record, collected, list_never_ran=doc in gpu_record.FULL)
        assert "cuda` tests no GPU has run" in block and f"{len(missing)} of {len(collected)}" in block
        text = doc.read_text()
        assert block in text, (
            f"{doc.relative_to(ROOT)} does not show the current GPU record: run `python benchmarks/gpu_record.py docs`"
        )
