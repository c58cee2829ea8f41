"""Each torch_npu contract rule the simulator knows fails loudly when the lowering's call breaks it.

The lowering builds its vendor-call arguments in npu_calls.attention_call_kwargs (per-block, CANN
that accepts mode 7), npu_calls.mx_call_kwargs (MXFP8) and npu_calls.linear_call_kwargs; these tests
wrap those functions to corrupt one argument and expect SimulatedContractError naming the rule. The ops the
lowering calls directly (npu_dynamic_quant, npu_dynamic_mx_quant, npu_dynamic_block_quant) are
checked by calling them with bad arguments.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.ops import npu, npu_calls, quant
from npu_sim.mutations import apply, drop, set_
from npu_sim import SimulatedContractError, torch_npu_sim  # noqa: F401  (fixture)

FIA = "npu_fused_infer_attention_score_v2"
OLD_CANN = "9.0.0-beta.2"
ATTN_KW = dict(
    attn_mask=None,
    softmax_scale=1 / math.sqrt(32),
    granularity="block",
    q_block=128,
    kv_block=256,
    hadamard=True,
    smooth_k=True,
    quantize_p=True,
    p_scale=448.0,
    return_lse=False,
)


def qkv(b=2, s=150, d=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, 2, s, d, generator=g).to(dtype) for _ in range(3))


def corrupt(monkeypatch, name: str, edit):
    """Wrap npu_calls.<name> so the kwargs it builds go through `edit(kwargs)` first."""
    original = getattr(npu_calls, name)

    def wrapped(*args, **kwargs):
        kw = dict(original(*args, **kwargs))
        edit(kw)
        return kw

    monkeypatch.setattr(npu_calls, name, wrapped)


def expect_rule(rule, fn, *args, **kwargs):
    with pytest.raises(SimulatedContractError) as err:
        fn(*args, **kwargs)
    assert err.value.rule == rule, str(err.value)
    return err.value


# -- per-block FP8 attention (quant mode 7) -------------------------------------------------------
@pytest.fixture
def old_cann(torch_npu_sim):
    torch_npu_sim.cann_version = OLD_CANN
    return torch_npu_sim


BLOCK_VIOLATIONS = {
    # name: (edit of the kwargs, rule the simulator must name)
    "layout label disagrees with the tensors": (set_("input_layout", "BSND"), "layout-heads"),
    "unsimulated layout": (set_("input_layout", "BSH"), "layout"),
    "BSND-ordered memory under a BNSD label": (
        apply("query", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        "contiguous",
    ),
    "missing dequant_scale_query": (drop("dequant_scale_query"), "dequant-scale-missing"),
    "missing dequant_scale_value": (drop("dequant_scale_value"), "dequant-scale-missing"),
    "fp32 scale without the trailing 1": (apply("dequant_scale_key", lambda t: t.squeeze(-1)), "dequant-scale-shape"),
    "fp32 scale per 128 rows for K": (
        apply("dequant_scale_key", lambda t: t.repeat_interleave(2, dim=2)),
        "dequant-scale-shape",
    ),
    "bf16 scale": (apply("dequant_scale_value", lambda t: t.to(torch.bfloat16)), "dequant-scale-dtype"),
    "softmax_scale left at the default": (drop("softmax_scale"), "softmax-scale-default"),
    "softmax_scale passed as 1.0": (set_("softmax_scale", 1.0), "softmax-scale-default"),
    "missing quant_scale_p": (drop("quant_scale_p"), "quant-scale-p-missing"),
    "quant_scale_p above the e4m3 range": (apply("quant_scale_p", lambda t: t * 4), "quant-scale-p"),
    "quant_scale_p below 1": (apply("quant_scale_p", lambda t: t / 1000), "quant-scale-p"),
    "quant_scale_p as a python float": (set_("quant_scale_p", 448.0), "quant-scale-p"),
    "bf16 query instead of FP8": (apply("query", lambda t: t.to(torch.bfloat16)), "qkv-dtype"),
    "int pseudo dtype data (uint8)": (apply("key", lambda t: t.view(torch.uint8)), "qkv-dtype"),
    "per-tensor quant modes": (set_("query_quant_mode", 0), "quant-mode"),
    "missing out_dtype": (drop("out_dtype"), "out-dtype"),
    "float32 out_dtype": (set_("out_dtype", torch.float32), "out-dtype"),
    "wrong num_query_heads": (set_("num_query_heads", 4), "layout-heads"),
    "head dim above 128": (
        lambda kw: [
            kw.__setitem__(n, F.pad(kw[n].view(torch.uint8), (0, 192)).view(torch.float8_e4m3fn))
            for n in ("query", "key", "value")
        ],
        "head-dim",
    ),
    "SDPA mask": (set_("atten_mask", torch.zeros(150, 150, dtype=torch.bool)), "mask-unsupported"),
    "log-sum-exp asked": (set_("return_softmax_lse", True), "lse-unsupported"),
    "paged-KV block_size": (set_("block_size", 128), "unsupported-argument"),
    "inner_precise row correction": (set_("inner_precise", 2), "inner-precise"),
}


def block_attention(q, k, v):
    return npu.LOWERING.attention(q, k, v, **ATTN_KW, kernel="fia_block")


def test_the_per_block_call_satisfies_every_rule(old_cann):
    out = block_attention(*qkv())
    assert out.shape == (2, 2, 150, 32) and torch.isfinite(out).all()
    assert old_cann.calls[FIA] == 1


@pytest.mark.parametrize("case", list(BLOCK_VIOLATIONS))
def test_per_block_violation_is_caught(case, old_cann, monkeypatch):
    edit, rule = BLOCK_VIOLATIONS[case]
    corrupt(monkeypatch, "attention_call_kwargs", edit)
    expect_rule(rule, block_attention, *qkv())
    assert old_cann.calls[FIA] == 0


@pytest.mark.parametrize("cann", ["9.0.0-rc.1", "9.0.0", "9.1.0", ""])
def test_current_cann_refuses_mode_7(cann, torch_npu_sim):
    """CANN 9.0.0-rc.1 and later (or an unreadable version) refuse the per-block case, so the
    lowering never picks it there (see test_npu_lowering's decision table)."""
    torch_npu_sim.cann_version = cann
    err = expect_rule("quant-mode-refused", block_attention, *qkv())
    assert "quant_mode 7" in str(err)
    assert npu.attention_plan(*qkv(), AttentionQuantConfig()).kernel != "fia_block"


def test_fp8_attention_on_an_atlas_a2_is_rejected(old_cann):
    old_cann.chip = "Ascend910B3"
    err = expect_rule("chip", block_attention, *qkv())
    assert "Ascend910B3" in str(err)


# -- MXFP8 attention (quant modes 6/6/8) ------------------------------------------------------------
def mx_attention(q, k, v, **over):
    return npu.LOWERING.attention(q, k, v, **{**ATTN_KW, "granularity": "mx", **over}, kernel="fia_mx")


def _per_batch_lengths(kw):
    n = len(kw["actual_seq_qlen"])
    kw["actual_seq_qlen"] = [kw["actual_seq_qlen"][0]] * n


MX_VIOLATIONS = {
    "BNSD label on TND tensors": (set_("input_layout", "BNSD"), "layout"),
    "missing actual_seq_qlen": (drop("actual_seq_qlen"), "actual-seq"),
    "per-batch instead of cumulative lengths": (_per_batch_lengths, "actual-seq"),
    "lengths as a device tensor": (apply("actual_seq_kvlen", lambda v: torch.tensor(v)), "actual-seq"),
    "missing e8m0 dtype tag": (drop("dequant_scale_key_dtype"), "dequant-scale-dtype"),
    "e8m0 tag as torch.float8_e8m0fnu": (
        set_("dequant_scale_query_dtype", torch.float8_e8m0fnu),
        "dequant-scale-dtype",
    ),
    "fp32 scales": (apply("dequant_scale_query", lambda t: t.float()), "dequant-scale-dtype"),
    "scale pairs flattened": (
        apply("dequant_scale_key", lambda t: t.reshape(*t.shape[:-2], -1)),
        "dequant-scale-shape",
    ),
    "value scale blocked along D": (
        lambda kw: kw.__setitem__("dequant_scale_value", kw["dequant_scale_key"]),
        "dequant-scale-shape",
    ),
    "value quant mode 6": (set_("value_quant_mode", 6), "quant-mode"),
    "missing quant_scale_p": (drop("quant_scale_p"), "quant-scale-p-missing"),
    "quant_scale_p below 1": (apply("quant_scale_p", lambda t: t / 1000), "quant-scale-p"),
    "mask with sparse_mode 0": (set_("atten_mask", torch.zeros(1, 160, 160, dtype=torch.bool)), "mask-unsupported"),
    "missing out_dtype": (drop("out_dtype"), "out-dtype"),
    "softmax_scale left at the default": (drop("softmax_scale"), "softmax-scale-default"),
    "wrong num_query_heads": (set_("num_query_heads", 4), "layout-heads"),
    "head dim not padded to the kernel's": (
        lambda kw: [kw.__setitem__(n, kw[n][..., :32].contiguous()) for n in ("query", "key", "value")],
        "head-dim",
    ),
    "HiFloat8 query dtype tag": (set_("query_dtype", 290), "not-simulated"),
}


def test_the_mx_call_satisfies_every_rule(torch_npu_sim):
    out = mx_attention(*qkv(s=160))
    assert out.shape == (2, 2, 160, 32) and torch.isfinite(out).all()
    assert torch_npu_sim.calls[FIA] == 1 and torch_npu_sim.calls["npu_dynamic_mx_quant"] == 3
    out, lse = mx_attention(*qkv(s=160), return_lse=True)
    assert lse.shape == (2, 2, 160)


@pytest.mark.parametrize("case", list(MX_VIOLATIONS))
def test_mx_violation_is_caught(case, torch_npu_sim, monkeypatch):
    edit, rule = MX_VIOLATIONS[case]
    corrupt(monkeypatch, "mx_call_kwargs", edit)
    expect_rule(rule, mx_attention, *qkv(s=160))
    assert torch_npu_sim.calls[FIA] == 0


@pytest.mark.parametrize("cann", ["9.0.0", "9.0.1", "9.1.0-beta.3"])
def test_mxfp8_attention_needs_cann_9_1(cann, torch_npu_sim):
    torch_npu_sim.cann_version = cann
    expect_rule("quant-mode-unsupported", mx_attention, *qkv(s=160))


def test_dynamic_mx_quant_rules(torch_npu_sim):
    op = torch_npu_sim.npu_dynamic_mx_quant
    x = torch.randn(96, 2, 64).bfloat16()
    expect_rule("not-simulated", op, x)  # the default destination is FP4 (float4_e2m1fn_x2)
    expect_rule("dst-type", op, x, dst_type=torch.int8)
    expect_rule("round-mode", op, x, dst_type=torch.float8_e4m3fn, round_mode="floor")
    expect_rule("input-dtype", op, x.to(torch.int32), dst_type=torch.float8_e4m3fn)
    y, s = op(x, dst_type=torch.float8_e4m3fn, axis=0)
    assert (
        y.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (2, 2, 64, 2)
    )  # 96 -> 3 blocks -> 2 pairs
    y, s = op(x, dst_type=torch_npu_sim.float8_e4m3fn, axis=-1)
    assert s.shape == (96, 2, 1, 2)
    torch_npu_sim.chip = "Ascend910B3"
    expect_rule("chip", op, x, dst_type=torch.float8_e4m3fn)


def test_dynamic_block_quant_rules(torch_npu_sim):
    op = torch_npu_sim.npu_dynamic_block_quant
    x = torch.randn(2, 300, 64).bfloat16()
    y, s = op(x, dst_type=torch_npu_sim.float8_e4m3fn, row_block_size=128, col_block_size=128)
    assert y.dtype == torch.float8_e4m3fn and s.shape == (2, 3, 1) and s.dtype == torch.float32
    expect_rule("x-rank", op, x[None], dst_type=torch_npu_sim.float8_e4m3fn, row_block_size=128)
    expect_rule("block-size", op, x, dst_type=torch_npu_sim.float8_e4m3fn, row_block_size=384)
    expect_rule("dst-type", op, x, dst_type=torch.float16, row_block_size=128)
    torch_npu_sim.chip = "Ascend910B4"
    expect_rule("chip", op, x, dst_type=torch_npu_sim.float8_e4m3fn, row_block_size=128)
    expect_rule("block-size", op, x, row_block_size=128)  # A2/A3: int8 with row blocks of 1 only


# -- linears ---------------------------------------------------------------------------------------------
def _linear_inputs(method="fp8", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(dtype)
    w = torch.randn(96, 64, generator=g).to(dtype)
    wq, ws = quant.quantize_weight(w, "channel", method=method)
    return x, wq, ws, torch.randn(96, generator=g).to(dtype)


def linear(x, wq, ws, b, method="fp8"):
    xq, xs = npu.LOWERING.quantize_activation(x, None, method=method, granularity="token")
    return npu.LOWERING.scaled_mm(
        xq, xs, wq, ws, b, method=method, weight_granularity="channel", weight_block=None, out_dtype=x.dtype
    )


LINEAR_VIOLATIONS = {
    "weight passed as (N, K)": (apply("x2", lambda t: t.t()), "k-mismatch"),
    "weight in a strided (non-dense) layout": (apply("x2", lambda t: torch.cat([t, t], 1)[:, ::2]), "x2-layout"),
    "channel scale of shape (N, 1)": (apply("scale", lambda t: t.reshape(-1, 1)), "scale-shape"),
    "bf16 weight scale with FP8": (apply("scale", lambda t: t.to(torch.bfloat16)), "scale-dtype"),
    "per-token scale of shape (m, 1)": (apply("pertoken_scale", lambda t: t.reshape(-1, 1)), "pertoken-scale-shape"),
    "missing output_dtype": (drop("output_dtype"), "output-dtype"),
    "float32 output": (set_("output_dtype", torch.float32), "output-dtype"),
    "bias of the wrong length": (apply("bias", lambda t: t[:-1]), "bias"),
    "bf16 activations": (apply("x1", lambda t: t.to(torch.bfloat16)), "x-dtype"),
}

INT8_VIOLATIONS = {
    "fp16 bias (not in the int8 table)": (apply("bias", lambda t: t.half()), "bias"),
    "fp16 output without the per-token scale": (drop("pertoken_scale"), "pertoken-scale-missing"),
    "bf16 weight scale with fp16 output": (apply("scale", lambda t: t.to(torch.bfloat16)), "scale-dtype"),
    "FP8 weight with int8 activations": (apply("x2", lambda t: t.to(torch.float8_e4m3fn)), "x-dtype"),
    "offset (asymmetric) argument": (set_("offset", torch.zeros(96)), "unsupported-argument"),
}


@pytest.mark.parametrize("case", list(LINEAR_VIOLATIONS))
def test_linear_violation_is_caught(case, torch_npu_sim, monkeypatch):
    edit, rule = LINEAR_VIOLATIONS[case]
    inputs = _linear_inputs()
    assert linear(*inputs).shape == (32, 96)  # the untouched call passes
    corrupt(monkeypatch, "linear_call_kwargs", edit)
    expect_rule(rule, linear, *inputs)


@pytest.mark.parametrize("case", list(INT8_VIOLATIONS))
def test_int8_linear_violation_is_caught_on_atlas_a2(case, torch_npu_sim, monkeypatch):
    torch_npu_sim.chip = "Ascend910B3"
    edit, rule = INT8_VIOLATIONS[case]
    inputs = _linear_inputs("int8", torch.float16)
    assert linear(*inputs, method="int8").dtype == torch.float16
    corrupt(monkeypatch, "linear_call_kwargs", edit)
    expect_rule(rule, linear, *inputs, method="int8")


def test_fp8_linear_on_an_atlas_a2_is_rejected(torch_npu_sim):
    torch_npu_sim.chip = "Ascend910B3"
    expect_rule("chip", linear, *_linear_inputs())


def test_dynamic_quant_rules(torch_npu_sim):
    x = torch.randn(4, 64).to(torch.bfloat16)
    expect_rule(
        "dst-type", torch_npu_sim.npu_dynamic_quant, x, dst_type=torch_npu_sim.float8_e4m3fn
    )  # int pseudo dtype
    expect_rule("dst-type", torch_npu_sim.npu_dynamic_quant, x, dst_type=torch.float8_e5m2)
    expect_rule("input-dtype", torch_npu_sim.npu_dynamic_quant, x.float(), dst_type=torch.float8_e4m3fn)
    y, scale = torch_npu_sim.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    assert y.dtype == torch.float8_e4m3fn and scale.shape == (4,) and scale.dtype == torch.float32
    torch_npu_sim.chip = "Ascend910B4"
    expect_rule("chip", torch_npu_sim.npu_dynamic_quant, x, dst_type=torch.float8_e4m3fn)
    y, scale = torch_npu_sim.npu_dynamic_quant(x)  # int8 is every chip's default
    assert y.dtype == torch.int8 and scale.shape == (4,)


# -- through torch.compile -----------------------------------------------------------------------------------
class OneAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(64, 192, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, s, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_violation_surfaces_through_torch_compile(torch_npu_sim, monkeypatch):
    corrupt(monkeypatch, "mx_call_kwargs", set_("input_layout", "BNSD"))
    model = OneAttention().to(torch.bfloat16).eval()
    options = {"lowering": "npu", "downstream": "eager", "attention": {"granularity": "mx"}}
    compiled = torch.compile(model, backend="fp8_npu", options=options, fullgraph=True)
    with torch.no_grad(), pytest.raises(SimulatedContractError, match=r"\[layout\]"):
        compiled(torch.randn(1, 40, 64).to(torch.bfloat16))
