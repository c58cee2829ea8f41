"""attention.kernel "gluon": the Gluon FP8 attention candidate is chosen only when named, on sm90, for the
nodes it can run (no mask, no LSE, FP8 P); "auto" never picks it, whatever the measured table holds."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops import attention_table
from fx_fp8.ops.cuda import CudaLowering, resolve_kernel


def att(**kw):
    return FP8Config.load(None, attention=kw).attention


def fake_cuda(*shapes, dtype=torch.bfloat16):
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=dtype) for s in shapes]


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_gluon_is_a_kernel_name_the_config_and_the_lowering_take():
    assert att(kernel="gluon").kernel == "gluon" and resolve_kernel("gluon") == "gluon"
    with pytest.raises(ValueError, match="'bogus'"):
        resolve_kernel("bogus")


def test_gluon_runs_the_nodes_it_can_and_names_why_not(hopper):
    low = CudaLowering()
    q, q80 = fake_cuda((1, 2, 256, 128), (1, 2, 256, 80))
    (mask,) = fake_cuda((1, 1, 1, 256), dtype=torch.bool)
    cfg = att(kernel="gluon")
    assert low.attention_reason(q, q, q, cfg) is None
    kernel, how = low.attention_kernel(q, q, q, cfg)
    assert kernel == "gluon" and "numerically unverified" in how
    assert "no mask" in low.attention_reason(q, q, q, cfg, mask)
    assert "log-sum-exp" in low.attention_reason(q, q, q, cfg, need_lse=True)
    assert "quantizes P" in low.attention_reason(q, q, q, att(kernel="gluon", quantize_p=False))
    assert "kv_block=192" in low.attention_reason(q, q, q, att(kernel="gluon", kv_block=192))
    assert "head dim" in low.attention_reason(q80, q80, q80, cfg)  # the Triton kernel's checks come first


def test_gluon_needs_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    (q,) = fake_cuda((1, 2, 256, 128))
    reason = CudaLowering().attention_reason(q, q, q, att(kernel="gluon"))
    assert "attention.kernel=gluon" in reason and "sm89" in reason


def test_auto_never_picks_gluon_even_where_a_table_says_it_is_fastest(hopper, monkeypatch):
    row = {
        "gpu": "NVIDIA H200",
        "d": 128,
        "mask": False,
        "s_min": 1,
        "s_max": None,
        "ref_err": 0.01,
        "baseline_ms": 5.0,
        "pick": "gluon",
        "kernels": {
            "gluon": {"ms": 1.0, "err": 0.01},
            "triton": {"ms": 4.0, "err": 0.01},
            "native": {"ms": 5.0, "err": 0.002},
        },
    }
    # the tune table that applies to this device (tune_table.table_for) holds only this row
    monkeypatch.setattr(
        attention_table,
        "rows_for",
        lambda device: {"bar": attention_table.BAR, "rows": [row], "where": "a test's table"},
    )
    monkeypatch.setattr(attention_table, "gpu_name", lambda device: "NVIDIA H200")
    (q,) = fake_cuda((1, 2, 20000, 128))
    kernel, _ = CudaLowering().attention_kernel(q, q, q, att(kernel="auto"))
    assert kernel == "triton"
    assert "gluon" not in attention_table.PROBE_KERNELS.values()  # --table-from never writes a gluon column
