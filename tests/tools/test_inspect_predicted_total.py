"""`fx-fp8 inspect` with a tune table: the rows it decided name the pick and its times, and the summary
prints the model's predicted total (the measured linears' picked times) next to native; without a
table it says none applies."""

from __future__ import annotations

import json
import re
import warnings

import torch

from fx_fp8.ops import tune_table
from fx_fp8.tools.cli import main
from fx_fp8.tools.cli_inspect import _predicted_line


def run(argv, capsys) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(argv) == 0
    return capsys.readouterr().out


def test_inspect_prints_the_predicted_total_next_to_native(tmp_path, capsys):
    row = {
        "m": 64,
        "k": 64,
        "n": 64,
        "dtype": "float32",
        "bias": True,
        "role": "w8a8",
        "candidates": {"native": {"ms": 1.0, "err": 0.0}, "fp8_rowwise": {"ms": 0.5, "err": 0.03}},
    }
    table = {
        "format": tune_table.FORMAT,
        "key": tune_table.device_key(torch.device("cpu")),
        "bar": 1.5,
        "source": {"what": "test", "date": "2026-12-07", "tool": "pytest"},
        "linears": [row],
        "attention": [],
    }
    path = tune_table.write(table, tmp_path / "cpu.json")
    config = tmp_path / "c.yaml"
    config.write_text(f"quantization_config:\n  tune_table: {json.dumps(str(path))}\n")
    out = run(["inspect", "--model", "flux", "--config", str(config)], capsys)
    m = re.search(
        r"predicted total \(fx-fp8 tune table\): ([\d.]+) ms over (\d+) measured linears, "
        r"native ([\d.]+) ms \(2\.00x\)",
        out,
    )
    assert m, out[-1500:]
    n = int(m.group(2))
    assert n >= 4 and float(m.group(1)) == 0.5 * n and float(m.group(3)) == 1.0 * n
    assert "tuned: fp8_rowwise (2.00x native)" in out
    nothing = {"nodes": 0, "predicted_ms": 0, "native_ms": 0}
    assert _predicted_line(dict(nothing, lowerings=["reference"])).startswith(
        "predicted total: none (no tune table applies to this lowering"
    )
    assert _predicted_line(dict(nothing, lowerings=["cuda"])) == (
        "predicted total: no node measured on this GPU (fx-fp8 tune)"
    )
