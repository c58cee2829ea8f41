"""Each MindIE-SD contract rule the simulator knows fails loudly when the lowering's call breaks it.

The lowering builds MindIE-SD's fused_infer_attention_score_v2 arguments in
npu_calls.mindiesd_call_kwargs; these tests wrap it to corrupt one argument and
expect the simulator's error naming the rule (mindiesd's own ParametersInvalid
for what its Python wrapper validates, SimulatedContractError for the kernel's
contract). fa_block_quant_preprocess is checked by calling it directly.
"""

from __future__ import annotations

import math

import pytest
import torch

from fx_fp8.ops import mindiesd, npu, npu_calls
from npu_sim.mutations import apply, drop, set_
from npu_sim import SimulatedContractError, mindiesd_sim, torch_npu_sim  # noqa: F401  (fixtures)

SD_FIA = "fused_infer_attention_score_v2"
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


def attention(q, k, v, **over):
    return npu.LOWERING.attention(q, k, v, **{**ATTN_KW, **over}, kernel="mindiesd")


def corrupt(monkeypatch, edit):
    original = npu_calls.mindiesd_call_kwargs

    def wrapped(*args, **kwargs):
        kw = dict(original(*args, **kwargs))
        edit(kw)
        return kw

    monkeypatch.setattr(npu_calls, "mindiesd_call_kwargs", wrapped)


def _rename(old, new):
    return lambda kw: kw.__setitem__(new, kw.pop(old))


def expect_rule(rule, fn, *args, **kwargs):
    with pytest.raises(SimulatedContractError) as err:
        fn(*args, **kwargs)
    assert err.value.rule == rule, str(err.value)
    return err.value


def test_the_lowering_call_satisfies_every_rule(mindiesd_sim, torch_npu_sim):
    out = attention(*qkv())
    assert out.shape == (2, 2, 150, 32) and torch.isfinite(out).all()
    assert mindiesd_sim.calls[SD_FIA] == 1 and mindiesd_sim.calls["fa_block_quant_preprocess"] == 6
    assert torch_npu_sim.calls["npu_fused_infer_attention_score_v2"] == 0  # MindIE-SD's own kernel, not CANN's


VIOLATIONS = {
    # the wrapper (mindiesd.layers.flash_attn.fused_infer_attention_score): ParametersInvalid
    "TND layout": (set_("input_layout", "TND"), "layout"),
    "layout label disagrees with the tensors": (set_("input_layout", "BSND"), "layout-heads"),
    "wrong num_query_heads": (set_("num_query_heads", 4), "layout-heads"),
    "num_query_heads as a tensor": (set_("num_query_heads", torch.tensor(2)), "heads"),
    "bf16 value beside FP8 query/key": (apply("value", lambda t: t.to(torch.bfloat16)), "dtype"),
    # the kernel (torch.ops.mindiesd.fused_infer_attention_score_v2)
    "P scale passed as quant_scale_p (the wrapper drops it)": (
        _rename("quant_scale1", "quant_scale_p"),
        "quant-scale-p-missing",
    ),
    "P scale below 1": (apply("quant_scale1", lambda t: t / 1000), "quant-scale-p"),
    "MXFP8 quant modes": (lambda kw: kw.update(query_quant_mode=6, key_quant_mode=6, value_quant_mode=8), "quant-mode"),
    "missing dequant_scale_key": (drop("dequant_scale_key"), "dequant-scale-missing"),
    "K scale per 128 rows": (
        apply("dequant_scale_key", lambda t: t.repeat_interleave(2, dim=2)),
        "dequant-scale-shape",
    ),
    "bf16 Q scale": (apply("dequant_scale_query", lambda t: t.to(torch.bfloat16)), "dequant-scale-dtype"),
    "mask": (set_("atten_mask", torch.zeros(150, 150, dtype=torch.bool)), "mask-unsupported"),
    "log-sum-exp asked": (set_("return_softmax_lse", True), "lse-unsupported"),
    "paged KV": (set_("block_size", 128), "unsupported-argument"),
    "missing out_dtype": (drop("out_dtype"), "out-dtype"),
    "softmax_scale left at the default": (drop("softmax_scale"), "softmax-scale-default"),
    "an argument the schema does not have": (set_("d_scale_q", 1.0), "unknown-argument"),
    "BSND-ordered memory under a BNSD label": (
        apply("query", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        "contiguous",
    ),
}


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_violation_is_caught(case, mindiesd_sim, monkeypatch):
    edit, rule = VIOLATIONS[case]
    corrupt(monkeypatch, edit)
    expect_rule(rule, attention, *qkv())
    assert mindiesd_sim.calls[SD_FIA] == 0


def test_wrapper_errors_are_mindiesds_own(mindiesd_sim, monkeypatch):
    corrupt(monkeypatch, set_("input_layout", "TND"))
    with pytest.raises(mindiesd_sim.ParametersInvalid):
        attention(*qkv())


def test_fa_block_quant_preprocess_rules(mindiesd_sim, torch_npu_sim):
    fa_block_quant_preprocess, _ = mindiesd.entry_points()
    x = torch.randn(1, 2, 300, 64).bfloat16()
    q, s = fa_block_quant_preprocess(x, block_size=256, layout="BNSD")
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (1, 2, 2, 1)
    q2, s2 = fa_block_quant_preprocess(x.transpose(1, 2).contiguous(), block_size=256, layout="BSND")
    assert torch.equal(q2.float(), q.float()) and torch.equal(s2, s)  # BSND in, BNSD out
    # a batch above 1 is not squeezed away: npu_dynamic_block_quant gets 4-D data
    expect_rule("x-rank", fa_block_quant_preprocess, torch.randn(2, 2, 300, 64).bfloat16())
    expect_rule("rank", fa_block_quant_preprocess, x[0])
    expect_rule("block-size", fa_block_quant_preprocess, x, block_size=384)
    expect_rule("layout", fa_block_quant_preprocess, x, layout="TND")
    assert torch_npu_sim.calls["npu_dynamic_block_quant"] == 2


def test_batches_are_quantized_one_sample_at_a_time(mindiesd_sim, monkeypatch):
    """Calling fa_block_quant_preprocess on the whole batch is the violation the lowering avoids."""

    def whole_batch(fa_block_quant_preprocess, x, block, kernel_block, dst_type):
        return fa_block_quant_preprocess(x, block_size=block, dst_type=dst_type, layout="BNSD")

    monkeypatch.setattr(npu_calls, "mindiesd_block_quant", whole_batch)
    expect_rule("x-rank", attention, *qkv(b=2))


def test_mindiesd_kernel_is_ascend_950_only(mindiesd_sim, torch_npu_sim):
    torch_npu_sim.chip = "Ascend910B3"
    assert "Ascend 950 only" in str(expect_rule("chip", attention, *qkv(b=1)))  # its FP8 block quantization
    err = expect_rule("chip", attention, *qkv(b=1), granularity="head")  # quantized by torch ops: the kernel
    assert "ascend950 only" in str(err)


def test_mindiesd_is_not_subject_to_cann_dropping_mode_7(mindiesd_sim, torch_npu_sim):
    torch_npu_sim.cann_version = "9.1.0"  # torch_npu's own fused attention refuses mode 7 here
    assert attention(*qkv(b=1)).shape == (1, 2, 150, 32)


def test_mindiesd_version_and_import_problem(mindiesd_sim):
    assert mindiesd.import_problem() is None and mindiesd.version().startswith("3.1.0")


def test_import_problem_without_mindiesd(torch_npu_sim):
    assert mindiesd.import_problem().startswith("mindiesd not importable (")
