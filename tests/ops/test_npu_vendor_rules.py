"""The NPU simulators against a second, independent reading of the vendor sources
(tests/helpers/npu_sim/vendor_rules.py, which cites the source of each rule and imports neither the
simulators nor fx_fp8): npu_dynamic_block_quant accepts and refuses exactly what CANN's
aclnnDynamicBlockQuant / torch_npu's docs allow and computes their formula, and MindIE-SD's
per-block FP8 attention call, as fx_fp8's NPU lowering builds it, keeps every rule; each rule broken
alone is refused by the simulator and flagged by the independent reading."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fx_fp8.ops import npu, npu_calls
from npu_sim import SimulatedContractError, mindiesd_sim, torch_npu_sim  # noqa: F401  (fixtures)
from npu_sim import sources, vendor_rules as vr

CHIPS = {"Ascend950PR": True, "Ascend910B3": False}


@pytest.mark.parametrize("chip", list(CHIPS))
def test_block_quant_accepts_and_refuses_what_the_vendor_docs_say(chip, torch_npu_sim):
    torch_npu_sim.chip = chip
    g = torch.Generator().manual_seed(0)
    cases = list(
        itertools.product(
            [(2, 130, 256), (130, 256), (1, 2, 130, 256)],
            [torch.bfloat16, torch.int32],
            [False, True],
            [1, 64, 128, 256, 384],
            [64, 128, 100],
        )
    )
    accepted = 0
    for shape, dtype, fp8, row, col in cases:
        x = (
            (torch.randn(shape, generator=g) * 3).to(dtype)
            if dtype.is_floating_point
            else torch.ones(shape, dtype=dtype)
        )
        want = vr.block_quant_violations(
            shape, dtype, fp8_output=fp8, chip_950=CHIPS[chip], row_block=row, col_block=col
        )
        dst = torch.float8_e4m3fn if fp8 else 1
        try:
            y, s = torch_npu_sim.npu_dynamic_block_quant(x, dst_type=dst, row_block_size=row, col_block_size=col)
        except SimulatedContractError as e:
            assert e.rule in want, (
                f"{shape} {dtype} fp8={fp8} {row}x{col}: simulator refused ({e.rule}), vendor rules {want}"
            )
            continue
        assert not want, f"{shape} {dtype} fp8={fp8} {row}x{col}: simulator accepted, vendor rules break {want}"
        accepted += 1
        y_ref, s_ref = vr.block_quant(x, row_block=row, col_block=col, fp8_output=fp8)
        assert y.dtype == y_ref.dtype and tuple(s.shape) == tuple(s_ref.shape)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        assert (y.float() - y_ref.float()).abs().max() <= (1 if not fp8 else 0), f"{shape} {row}x{col}"
    assert accepted >= (20 if CHIPS[chip] else 2)  # the grid holds calls both readings accept


def _lowering_call(monkeypatch, mindiesd_sim):
    """The kwargs fx_fp8's NPU lowering passes to MindIE-SD's attention, captured on a real call."""
    seen = []
    original = npu_calls.mindiesd_call_kwargs

    def keep(*args, **kwargs):
        kw = original(*args, **kwargs)
        seen.append(dict(kw))
        return kw

    monkeypatch.setattr(npu_calls, "mindiesd_call_kwargs", keep)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g).bfloat16() for _ in range(3))
    npu.LOWERING.attention(
        q,
        k,
        v,
        attn_mask=None,
        softmax_scale=1 / 8,
        granularity="block",
        q_block=128,
        kv_block=256,
        hadamard=True,
        smooth_k=True,
        quantize_p=True,
        p_scale=448.0,
        return_lse=False,
        kernel="mindiesd",
    )
    monkeypatch.setattr(npu_calls, "mindiesd_call_kwargs", original)
    (kw,) = seen
    return kw


def _split(kw):
    kw = dict(kw)
    return kw.pop("query"), kw.pop("key"), kw.pop("value"), kw


BREAK_ONE = {
    "qkv-dtype": lambda kw: kw.update(value=kw["value"].float().to(torch.float8_e5m2)),
    "quant-mode": lambda kw: kw.update(query_quant_mode=6),
    "head-dim": lambda kw: kw.update({n: kw[n].repeat(1, 1, 1, 3) for n in ("query", "key", "value")}),
    "dequant-scale": lambda kw: kw.update(dequant_scale_key=kw["dequant_scale_key"].repeat_interleave(2, dim=2)),
    "p-scale": lambda kw: kw.update(quant_scale1=kw["quant_scale1"] / 1000),
    "mask": lambda kw: kw.update(atten_mask=torch.zeros(300, 300, dtype=torch.bool)),
    "lse": lambda kw: kw.update(return_softmax_lse=True),
    "out-dtype": lambda kw: kw.update(out_dtype=torch.float32),
    "softmax-scale": lambda kw: kw.update(softmax_scale=1.0),
    "layout": lambda kw: kw.update(input_layout="TND"),
}


def test_the_lowering_call_keeps_every_independent_rule_and_each_broken_rule_is_refused(monkeypatch, mindiesd_sim):
    kw = _lowering_call(monkeypatch, mindiesd_sim)
    assert vr.fia_block_violations(*_split(kw)) == set()
    assert set(BREAK_ONE) == set(vr.FIA_RULES)  # every rule is exercised
    kernel = mindiesd_sim.eagle_fused_infer_attention_score_v2
    for rule, edit in BREAK_ONE.items():
        bad = dict(kw)
        edit(bad)
        assert vr.fia_block_violations(*_split(bad)) == {rule}, rule
        q, k, v, rest = _split(bad)
        with pytest.raises(SimulatedContractError):
            kernel(q, k, v, **rest)
    q, k, v, rest = _split(kw)
    out, _ = kernel(q, k, v, **rest)
    assert out.shape == (1, 2, 300, 64) and torch.isfinite(out.float()).all()


def test_every_independent_rule_cites_its_source():
    for rules in (vr.BLOCK_QUANT_RULES, vr.FIA_RULES):
        assert rules
        for rule, source in rules.items():
            assert source.startswith("[") and any(
                tag in source for tag in ("[BQ-ACLNN]", "[BQ-TORCH]", "[SD]", "[FIA]")
            ), rule
    assert math.isclose(vr.E4M3_MAX, torch.finfo(torch.float8_e4m3fn).max)


def _raised_rules(path) -> set:
    """The rule names a simulator raises: the rule argument of every require / fail / ParametersInvalid."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            idx = {"require": 1, "fail": 0, "ParametersInvalid": 0}.get(name)
            if idx is not None and len(node.args) > idx and isinstance(node.args[idx], ast.Constant):
                out.add(node.args[idx].value)
    return out


@pytest.mark.parametrize(
    "module, cited", [("torch_npu_sim.py", sources.TORCH_NPU), ("mindiesd_sim.py", sources.MINDIESD)]
)
def test_every_simulator_rule_cites_its_vendor_source(module, cited):
    from pathlib import Path

    raised = _raised_rules(Path(vr.__file__).with_name(module))
    assert len(raised) >= 20
    assert raised <= set(cited), f"{module}: rules without a cited source: {sorted(raised - set(cited))}"
    assert not set(cited) - raised, f"sources.py cites rules {module} never raises: {sorted(set(cited) - raised)}"
    assert all(source.strip() for source in cited.values())
