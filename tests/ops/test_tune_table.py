"""The per-GPU tune tables (fx_fp8.ops.tune_table): the shipped ones, which table applies to a device
(key, cache folder, INFO when one is ignored), bad tables named, and the linear pick by measurement
(fastest within the error bound, a measurable gain over native, interpolation / nearest M)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import attention_table, tune_table


def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_table, "gpu_name", lambda device: "NVIDIA H200")
    with FakeTensorMode():
        return torch.empty(1, device="cuda").device


def table(key, linears=(), attention=()):
    return {
        "format": tune_table.FORMAT,
        "key": key,
        "bar": 1.5,
        "linears": list(linears),
        "attention": list(attention),
        "source": {"what": "a test", "date": "2026-12-07", "tool": "pytest"},
    }


def lin(m, native, fp8, wo=None, err=0.03, k=3072, n=3072, role="w8a8"):
    cands = {"native": {"ms": native, "err": 0.0}, "fp8_rowwise": {"ms": fp8, "err": err}}
    if wo is not None:
        cands["weight_only_int8"] = {"ms": wo, "err": 0.01}
    return {"m": m, "k": k, "n": n, "dtype": "bfloat16", "bias": True, "role": role, "candidates": cands}


def test_every_shipped_table_parses_and_names_its_source():
    shipped = tune_table.shipped_tables()
    assert shipped, "the package ships the H200's measured attention rows as a tune table"
    for path, t in shipped:
        assert tune_table.validate(json.loads(path.read_text()), path.name) == t
        assert all(t["source"][f] for f in tune_table.SOURCE_FIELDS), path
        assert all(t["key"][f] for f in ("gpu", "capability", "torch", "triton", "fx_fp8")), path
        assert path.name == tune_table.file_name(t["key"])
    # no H100 table yet: none was measured on one (fx-fp8 tune on an H100 is owed)
    assert {t["key"]["gpu"] for _, t in shipped} == {"NVIDIA H200"}
    ((_, h200_table),) = shipped
    assert h200_table["source"]["what"] == "2026-12-04 H200 run, attention only" and h200_table["linears"] == []
    assert h200_table["key"]["torch"] == "2.11.0+cu130" and h200_table["key"]["triton"] == "3.6.0"


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FX_FP8_TUNE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_table.cache_dir() == tmp_path / "fx_fp8" / "tune"
    monkeypatch.setenv("FX_FP8_TUNE_DIR", str(tmp_path / "mine"))
    assert tune_table.cache_dir() == tmp_path / "mine"


def test_a_cached_table_of_another_key_is_ignored_with_an_info_line(monkeypatch, tmp_path, caplog):
    device = h200(monkeypatch)
    monkeypatch.setenv("FX_FP8_TUNE_DIR", str(tmp_path))
    key = tune_table.device_key(device)
    assert key["gpu"] == "NVIDIA H200" and key["capability"] == [9, 0]
    path = tmp_path / tune_table.file_name(key)
    tune_table.write(table(key, [lin(4096, 1.0, 0.5)]), path)
    where, found = tune_table.table_for(device)
    assert where == str(path) and found["linears"]
    tune_table.write(table(dict(key, torch="2.0.0"), [lin(4096, 1.0, 0.5)]), path)
    with caplog.at_level(logging.INFO, logger="fx_fp8"):
        where, found = tune_table.table_for(device)
    assert where == "shipped nvidia_h200-sm90.json"  # the user's table is stale: the shipped one, by GPU only
    assert f"tune table {path} ignored: torch '2.0.0' != this device's {torch.__version__!r}" in caplog.text
    # an explicit table must match the whole key too
    with caplog.at_level(logging.INFO, logger="fx_fp8"):
        assert tune_table.table_for(device, explicit=path) is None
    # a GPU with neither its own table nor a shipped one
    monkeypatch.setattr(attention_table, "gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert tune_table.table_for(device) is None


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update(format="fx_fp8.tune/0"), "format 'fx_fp8.tune/0'"),
        (lambda t: t["source"].update(date=""), "source"),
        (lambda t: t["key"].pop("triton"), "key"),
        (lambda t: t["linears"].append(dict(lin(16, 1, 1), m=0)), "linears[0] has m 0"),
        (lambda t: t["linears"].append(dict(lin(16, 1, 1), role="sensitive")), "role 'sensitive'"),
        (lambda t: t["linears"].append(dict(lin(16, 1, 1), candidates={"fp9": {"ms": 1, "err": 0}})), "'fp9'"),
        (
            lambda t: t["linears"].append(dict(lin(16, 1, 1), candidates={"native": {"ms": "fast", "err": 0}})),
            "ms 'fast'",
        ),
    ],
)
def test_a_bad_table_is_an_error_naming_the_bad_value(edit, message, tmp_path):
    t = table(dict.fromkeys(tune_table.KEY_FIELDS, "x"))
    edit(t)
    (tmp_path / "t.json").write_text(json.dumps(t))
    with pytest.raises(ValueError, match="not an fx_fp8 tune table") as e:
        tune_table.load(tmp_path / "t.json")
    assert message in str(e.value)


def test_the_linear_pick_needs_a_measurable_gain_within_the_error_bound():
    allowed = ["native", "fp8_rowwise", "weight_only_int8"]
    t = table(
        {},
        [
            lin(1024, 1.0, 0.5, wo=0.9),
            lin(4096, 4.0, 4.2, wo=5.0),
            lin(16384, 16.0, 15.8),
            lin(1, 0.10, 0.12, wo=0.05, k=64, n=64),
            lin(64, 1.0, 0.5, err=0.5, k=64, n=64),
        ],
    )
    pick = lambda m, k=3072, n=3072: tune_table.linear_pick(t, m, k, n, "bfloat16", True, "w8a8", allowed)  # noqa
    assert pick(1024) == (
        "fp8_rowwise",
        {"native": 1.0, "fp8_rowwise": 0.5, "weight_only_int8": 0.9},
        "measured at M 1024",
    )
    assert pick(4096)[0] == "native"  # FP8 measured slower
    assert pick(16384)[0] == "native"  # 1.3 % faster: within the noise, native stays
    kind, times, how = pick(2048)  # between two measured M: interpolated
    assert kind == "fp8_rowwise" and times["native"] == pytest.approx(2.0) and "between M 1024 and 4096" in how
    assert pick(100000)[2] == "nearest measured M 16384" and pick(8)[2] == "nearest measured M 1024"
    assert pick(1, 64, 64)[0] == "weight_only_int8"  # memory-bound: the weight-only form
    assert pick(64, 64, 64)[0] == "native"  # FP8 faster but 50 % wrong: outside the error bound
    assert pick(1024, 3072, 1536) is None  # no row of this K / N: not measured
    assert pick(None) is None  # a symbolic M is never specialised


def test_auto_follows_the_table_and_says_when_it_has_none(monkeypatch, tmp_path):
    """The linear pass's hook on a CUDA node: the table's pick and its times, today's rules and
    "not measured on this GPU" without one, an explicit choice (kernel: rules, sensitive: fp8) untouched."""
    device = h200(monkeypatch)
    monkeypatch.setenv("FX_FP8_TUNE_DIR", str(tmp_path))
    qcfg = FP8Config().quantization_config
    with FakeTensorMode():
        x = torch.empty(1, 4096, 3072, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(3072, 3072, device="cuda", dtype=torch.bfloat16)
        kind, why, timing = tune_table.linear_decision("quantized", None, x, w, True, qcfg, "cuda")
        assert (kind, timing) == ("quantized", {}) and why == (
            f"{tune_table.UNMEASURED}: shipped nvidia_h200-sm90.json has attention rows only"
        )
        key = tune_table.device_key(device)
        tune_table.write(table(key, [lin(4096, 4.0, 4.2)]), tmp_path / tune_table.file_name(key))
        kind, why, timing = tune_table.linear_decision("quantized", None, x, w, True, qcfg, "cuda")
        assert kind == "native" and timing == {"pick": 4.0, "native": 4.0}
        assert why.startswith(
            "tuned: native (no FP8 candidate more than 3% faster within the error bound); "
            "native 4.000 ms, fp8_rowwise 4.200 ms (measured at M 4096;"
        ), why
        rules = FP8Config.load(None, quantization_config={"kernel": "rules"}).quantization_config
        assert tune_table.linear_decision("quantized", None, x, w, True, rules, "cuda") == ("quantized", None, {})
        fp8 = FP8Config.load(None, quantization_config={"sensitive": "fp8"}).quantization_config
        assert tune_table.linear_decision("quantized", None, x, w, True, fp8, "cuda", sensitive=True)[0] == "quantized"
        assert tune_table.linear_decision("quantized", None, x, w, True, fp8, "cuda", sensitive=False)[0] == "native"


def test_the_config_settings_are_checked():
    assert FP8Config().quantization_config.kernel == "auto"
    with pytest.raises(ValueError, match="invalid quantization_config.kernel 'fast'"):
        FP8Config.load(None, quantization_config={"kernel": "fast"})
    with pytest.raises(ValueError, match="invalid quantization_config.tune_table 3"):
        FP8Config.load(None, quantization_config={"tune_table": 3})


def test_a_broken_cache_file_is_ignored_but_a_named_table_must_exist(monkeypatch, tmp_path, caplog):
    device = h200(monkeypatch)
    monkeypatch.setenv("FX_FP8_TUNE_DIR", str(tmp_path))
    broken = tmp_path / tune_table.file_name(tune_table.device_key(device))
    broken.write_text("{not json")
    with caplog.at_level(logging.INFO, logger="fx_fp8"):
        assert tune_table.table_for(device)[0] == "shipped nvidia_h200-sm90.json"
    assert f"tune table {broken} ignored: {broken}: not an fx_fp8 tune table: invalid JSON" in caplog.text
    with pytest.raises(FileNotFoundError, match="tune table '.*missing.json' does not exist"):
        tune_table.table_for(device, explicit=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="not an fx_fp8 tune table: invalid JSON"):
        tune_table.table_for(device, explicit=broken)
