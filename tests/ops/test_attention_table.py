"""attention.kernel "auto" on CUDA: the measured table (fx_fp8.ops.attention_table), built from a probe run
of benchmarks/attention_kernels.py, and how the CUDA lowering picks from it at compile time."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import attention_table as at
from fx_fp8.ops import tune_table
from fx_fp8.ops.lowering import get_lowering


def cells(triton_ms, triton_err, cudnn_ms=None, cudnn_err=None, base=1.0):
    c = {
        "cudnn_bf16": {"ms": base, "err": 0.002},
        "triton": {"ms": triton_ms, "err": triton_err},
        "triton_kernel": {"ms": triton_ms * 0.9, "err": triton_err},
        "sage": {"error": "RuntimeError: x"},
    }
    if cudnn_ms is not None:
        c["cudnn_fp8"] = {"ms": cudnn_ms, "err": cudnn_err}
    return c


def probe(device="NVIDIA H200"):
    rows = [
        # D128 without mask: cuDNN FP8 fastest but too inaccurate at 4608, accurate at 16384
        {"d": 128, "s": 1024, "mask": False, "inputs": "gaussian", "ref_err": 0.006, "cells": cells(0.05, 0.0063)},
        {
            "d": 128,
            "s": 4608,
            "mask": False,
            "inputs": "gaussian",
            "ref_err": 0.0036,
            "cells": cells(0.30, 0.0040, 0.20, 0.0060),
        },
        {
            "d": 128,
            "s": 16384,
            "mask": False,
            "inputs": "gaussian",
            "ref_err": 0.0028,
            "cells": cells(3.0, 0.0030, 2.5, 0.0035, base=5.4),
        },
        {"d": 128, "s": 4608, "mask": True, "inputs": "gaussian", "ref_err": 0.004, "cells": cells(0.31, 0.0045)},
        # no FP8 kernel meets the bar: native BF16 attention is the only pick
        {"d": 64, "s": 4608, "mask": False, "inputs": "gaussian", "ref_err": 0.004, "cells": cells(0.2, 0.009)},
        # BF16 attention faster than every FP8 kernel: native
        {
            "d": 64,
            "s": 16384,
            "mask": False,
            "inputs": "gaussian",
            "ref_err": 0.003,
            "cells": cells(3.0, 0.0031, base=2.0),
        },
        # the outlier row measures robustness, not what to pick
        {"d": 128, "s": 4608, "mask": False, "inputs": "outlier x5", "ref_err": 0.01, "cells": cells(0.3, 0.011)},
    ]
    return {
        "meta": {"device": device, "date": "2026-01-01", "torch": "2.11", "triton": "3.6", "cudnn_frontend": "1.32.0"},
        "rows": rows,
    }


def test_table_from_a_probe_run():
    table = at.table_from_probe(probe())
    rows = {(r["d"], r["mask"], r["s_measured"]): r for r in table["rows"]}
    assert set(rows) == {
        (128, False, 1024),
        (128, False, 4608),
        (128, False, 16384),
        (128, True, 4608),
        (64, False, 4608),
        (64, False, 16384),
    }
    # S ranges split at the geometric midpoints, open at both ends
    assert (rows[128, False, 1024]["s_min"], rows[128, False, 1024]["s_max"]) == (1, 2171)
    assert (rows[128, False, 4608]["s_min"], rows[128, False, 4608]["s_max"]) == (2172, 8687)
    assert (rows[128, False, 16384]["s_min"], rows[128, False, 16384]["s_max"]) == (8688, None)
    assert rows[128, True, 4608]["s_min"] == 1 and rows[128, True, 4608]["s_max"] is None
    # only kernels the lowering can run are kept, with time and error ("native": BF16 SDPA, the baseline)
    assert set(rows[128, False, 4608]["kernels"]) == {"triton", "cudnn", "native"}
    assert rows[128, False, 16384]["baseline_ms"] == 5.4
    # the pick: the fastest kernel within BAR x the reference's error
    assert rows[128, False, 4608]["pick"] == "triton"  # cuDNN FP8 is faster but 1.67x the reference's error
    assert rows[128, False, 16384]["pick"] == "cudnn"
    assert rows[64, False, 4608]["pick"] == "native"  # no FP8 kernel within the bar
    assert rows[64, False, 16384]["pick"] == "native"  # the FP8 kernel is accurate but slower than BF16
    assert table["source"]["device"] == "NVIDIA H200" and table["bar"] == at.BAR


def test_a_dry_run_cannot_become_the_table():
    with pytest.raises(ValueError, match="dry run"):
        at.table_from_probe(probe(device="CPU dry run (Triton interpreter; timings meaningless)"))


def test_auto_kernel_picks_by_gpu_head_dim_mask_and_length():
    table = at.table_from_probe(probe())
    yes = lambda name: True  # noqa: E731
    kernel, why = at.auto_kernel("NVIDIA H200", 128, 20000, False, "triton", yes, table)
    assert kernel == "cudnn" and "NVIDIA H200 D128 S 8688-inf" in why and "err 0.35 %" in why, why
    assert at.auto_kernel("NVIDIA H200", 128, 5000, False, "triton", yes, table)[0] == "triton"
    # a node cuDNN cannot run (block scales, a mask...) gets the fastest kernel it can run
    kernel, why = at.auto_kernel("NVIDIA H200", 128, 20000, False, "triton", lambda n: n != "cudnn", table)
    assert kernel == "triton" and "3.000 ms" in why, why
    for args in (
        ("NVIDIA H100 80GB HBM3", 128, 20000, False),
        ("NVIDIA H200", 80, 20000, False),
        (None, 128, 20000, False),
    ):
        kernel, why = at.auto_kernel(*args, "triton", yes, table)
        assert kernel == "triton" and why.startswith("no measured row"), why
    kernel, why = at.auto_kernel("NVIDIA H200", 128, None, False, "triton", yes, table)
    assert kernel == "triton" and "symbolic" in why
    kernel, why = at.auto_kernel("NVIDIA H200", 64, 30000, False, "triton", yes, table)
    assert kernel == "native" and "BF16 SDPA 2.000 ms, FP8 triton 3.000 ms" in why, why
    no_native = {
        "rows": [dict(r, kernels={k: c for k, c in r["kernels"].items() if k != "native"}) for r in table["rows"]]
    }
    kernel, why = at.auto_kernel("NVIDIA H200", 64, 4608, False, "triton", yes, no_native)
    assert kernel == "triton" and "error bar" in why


def test_the_shipped_table_is_consistent():
    table = at.load_table()
    assert table["bar"] == at.BAR
    by_key = {}
    for row in table["rows"]:
        assert row["pick"] == at._pick(row["kernels"], row["ref_err"]), row  # the stored pick is the rule's
        assert set(row["kernels"]) <= set(at.PROBE_KERNELS.values()), row
        by_key.setdefault((row["gpu"], row["d"], row["mask"]), []).append(row)
    for rows in by_key.values():  # the S ranges of one GPU / D / mask tile the lengths without overlap
        rows.sort(key=lambda r: r["s_min"])
        assert rows[0]["s_min"] == 1 and rows[-1]["s_max"] is None
        assert rows  # not vacuous: all() of nothing is True
        assert all(a["s_max"] + 1 == b["s_min"] for a, b in zip(rows, rows[1:]))


def test_cuda_lowering_reports_the_measured_pick(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(at, "gpu_name", lambda device: "NVIDIA H200")
    # the user's own table (the cache folder's, written by `fx-fp8 tune`) comes before the shipped H200 one
    monkeypatch.setenv("FX_FP8_TUNE_DIR", str(tmp_path))
    at.write_table(at.table_from_probe(probe()), tmp_path)
    (written,) = tmp_path.glob("*.json")
    table = tune_table.load(written)
    with FakeTensorMode():
        key = tune_table.device_key(torch.empty(1, device="cuda").device)
    tune_table.write(dict(table, key=key), tmp_path / tune_table.file_name(key))
    from fx_fp8.ops import cudnn_attention

    monkeypatch.setattr(cudnn_attention, "import_reason", lambda: None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    low = get_lowering("cuda")
    with FakeTensorMode():
        q = torch.empty(1, 2, 20000, 128, device="cuda", dtype=torch.bfloat16)
        block = FP8Config.load(None, attention={}).attention
        tensor = FP8Config.load(None, attention={"granularity": "tensor"}).attention
        kernel, how = low.attention_kernel(q, q, q, block)  # cuDNN takes per-tensor scales only
        assert kernel == "triton" and "measured on NVIDIA H200 D128 S 8688-inf: 3.000 ms" in how, how
        kernel, how = low.attention_kernel(q, q, q, tensor)
        assert kernel == "cudnn" and how.startswith("cuDNN FP8 SDPA") and "2.500 ms" in how, how
        kernel, how = low.attention_kernel(q, q, q, FP8Config.load(None, attention={"kernel": "triton"}).attention)
        assert (kernel, how) == ("triton", "Triton FP8 kernel")  # an explicit kernel is not looked up


def test_auto_keeps_attention_native_where_bf16_is_measured_faster(monkeypatch, tmp_path):
    """The CUDA lowering refuses FP8 attention, with the measurement as the report's reason, where
    the table says native BF16 attention is faster; an explicit kernel still runs FP8."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(at, "gpu_name", lambda device: "NVIDIA H200")
    table = at.table_from_probe(probe())
    monkeypatch.setattr(at, "rows_for", lambda device: table)
    low = get_lowering("cuda")
    with FakeTensorMode():
        q = torch.empty(1, 2, 20000, 64, device="cuda", dtype=torch.bfloat16)
        auto = FP8Config.load(None, attention={}).attention
        reason = low.attention_reason(q, q, q, auto)
        assert reason is not None and reason.startswith("attention.kernel auto: native attention is faster here")
        assert "BF16 SDPA 2.000 ms, FP8 triton 3.000 ms" in reason and "attention.kernel: triton" in reason
        assert low.attention_reason(q, q, q, FP8Config.load(None, attention={"kernel": "triton"}).attention) is None
        short = torch.empty(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16)  # triton is faster there
        assert low.attention_reason(short, short, short, auto) is None


def test_the_shipped_h200_table_keeps_flux_length_attention_native():
    """What the H200 probe of 2026-12-04 measured: the accurate FP8 kernel (with its Q/K/V pre-pass) is
    slower than cuDNN's BF16 attention up to ~23k keys at D128 (S 16384: 5.50 vs 4.80 ms) and faster
    beyond (S 32760: 20.99 vs 23.12 ms); at D64 and with masks BF16 wins."""
    table = at.load_table()
    yes = lambda name: True  # noqa: E731
    assert at.auto_kernel("NVIDIA H200", 128, 4608, False, "triton", yes, table)[0] == "native"
    assert at.auto_kernel("NVIDIA H200", 128, 16384, False, "triton", yes, table)[0] == "native"
    assert at.auto_kernel("NVIDIA H200", 128, 32760, False, "triton", yes, table)[0] == "triton"
    assert at.auto_kernel("NVIDIA H200", 64, 4608, False, "triton", yes, table)[0] == "native"


def test_a_probe_run_replaces_its_gpus_rows_and_keeps_the_others():
    h200 = at.table_from_probe(probe("NVIDIA H200"))
    h100 = at.table_from_probe(probe("NVIDIA H100 80GB HBM3"))
    both = at.merged(h200, h100)
    assert {r["gpu"] for r in both["rows"]} == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    assert len(both["rows"]) == len(h200["rows"]) + len(h100["rows"])
    again = at.merged(both, at.table_from_probe(probe("NVIDIA H100 80GB HBM3")))
    assert len(again["rows"]) == len(both["rows"])  # its own old rows replaced, not doubled
    assert [s["device"] for s in again["sources"]] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]


def test_a_probe_run_writes_into_its_gpus_tune_table_and_keeps_the_linears(tmp_path):
    ((path, shipped),) = tune_table.shipped_tables()
    linear = {
        "m": 16,
        "k": 64,
        "n": 64,
        "dtype": "bfloat16",
        "bias": True,
        "role": "w8a8",
        "candidates": {"native": {"ms": 1.0, "err": 0.0}},
    }
    tune_table.write(dict(shipped, linears=[linear]), tmp_path / path.name)
    at.write_table(at.table_from_probe(probe("NVIDIA H200")), tmp_path)
    written = tune_table.load(tmp_path / path.name)
    assert written["linears"] == [linear] and written["key"] == shipped["key"]
    assert (
        len(written["attention"]) == 6 and written["source"]["tool"] == "benchmarks/attention_kernels.py --table-from"
    )
    assert at.load_table(tmp_path)["rows"][0]["gpu"] == "NVIDIA H200"
