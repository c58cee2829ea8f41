"""Each contract rule the simulator knows fails loudly when the lowering's call breaks it.

The lowering builds its vendor-call arguments in npu.attention_call_kwargs /
npu.linear_call_kwargs; these tests wrap those functions to corrupt one
argument and expect SimulatedContractError naming the rule.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fx_fp8.ops import npu, quant
from npu_sim import SimulatedContractError, torch_npu_sim  # noqa: F401  (fixture)

ATTN_KW = dict(attn_mask=None, softmax_scale=1 / math.sqrt(32), granularity="block", q_block=128, kv_block=256,
               hadamard=True, smooth_k=True, quantize_p=True, p_scale=448.0)
LIN_KW = dict(weight_granularity="channel", weight_block=None, act_granularity="token", weight_only=False)


def qkv(s=150, d=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 2, s, d, generator=g).to(dtype) for _ in range(3))


def corrupt(monkeypatch, name: str, edit):
    """Wrap npu.<name> so the kwargs it builds go through `edit(kwargs)` first."""
    original = getattr(npu, name)

    def wrapped(*args, **kwargs):
        kw = dict(original(*args, **kwargs))
        edit(kw)
        return kw

    monkeypatch.setattr(npu, name, wrapped)


def _set(key, value):
    return lambda kw: kw.__setitem__(key, value)


def _drop(key):
    return lambda kw: kw.pop(key)


def _apply(key, fn):
    return lambda kw: kw.__setitem__(key, fn(kw[key]))


ATTENTION_VIOLATIONS = {
    # name: (edit of the kwargs, rule the simulator must name)
    "layout label disagrees with the tensors": (_set("input_layout", "BSND"), "layout-heads"),
    "unknown layout": (_set("input_layout", "NTD_TND"), "layout"),
    "BSND-ordered memory under a BNSD label": (_apply("query", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    "missing dequant_scale_query": (_drop("dequant_scale_query"), "dequant-scale-missing"),
    "missing dequant_scale_key": (_drop("dequant_scale_key"), "dequant-scale-missing"),
    "missing dequant_scale_value": (_drop("dequant_scale_value"), "dequant-scale-missing"),
    "fp32 scale without the trailing 1": (_apply("dequant_scale_key", lambda t: t.squeeze(-1)), "dequant-scale-shape"),
    "fp32 scale per 128 rows for K": (_apply("dequant_scale_key", lambda t: t.repeat_interleave(2, dim=2)), "dequant-scale-shape"),
    "bf16 scale": (_apply("dequant_scale_value", lambda t: t.to(torch.bfloat16)), "dequant-scale-dtype"),
    "softmax_scale left at the default": (_drop("softmax_scale"), "softmax-scale-default"),
    "softmax_scale passed as 1.0": (_set("softmax_scale", 1.0), "softmax-scale-default"),
    "missing quant_scale_p": (_drop("quant_scale_p"), "quant-scale-p-missing"),
    "quant_scale_p above the e4m3 range": (_apply("quant_scale_p", lambda t: t * 4), "quant-scale-p"),
    "quant_scale_p as a python float": (_set("quant_scale_p", 448.0), "quant-scale-p"),
    "bf16 query instead of FP8": (_apply("query", lambda t: t.to(torch.bfloat16)), "qkv-dtype"),
    "int pseudo dtype data (uint8)": (_apply("key", lambda t: t.view(torch.uint8)), "qkv-dtype"),
    "per-tensor quant modes": (_set("query_quant_mode", 0), "quant-mode"),
    "missing out_dtype": (_drop("out_dtype"), "out-dtype"),
    "float32 out_dtype": (_set("out_dtype", torch.float32), "out-dtype"),
    "wrong num_query_heads": (_set("num_query_heads", 4), "layout-heads"),
    "head dim not padded to the kernel's": (_apply("query", lambda t: t[..., :32].contiguous()), "head-dim"),
    "SDPA float mask": (_set("atten_mask", torch.zeros(150, 150)), "mask-dtype"),
    "mask of the wrong shape": (_set("atten_mask", torch.zeros(2, 2, 150, 150, dtype=torch.bool)), "mask-shape"),
    "paged-KV block_size": (_set("block_size", 128), "unsupported-argument"),
}


def test_the_lowering_call_satisfies_every_rule(torch_npu_sim):
    out = npu.LOWERING.attention(*qkv(), **ATTN_KW)
    assert out.shape == (2, 2, 150, 32) and torch.isfinite(out).all()
    assert torch_npu_sim.calls["npu_fused_infer_attention_score_v2"] == 1


@pytest.mark.parametrize("case", list(ATTENTION_VIOLATIONS))
def test_attention_violation_is_caught(case, torch_npu_sim, monkeypatch):
    edit, rule = ATTENTION_VIOLATIONS[case]
    corrupt(monkeypatch, "attention_call_kwargs", edit)
    with pytest.raises(SimulatedContractError) as err:
        npu.LOWERING.attention(*qkv(), **ATTN_KW)
    assert err.value.rule == rule, str(err.value)
    assert torch_npu_sim.calls["npu_fused_infer_attention_score_v2"] == 0


def test_fp8_attention_on_an_atlas_a2_is_rejected(torch_npu_sim):
    torch_npu_sim.chip = "Ascend910B3"
    with pytest.raises(SimulatedContractError) as err:
        npu.LOWERING.attention(*qkv(), **ATTN_KW)
    assert err.value.rule == "chip" and "Ascend910B3" in str(err.value)


def _linear_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    wq, ws = quant.quantize_weight(w, "channel")
    return x, wq, ws, torch.randn(96, generator=g).to(torch.bfloat16)


LINEAR_VIOLATIONS = {
    "weight passed as (N, K)": (_apply("x2", lambda t: t.t()), "k-mismatch"),
    "weight in a strided (non-dense) layout": (_apply("x2", lambda t: torch.cat([t, t], 1)[:, ::2]), "x2-layout"),
    "channel scale of shape (N, 1)": (_apply("scale", lambda t: t.reshape(-1, 1)), "scale-shape"),
    "bf16 weight scale": (_apply("scale", lambda t: t.to(torch.bfloat16)), "scale-dtype"),
    "per-token scale of shape (m, 1)": (_apply("pertoken_scale", lambda t: t.reshape(-1, 1)), "pertoken-scale-shape"),
    "missing output_dtype": (_drop("output_dtype"), "output-dtype"),
    "float32 output": (_set("output_dtype", torch.float32), "output-dtype"),
    "bias of the wrong length": (_apply("bias", lambda t: t[:-1]), "bias"),
    "bf16 activations": (_apply("x1", lambda t: t.to(torch.bfloat16)), "x-dtype"),
}


@pytest.mark.parametrize("case", list(LINEAR_VIOLATIONS))
def test_linear_violation_is_caught(case, torch_npu_sim, monkeypatch):
    edit, rule = LINEAR_VIOLATIONS[case]
    x, wq, ws, b = _linear_inputs()
    assert npu.LOWERING.linear(x, wq, ws, b, None, **LIN_KW).shape == (4, 8, 96)  # the untouched call passes
    corrupt(monkeypatch, "linear_call_kwargs", edit)
    with pytest.raises(SimulatedContractError) as err:
        npu.LOWERING.linear(x, wq, ws, b, None, **LIN_KW)
    assert err.value.rule == rule, str(err.value)


def test_dynamic_quant_rules(torch_npu_sim):
    x = torch.randn(4, 64).to(torch.bfloat16)
    cases = [
        (dict(dst_type=torch_npu_sim.float8_e4m3fn), "dst-type"),    # the int pseudo dtype, not torch's
        (dict(dst_type=torch.float8_e5m2), "dst-type"),
    ]
    for kwargs, rule in cases:
        with pytest.raises(SimulatedContractError) as err:
            torch_npu_sim.npu_dynamic_quant(x, **kwargs)
        assert err.value.rule == rule
    with pytest.raises(SimulatedContractError) as err:
        torch_npu_sim.npu_dynamic_quant(x.float(), dst_type=torch.float8_e4m3fn)
    assert err.value.rule == "input-dtype"
    y, scale = torch_npu_sim.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    assert y.dtype == torch.float8_e4m3fn and scale.shape == (4,) and scale.dtype == torch.float32
    torch_npu_sim.chip = "Ascend910B4"
    with pytest.raises(SimulatedContractError) as err:
        torch_npu_sim.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    assert err.value.rule == "chip"


class OneAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(64, 192, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, s, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_violation_surfaces_through_torch_compile(torch_npu_sim, monkeypatch):
    corrupt(monkeypatch, "attention_call_kwargs", _set("input_layout", "BSND"))
    model = OneAttention().to(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="fp8_npu", options={"lowering": "npu", "downstream": "eager"}, fullgraph=True)
    with torch.no_grad(), pytest.raises(SimulatedContractError, match=r"\[layout-heads\]"):
        compiled(torch.randn(1, 40, 64).to(torch.bfloat16))
