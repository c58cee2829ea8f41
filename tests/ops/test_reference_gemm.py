"""The reference lowering's FP8 / INT8 GEMMs: the exact product sum rounded once, so the same bits
on every torch, BLAS and CPU, with no torch._scaled_mm (whose CPU scale modes differ by release)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fx_fp8.ops import quant, reference
from fx_fp8.ops.lowering import get_lowering

LAYOUTS = [
    ("fp8", "token", "channel", None),
    ("fp8", "tensor", "tensor", None),
    ("fp8", "token", "tensor", None),
    ("fp8", "group", "block", (128, 128)),
    ("int8", "token", "channel", None),
    ("int8", "group", "block", (1, 32)),
]


def _operands(method, act, wgran, block, m=33, k=320, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)  # a wide range of magnitudes per row
    w = torch.randn(n, k, generator=g) / 16
    xq, xs = quant.quantize_activation(x, act, method, block[1] if block else None)
    wq, ws = quant.quantize_weight(w, wgran, block, method=method)
    return xq, xs, wq, ws


def _scaled_mm(xq, xs, wq, ws, method, wgran, block, out_dtype=torch.float32):
    return get_lowering("reference").scaled_mm(
        xq, xs, wq, ws, None, method=method, weight_granularity=wgran, weight_block=block, out_dtype=out_dtype
    )


def _exact_code_sum(xq, wq) -> torch.Tensor:
    """sum_k x[m, k] w[n, k] of e4m3 codes in int64 (each code times 2**9 is an integer), as fp32."""
    xi, wi = (xq.float() * 512).long(), (wq.float() * 512).long()
    return ((xi @ wi.t()).double() / 2**18).float()  # |sum| < 2**53: int64 -> fp64 exact, one rounding


@pytest.mark.parametrize("act,wgran", [("token", "channel"), ("tensor", "tensor"), ("token", "tensor")])
def test_fp8_gemm_is_the_exact_sum_rounded_once_then_rescaled(act, wgran):
    xq, xs, wq, ws = _operands("fp8", act, wgran, None)
    expected = _exact_code_sum(xq, wq) * xs.float().reshape(-1, 1) * ws.float().reshape(1, -1)
    assert torch.equal(_scaled_mm(xq, xs, wq, ws, "fp8", wgran, None), expected)


@pytest.mark.parametrize("method,act,wgran,block", LAYOUTS)
def test_gemm_bits_do_not_depend_on_summation_order(method, act, wgran, block):
    """Reordering the input columns (within each scale group) reorders every sum: the bits stay."""
    xq, xs, wq, ws = _operands(method, act, wgran, block)
    out = _scaled_mm(xq, xs, wq, ws, method, wgran, block)
    group = block[1] if block else xq.shape[1]
    perm = torch.cat(
        [
            torch.randperm(min(group, xq.shape[1] - s), generator=torch.Generator().manual_seed(s)) + s
            for s in range(0, xq.shape[1], group)
        ]
    )
    assert not torch.equal(perm, torch.arange(xq.shape[1]))
    assert torch.equal(_scaled_mm(xq[:, perm], xs, wq[:, perm], ws, method, wgran, block), out)


@pytest.mark.parametrize("method,act,wgran,block", LAYOUTS)
def test_gemm_runs_without_torch_scaled_mm(monkeypatch, method, act, wgran, block):
    """torch 2.11's CPU _scaled_mm refuses row-wise scales; the reference calls no _scaled_mm."""
    xq, xs, wq, ws = _operands(method, act, wgran, block)
    expected = _scaled_mm(xq, xs, wq, ws, method, wgran, block, torch.bfloat16)

    def refuse(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm called")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert torch.equal(_scaled_mm(xq, xs, wq, ws, method, wgran, block, torch.bfloat16), expected)


def test_compiled_linear_model_runs_on_cpu_without_torch_scaled_mm(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("_scaled_mm")))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)).eval()
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="fp8", options={"lowering": "reference"})(x)
    assert ((out - ref).norm() / ref.norm()).item() < 0.05


def test_sums_longer_than_one_exact_fp64_piece(monkeypatch):
    monkeypatch.setattr(reference, "EXACT_SUM_TERMS", 64)  # 320 columns: five pieces, added in order
    xq, xs, wq, ws = _operands("fp8", "token", "channel", None)
    assert torch.equal(reference.exact_product_sum(xq, wq), _exact_code_sum(xq, wq))


def test_empty_gemms():
    for m, k in [(0, 64), (4, 0)]:
        xq, wq = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.zeros(8, k, dtype=torch.float8_e4m3fn)
        out = _scaled_mm(xq, torch.ones(m, 1), wq, torch.ones(8, 1), "fp8", "channel", None)
        assert out.shape == (m, 8) and not out.any()
