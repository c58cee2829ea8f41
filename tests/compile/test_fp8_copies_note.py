"""The plain torch.compile path keeps the full-precision weights beside compile-time FP8 copies: one
INFO record per model says how many bytes the copies hold and how to avoid them;
a prepared model, which holds only its FP8 weights, gets none."""

from __future__ import annotations

import logging
import re

import torch
import torch.nn as nn

import fx_fp8


class _TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()  # a second graph with copies of its own
        return self.b(x)


def _notes(caplog, model) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fx_fp8"), torch.no_grad():
        torch.compile(model, backend="fp8")(torch.randn(4, 64))
    return [r.getMessage() for r in caplog.records if "made FP8 copies" in r.getMessage()]


def test_one_note_per_model_with_the_bytes_and_the_way_to_avoid_them(caplog):
    (note,) = _notes(caplog, _TwoGraphs())
    copies = 64 * 64 + 64 * 4  # one graph: FP8 codes and fp32 channel scales
    mib = re.search(r": ([\d.]+) MiB, kept beside the ([\d.]+) MiB", note)
    assert mib and float(mib[1]) == round(copies / 2**20, 2) and float(mib[2]) == round(64 * 64 * 4 / 2**20, 2)
    assert "fx_fp8.prepare_model(model)" in note and "DiffusersConfig" in note


def test_a_prepared_model_gets_no_note(caplog):
    model = _TwoGraphs()
    fx_fp8.prepare_model(model)
    assert _notes(caplog, model) == []
