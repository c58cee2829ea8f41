"""fx_fp8.tune and `fx-fp8 tune` on CPU: the distinct shapes by the backend's analysis, every candidate
timed by a stand-in timer (the measuring loop) with its error against native, the picks, the table
written where asked and parsed back; --dry-run's CPU timings labelled as not a GPU's; and, on a GPU
(-m cuda), tune on a tiny Flux followed by the compiled graph."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.ops import tune_table
from fx_fp8.tools.cli import main
from fx_fp8.tuning import format_summary


class Block(nn.Module):
    """Two shapes twice each (W8A8 role), and a final projection (a sensitive layer: weight-only role)."""

    def __init__(self, dim=64):
        super().__init__()
        self.a1, self.a2 = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.b1, self.b2 = nn.Linear(2 * dim, dim), nn.Linear(2 * dim, dim)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.b1(torch.relu(self.a1(x))) + self.b2(torch.relu(self.a2(x)))
        return self.proj_out(h)


class StandIn:
    """A timer that calls the candidate once and answers the next of `times`."""

    def __init__(self, times):
        self.times, self.calls = itertools.cycle(times), 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return next(self.times)


def test_the_measuring_loop_times_every_candidate_of_every_distinct_shape(tmp_path):
    timer = StandIn([1.0, 0.5, 0.7, 0.9, 2.0, 3.0])  # native, fp8_rowwise, fp8_block, int8, wo int8, wo fp8
    model = Block()
    out = tmp_path / "table.json"
    table = fx_fp8.tune(model, {"x": torch.randn(2, 8, 64)}, dry_run=True, timer=timer, out=out)
    assert table["written"] == [str(out)]  # a dry run never lands in the cache `auto` reads
    assert tune_table.load(out)["linears"] == table["linears"]
    assert table["key"]["gpu"] == "cpu" and "CPU dry run: CPU timings, not a GPU's" in table["source"]["what"]
    rows = {(r["k"], r["n"], r["role"]): r for r in table["linears"]}
    assert set(rows) == {(64, 128, "w8a8"), (128, 64, "w8a8"), (64, 64, "weight_only")}
    assert rows[64, 128, "w8a8"]["count"] == 2 and rows[64, 128, "w8a8"]["m"] == 16
    w8a8 = rows[64, 128, "w8a8"]["candidates"]
    assert list(w8a8) == ["native", "fp8_rowwise", "fp8_block", "int8_rowwise", "weight_only_int8", "weight_only_fp8"]
    assert [c["ms"] for c in w8a8.values()] == [1.0, 0.5, 0.7, 0.9, 2.0, 3.0]
    assert w8a8["native"]["err"] == 0.0 and all(0 < c["err"] < 0.1 for n, c in w8a8.items() if n != "native")
    assert rows[64, 128, "w8a8"]["pick"] == rows[64, 128, "w8a8"]["fastest"] == "fp8_rowwise"
    assert list(rows[64, 64, "weight_only"]["candidates"]) == ["native", "weight_only_int8", "weight_only_fp8"]
    assert timer.calls == 2 * 6 + 3
    summary = format_summary(table)
    assert "linear 16x64->128 w8a8" in summary and "fp8_rowwise 0.500" in summary and "2.00x" in summary


def test_tune_then_compile_follows_the_measurement_end_to_end(tmp_path):
    """The CPU path of the -m cuda test below: a dry-run table (stand-in times: FP8 wins at the a-shape,
    loses at the b-shape, weight-only INT8 wins for proj_out) given as tune_table, then the model
    compiled with it runs each linear as its shape's pick says."""
    times = (
        [1.0, 0.5, 0.6, 0.7, 0.8, 0.9]  # a1 / a2 (64 -> 128): fp8_rowwise
        + [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]  # b1 / b2 (128 -> 64): every FP8 form slower: native
        + [1.0, 0.5, 0.9]
    )  # proj_out (weight-only role): weight_only_int8
    model, x = Block(), torch.randn(2, 8, 64)
    table = fx_fp8.tune(model, {"x": x}, dry_run=True, timer=StandIn(times), out=tmp_path / "t.json")
    assert [r["pick"] for r in table["linears"]] == ["fp8_rowwise", "native", "weight_only_int8"]
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    config = {"quantization_config": {"tune_table": str(tmp_path / "t.json")}}
    with torch.no_grad():
        torch.compile(model, backend="fp8", options={"config": config})(x)
    actions = {e.module: e.action for r in fx_fp8.get_reports() for e in r.entries if e.op == "linear"}
    assert actions == {"a1": "fp8", "a2": "fp8", "b1": "native", "b2": "native", "proj_out": "weight-only"}


def test_a_candidate_that_fails_is_kept_with_why(monkeypatch):
    """A candidate the backend refuses (here a block size no config takes) is a measurement, not a
    crash: its cell names the error, the others are timed, the pick comes from them."""
    from fx_fp8.tuning import candidates

    monkeypatch.setitem(candidates.LINEAR_CONFIGS, "fp8_block", ({"method": "fp8", "weight_block_size": [7]}, "lin"))
    table = fx_fp8.tune(Block(), {"x": torch.randn(2, 8, 64)}, dry_run=True, timer=StandIn([1.0, 0.5]))
    r = next(r for r in table["linears"] if r["role"] == "w8a8")
    assert "fp8_block" not in r["candidates"] and "native" in r["candidates"]
    assert r["errors"]["fp8_block"].startswith("ValueError: invalid weight_block_size [7]"), r["errors"]


def test_a_budget_measures_the_largest_shares_of_the_work_first(monkeypatch):
    from fx_fp8.tuning import run

    ticks = itertools.count()
    monkeypatch.setattr(run, "_clock", lambda: float(next(ticks)))  # one second per look at the clock
    table = fx_fp8.tune(Block(), {"x": torch.randn(2, 8, 64)}, dry_run=True, timer=StandIn([1.0]), budget_s=3.5)
    # the trace (ticks 0-1), then 2 nodes each before proj_out's 1
    assert [(r["k"], r["n"]) for r in table["linears"]] == [(64, 128), (128, 64)]
    assert table["unmeasured"] == ["linear M 16 K 64 N 64 float32 bias (weight_only)"]
    assert table["source"]["budget"] == "3.5 s reached: 1 shapes not measured"
    assert "budget 3.5 s reached" in format_summary(table)


def test_candidates_keep_the_recipe_and_drop_what_names_the_models_layers_or_steps():
    from fx_fp8.config.fp8_config import FP8Config
    from fx_fp8.tuning.candidates import candidate_base

    user = FP8Config.load(
        None,
        quantization_config={
            "skip_steps": "0,1",
            "ignored_layers": ["x_embedder"],
            "fast_accum": False,
            "weight_only_method": "fp8",
        },
        diffusion_kv_cache_skip_steps="0",
        attention={"granularity": "head"},
    )
    base = candidate_base(user)
    qc = base.quantization_config
    assert (str(qc.skip_steps), qc.ignored_layers, str(base.diffusion_kv_cache_skip_steps)) == ("", (), "")
    assert (qc.kernel, qc.activation_scheme, qc.fast_accum, qc.weight_only_method) == ("rules", "dynamic", False, "fp8")
    assert base.attention.granularity == "head"


def test_tune_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="not a CUDA GPU: .*dry_run=True"):
        fx_fp8.tune(Block(), {"x": torch.randn(2, 64)})
    with pytest.raises(ValueError, match="needs example_inputs"):
        fx_fp8.tune(Block(), None, dry_run=True)
    with pytest.raises(ValueError, match="expected a model .* got str"):
        fx_fp8.tune("flux", {"x": 1}, dry_run=True)


def test_cli_dry_run_prints_the_summary_and_writes_out(tmp_path, capsys):
    out = tmp_path / "t.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["tune", "--model", "flux", "--dry-run", "--max-shapes", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "fx-fp8 tune on cpu (CPU dry run: CPU timings, not a GPU's): 1 linear and 1 attention shapes" in printed.out
    assert f"wrote {out}" in printed.err
    t = json.loads(out.read_text())
    assert len(t["linears"]) == 1 and len(t["attention"]) == 1 and t["attention"][0]["kernels"]["reference"]["ms"]


def test_cli_without_a_gpu_or_dry_run_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tune measures on it")
    assert main(["tune", "--model", "flux"]) == 2
    assert "none is visible" in capsys.readouterr().err
    assert main(["tune", "--model", "flux", "--dry-run", "--max-shapes", "0"]) == 2
    assert "invalid --max-shapes 0" in capsys.readouterr().err


@pytest.mark.cuda
def test_tune_on_a_tiny_flux_then_the_compiled_graph_holds_the_picks(tmp_path, monkeypatch):
    """On a GPU: tune a tiny Flux (bf16), then compile it with kernel auto; every linear's report row
    names the table's pick for its shape and runs it (native rows native, FP8 picks FP8)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    monkeypatch.setenv("FX_FP8_TUNE_DIR", str(tmp_path))
    model = build_tiny_transformer("flux", dtype=torch.bfloat16).cuda()
    kw = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v
        for k, v in example_inputs("flux", model, dtype=torch.bfloat16).items()
    }
    table = fx_fp8.tune(model, kw, max_shapes=4)  # the 4 largest shares of the work: a minute of compiles
    assert table["written"] and table["written"][0].startswith(str(tmp_path))
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    with torch.no_grad():
        torch.compile(model, backend="fp8")(**kw)
    entries = [e for r in fx_fp8.get_reports() for e in r.entries if e.op == "linear" and e.timing]
    assert entries, "no linear followed the table"
    picks = {(r["m"], r["k"], r["n"], r["role"]): r["pick"] for r in table["linears"]}
    qcfg = fx_fp8.FP8Config().quantization_config
    want = {
        "native": "native",
        "fp8_rowwise": "fp8",
        "weight_only_int8": "weight-only",
        "weight_only_fp8": "weight-only",
    }
    for e in entries:
        x, w = e.dims[0], e.dims[-1]
        m, role = math.prod(x[:-1]), "weight_only" if "sensitive: weight_only" in e.reason else "w8a8"
        bias = model.get_submodule(e.module).bias is not None
        pick = tune_table.linear_pick(
            table, m, w[1], w[0], "bfloat16", bias, role, tune_table.emitted_candidates(qcfg, role)
        )[0]
        assert picks.get((m, w[1], w[0], role), pick) == pick  # a measured shape: the row's own pick
        assert e.action == want[pick] and f"tuned: {pick}" in e.reason, (e.module, e.action, pick, e.reason)


def test_a_second_model_tuned_on_the_gpu_keeps_the_firsts_shapes():
    from fx_fp8.tuning.run import merged

    key = dict.fromkeys(tune_table.KEY_FIELDS, "k")

    def lin(m, ms):
        return {
            "m": m,
            "k": 64,
            "n": 64,
            "dtype": "bfloat16",
            "bias": True,
            "role": "w8a8",
            "candidates": {"native": {"ms": ms, "err": 0.0}},
        }

    def att(s):
        return {"d": 128, "mask": False, "s_measured": s, "ref_err": 0.003, "kernels": {"native": {"ms": 1, "err": 0}}}

    flux = {
        "key": key,
        "source": {"model": "FluxTransformer2DModel", "date": "2026-12-07"},
        "linears": [lin(4096, 1.0), lin(512, 0.2)],
        "attention": [att(4608)],
    }
    wan = {
        "key": key,
        "source": {"model": "WanTransformer3DModel", "date": "2026-12-08"},
        "linears": [lin(4096, 0.9), lin(75600, 9.0)],
        "attention": [att(75600)],
    }
    both = merged(flux, wan)
    assert sorted((r["m"], r["candidates"]["native"]["ms"]) for r in both["linears"]) == [
        (512, 0.2),
        (4096, 0.9),
        (75600, 9.0),
    ]  # the shape both measured: the newer time
    assert [(r["s_measured"], r["s_min"], r["s_max"]) for r in both["attention"]] == [
        (4608, 1, 18663),
        (75600, 18664, None),
    ]
    assert both["source"]["model"] == "FluxTransformer2DModel, WanTransformer3DModel"
    assert merged(dict(flux, key=dict(key, torch="other")), wan) is wan  # another key: the new table alone
