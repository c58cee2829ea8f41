"""What the first compiled call and prepare_model say at INFO on logging.getLogger("fx_fp8"), the
progress bar over prepare_model's layers on a terminal, and silence at the default level."""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8 import progress

from toy_models import AttentionBlock


def _fx_fp8_ops(gm) -> dict:
    counts: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("fx_fp8."):
            name = str(n.target)[len("fx_fp8.") :].removesuffix(".default")
            counts[name] = counts.get(name, 0) + 1
    return counts


def _run(options=None, steps=(None,)):
    torch.manual_seed(0)
    compiled = torch.compile(AttentionBlock(relu=False).eval(), backend="fp8", options=options or {})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            fx_fp8.set_step(step)
            compiled(torch.randn(2, 16, 64))
    return compiled


def _messages(caplog, *, copies_note: bool = False) -> list[str]:
    """fx_fp8's INFO records: the compile records, or (copies_note) the once-per-model note on the
    compile-time FP8 weight copies (tests/compile/test_fp8_copies_note.py checks its text)."""
    return [
        m
        for r in caplog.records
        if r.name == "fx_fp8" and r.levelno == logging.INFO
        for m in [r.getMessage()]
        if ("made FP8 copies" in m) == copies_note
    ]


def test_first_call_says_what_it_compiled_and_how_long_it_took(caplog, downstream_graphs):
    with caplog.at_level(logging.INFO, logger="fx_fp8"):
        compiled = _run()
    before, after = _messages(caplog)
    assert len(_messages(caplog, copies_note=True)) == 1  # the plain path's weight copies, said once
    # the counts are the graph's: one SDPA node and three linear nodes in AttentionBlock's graph
    (gm,) = downstream_graphs
    ops = _fx_fp8_ops(gm)
    assert ops["fp8_attention"] == 1 and ops["weight_only_linear"] == 1 and ops.get("scaled_mm", 0) == 2, ops
    assert not any(n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)
    assert before.startswith("fx_fp8: graph 0: attention 1 fp8 of 1; linear 2 fp8, 1 weight-only of 3; ")
    assert "kernels: fp8_attention[auto] x1, scaled_mm x2, weight_only_linear x1;" in before
    assert "lowering reference" in before and before.endswith("compiling with eager...")
    assert re.search(r"passes \d+\.\d\d s", before)
    assert re.match(
        r"fx_fp8: graph 0 compiled by eager in \d+\.\d\d s \(\d+\.\d\d s since the model's first graph "
        r"reached the backend\); model so far: 1 graph instance\(s\), attention 1 fp8 of 1, "
        r"linear 2 fp8, 1 weight-only of 3$",
        after,
    ), after
    (report,) = fx_fp8.get_reports(compiled)  # the same counts as the report
    assert report.count("linear", "fp8") == 2 and report.count("linear", "weight-only") == 1


def test_each_step_variant_is_one_compile_record(caplog, downstream_graphs):
    with caplog.at_level(logging.INFO, logger="fx_fp8"):
        _run({"diffusion_kv_cache_skip_steps": "0"}, steps=(0, 1))
    messages = [m for m in _messages(caplog) if "compiled by" not in m]
    assert len(messages) == len(downstream_graphs) == 2
    native, fp8 = messages  # step 0 skips FP8 attention: its variant compiles first
    # the graph number is the report's index in fx_fp8.get_reports(compiled): both variants' reports
    # are made on the first call, the fp8 one first
    assert native.startswith("fx_fp8: graph 1, step variant native: attention 1 native of 1;")
    assert "fp8_attention" not in native
    assert fp8.startswith("fx_fp8: graph 0, step variant fp8: attention 1 fp8 of 1;")
    assert [_fx_fp8_ops(g).get("fp8_attention", 0) for g in downstream_graphs] == [0, 1]


def test_silent_at_the_default_level(capfd):
    assert logging.getLogger("fx_fp8").handlers == []  # the package never installs a handler
    assert not logging.getLogger("fx_fp8").isEnabledFor(logging.INFO)
    _run()
    model = AttentionBlock(relu=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.prepare_model(model)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prepare_model_shows_a_bar_on_a_terminal_and_logs_a_summary(monkeypatch, caplog):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.INFO, logger="fx_fp8"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fx_fp8.prepare_model(AttentionBlock(relu=False))
    assert "fx_fp8: quantizing linears" in terminal.getvalue() and " 0/3 " in terminal.getvalue()
    (summary,) = _messages(caplog)
    assert len(result["quantized"]) == 3 and len(result["weight_only"]) == 1
    assert re.match(
        r"fx_fp8: prepare_model quantized 3 linear\(s\) \(1 weight-only\), kept 0 native, left 0 with "
        r"hooks, in \d+\.\d\d s: their weights 0\.1 MiB -> 0\.0 MiB \(fp8\)$",
        summary,
    ), summary


def test_progress_bar_switches(monkeypatch):
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    try:
        fx_fp8.prepare_model(nn.Sequential(nn.Linear(64, 64)))
        assert plain.getvalue() == ""  # not a terminal: no bar
        progress.enable_progress_bar()
        fx_fp8.prepare_model(nn.Sequential(nn.Linear(64, 64)))
        assert " 0/1 " in plain.getvalue()
        monkeypatch.setattr(sys, "stderr", _Terminal())
        progress.disable_progress_bar()
        fx_fp8.prepare_model(nn.Sequential(nn.Linear(64, 64)))
        assert sys.stderr.getvalue() == ""
    finally:
        progress.reset_progress_bar()
