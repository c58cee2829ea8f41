"""The npu lowering under the torch_npu and MindIE-SD contract simulators: which attention path,
numerics against the CPU reference, native reasons, FP8 / INT8 linears, end to end on tiny models."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.config.quantization import QuantizationConfig
from fx_fp8.ops import npu, npu_platform, quant
from fx_fp8.ops.reference import LOWERING as REFERENCE
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from npu_sim import mindiesd_sim, torch_npu_sim  # noqa: F401  (fixtures)
from npu_sim.mindiesd_sim import installed_mindiesd

NPU_OPTIONS = {"lowering": "npu", "downstream": "eager"}
REF_OPTIONS = {"lowering": "reference", "downstream": "eager"}
FIA = "npu_fused_infer_attention_score_v2"
SD_FIA = "fused_infer_attention_score_v2"
OLD_CANN = "9.0.0-beta.2"  # the last release documenting per-block FP8 attention (quant mode 7)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def attention_kwargs(**over):
    kw = dict(
        attn_mask=None,
        softmax_scale=None,
        granularity="block",
        q_block=128,
        kv_block=256,
        hadamard=True,
        smooth_k=True,
        quantize_p=True,
        p_scale=448.0,
        kernel="auto",
        return_lse=False,
    )
    kw.update(over)
    return kw


def qkv(b=1, h=2, s=200, d=32, s_k=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    s_k = s if s_k is None else s_k
    return (
        torch.randn(b, h, s, d, generator=g).to(dtype),
        torch.randn(b, h, s_k, d, generator=g).to(dtype),
        torch.randn(b, h, s_k, d, generator=g).to(dtype),
    )


def run_both(q, k, v, **over):
    kw = attention_kwargs(**over)
    kw["softmax_scale"] = kw["softmax_scale"] or 1 / math.sqrt(q.shape[-1])
    return npu.LOWERING.attention(q, k, v, **kw), REFERENCE.attention(q, k, v, **kw)


class TinyAttention(nn.Module):
    """One attention block whose q/k/v arrive BSND-contiguous and permuted to (B, H, S, D), as in diffusers."""

    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.heads = heads
        # no biases: the reference adds them after rounding, the NPU matmul before (bf16-ulp differences
        # that FP8 rounding of q/k/v would amplify)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(o.transpose(1, 2).reshape(b, s, -1))


# -- which path: the decision table ---------------------------------------------------------------
@pytest.fixture
def machine(request, torch_npu_sim):
    """Configure the simulated machine: (chip, CANN version, MindIE-SD installed?)."""
    chip, cann, with_sd = request.param
    torch_npu_sim.chip, torch_npu_sim.cann_version = chip, cann
    if with_sd:
        with installed_mindiesd():
            yield torch_npu_sim
    else:
        yield torch_npu_sim


DECISIONS = [
    # (chip, CANN, MindIE-SD?), config, expected kernel (None: native), words the reason/description must contain
    (("Ascend950PR", "9.1.0", True), {}, "mindiesd", ["MindIE-SD", "modes 7/7/7"]),
    (("Ascend950PR", OLD_CANN, True), {}, "mindiesd", ["MindIE-SD"]),
    (("Ascend950PR", OLD_CANN, False), {}, "fia_block", ["torch_npu", "modes 7/7/7", OLD_CANN]),
    (
        ("Ascend950PR", "9.1.0", False),
        {},
        None,
        ["CANN 9.1.0 refuses", "mode 7", "mindiesd not importable", "granularity: mx"],
    ),
    (("Ascend950PR", "9.0.0-rc.1", False), {}, None, ["refuses"]),
    (("Ascend950PR", "", False), {}, None, ["CANN unknown refuses"]),  # never rely on mode 7 blindly
    (("Ascend950PR", "9.1.0", False), {"granularity": "mx"}, "fia_mx", ["MXFP8", "modes 6/6/8", "TND"]),
    (("Ascend950PR", "9.1.0", True), {"granularity": "mx"}, "fia_mx", ["MXFP8"]),
    (("Ascend950PR", "9.0.1", True), {"granularity": "mx"}, None, ["no MXFP8", "9.1.0.pre"]),
    (("Ascend950PR", "9.1.0-beta.3", False), {"granularity": "mx"}, None, ["no MXFP8"]),  # paged KV only there
    (("Ascend950PR", "9.1.0.pre", False), {"granularity": "mx"}, "fia_mx", ["MXFP8"]),
    (("Ascend950PR", "9.1.0", True), {"granularity": "head"}, "mindiesd", ["MindIE-SD"]),
    (("Ascend950PR", OLD_CANN, False), {"granularity": "tensor"}, "fia_block", ["torch_npu"]),
    (("Ascend950PR", "9.1.0", True), {"q_block": 64}, None, ["q_block=64"]),
    (("Ascend950PR", OLD_CANN, True), {"q_block": 384}, "fia_block", ["torch_npu"]),  # MindIE-SD: 128/256/512 only
    (("Ascend950PR", "9.1.0", True), {"q_block": 384}, None, ["fa_block_quant_preprocess takes block sizes"]),
    (("Ascend910B3", "9.1.0", True), {}, None, ["Ascend910B3 has no FP8 kernels", "950"]),
    (("Ascend910_9392", "9.1.0", True), {"granularity": "mx"}, None, ["Ascend910_9392", "950"]),
]


@pytest.mark.parametrize(
    "machine, over, kernel, words",
    [(m, o, k, w) for m, o, k, w in DECISIONS],
    indirect=["machine"],
    ids=[f"{m[0]}-{m[1] or 'unknown'}-{'sd' if m[2] else 'nosd'}-{o}" for m, o, _, _ in DECISIONS],
)
def test_decision_table(machine, over, kernel, words):
    q, k, v = qkv()
    cfg = AttentionQuantConfig(**over)
    plan = npu.attention_plan(q, k, v, cfg)
    assert plan.kernel == kernel, plan.detail
    for w in words:
        assert w in plan.detail, plan.detail
    reason = npu.LOWERING.attention_reason(q, k, v, cfg)
    assert (reason is None) == (kernel is not None)
    assert npu.LOWERING.attention_kernel(q, k, v, cfg) == (kernel or "auto", plan.detail)


@pytest.mark.parametrize(
    "text, key",
    [
        ("9.1.0", (9, 1, 0, 4, 0)),
        ("9.0.0-beta.2", (9, 0, 0, 1, 2)),
        ("9.0.0-rc.1", (9, 0, 0, 2, 1)),
        ("8.3.RC1", (8, 3, 0, 2, 1)),
        ("9.1.0.pre", (9, 1, 0, 3, 0)),
        ("v8.5.0", (8, 5, 0, 4, 0)),
        ("", None),
        ("garbage", None),
    ],
)
def test_cann_version_parsing(text, key):
    assert npu_platform.parse_cann_version(text) == key


def test_release_order():
    order = ["8.3.RC1", "8.5.0", "9.0.0-beta.1", OLD_CANN, "9.0.0-rc.1", "9.0.0", "9.1.0-beta.3", "9.1.0.pre", "9.1.0"]
    keys = [npu_platform.parse_cann_version(v) for v in order]
    assert keys == sorted(keys)
    assert [v for v in order if npu_platform.cann_has_mxfp8_attention(v)] == ["9.1.0.pre", "9.1.0"]


def test_mode7_only_on_cann_known_to_accept_it():
    accepts = [
        v
        for v in ("8.3.RC1", "8.5.0", "9.0.0-beta.1", OLD_CANN, "9.0.0-rc.1", "9.0.0", "9.1.0", "", "x")
        if npu_platform.cann_accepts_mode7(v)
    ]
    assert accepts == ["8.3.RC1", "8.5.0", "9.0.0-beta.1", OLD_CANN]


@pytest.mark.parametrize(
    "over, q_dtype, needle",
    [
        ({}, torch.float32, "fp16/bf16"),
        (dict(quantize_p=False), torch.bfloat16, "always quantize P"),
    ],
)
def test_attention_reasons(over, q_dtype, needle, torch_npu_sim):
    q, k, v = qkv(dtype=q_dtype)
    assert needle in npu.LOWERING.attention_reason(q, k, v, AttentionQuantConfig(**over))


def test_masks_lse_head_dims_and_single_queries(mindiesd_sim):
    cfg, mx_cfg = AttentionQuantConfig(), AttentionQuantConfig(granularity="mx")
    q, k, v = qkv()
    for mask in (torch.ones(200, 200, dtype=torch.bool), torch.zeros(1, 1, 200, 200)):
        assert "take no mask" in npu.LOWERING.attention_reason(q, k, v, cfg, mask)
        assert "take no mask" in npu.LOWERING.attention_reason(q, k, v, mx_cfg, mask)
    assert "log-sum-exp" in npu.LOWERING.attention_reason(q, k, v, cfg, need_lse=True)
    assert npu.LOWERING.attention_reason(q, k, v, mx_cfg, need_lse=True) is None
    assert "head dim 256" in npu.LOWERING.attention_reason(*qkv(d=256), cfg)
    assert "query length 1" in npu.LOWERING.attention_reason(*qkv(s=1, s_k=16), cfg)
    assert npu.LOWERING.attention_reason(*qkv(s=300, s_k=40), cfg) is None  # cross-attention lengths


# -- numerics of each path against the CPU reference ---------------------------------------------------
@pytest.fixture(params=["mindiesd", "fia_block", "fia_mx"])
def path(request, torch_npu_sim):
    """(kernel, granularity override, the op that runs it, its call counter)."""
    if request.param == "mindiesd":
        with installed_mindiesd() as sd:
            yield "mindiesd", {}, sd.calls, SD_FIA
    elif request.param == "fia_block":
        torch_npu_sim.cann_version = OLD_CANN
        yield "fia_block", {}, torch_npu_sim.calls, FIA
    else:
        yield "fia_mx", {"granularity": "mx"}, torch_npu_sim.calls, FIA


_OVERRIDES = [
    {},
    dict(q_block=256, kv_block=512),
    dict(granularity="head"),
    dict(granularity="tensor", hadamard=False, smooth_k=False),
    dict(p_scale=224.0),
]


# the MXFP8 path runs granularity mx only: no granularity override for it
@pytest.mark.parametrize(
    "path, over",
    [
        pytest.param(p, o, id=f"{p}-over{i}")
        for p in ["mindiesd", "fia_block", "fia_mx"]
        for i, o in enumerate(_OVERRIDES)
        if not (p == "fia_mx" and "granularity" in o)
    ],
    indirect=["path"],
)
def test_attention_matches_the_reference(path, over):
    kernel, base, calls, op = path
    out, ref = run_both(*qkv(s=300), **{**over, **base})
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert calls[op] == 1
    assert rel_err(out, ref) < 1e-4  # same quantized values, same fp32 math: summation order only


@pytest.mark.parametrize("d", [32, 64, 80, 128])
def test_head_dims_are_zero_padded_to_the_kernel(path, d):
    kernel, base, calls, op = path
    out, ref = run_both(*qkv(s=130, d=d), **base)
    assert out.shape[-1] == d and rel_err(out, ref) < 1e-4


def test_batch_cross_attention_and_fp16(path):
    kernel, base, calls, op = path
    out, ref = run_both(*qkv(b=2, s=150, s_k=70, dtype=torch.float16), **base)
    assert out.dtype == torch.float16 and out.shape == (2, 2, 150, 32)
    assert rel_err(out, ref) < 1e-4


def test_mindiesd_quantizes_one_sample_at_a_time(mindiesd_sim, torch_npu_sim):
    out, ref = run_both(*qkv(b=3))
    assert mindiesd_sim.calls["fa_block_quant_preprocess"] == 9 and mindiesd_sim.calls[SD_FIA] == 1
    assert torch_npu_sim.calls["npu_dynamic_block_quant"] == 9 and torch_npu_sim.calls[FIA] == 0
    assert mindiesd_sim.last_kwargs[SD_FIA]["quant_scale1"] == 448.0  # the P scale reaches the kernel
    assert rel_err(out, ref) < 1e-4


def test_mx_log_sum_exp_matches_the_reference(torch_npu_sim):
    q, k, v = qkv(b=2, s=96)
    kw = attention_kwargs(granularity="mx", softmax_scale=1 / math.sqrt(32), return_lse=True)
    (out, lse), (ref, ref_lse) = npu.LOWERING.attention(q, k, v, **kw), REFERENCE.attention(q, k, v, **kw)
    assert lse.shape == (2, 2, 96) and lse.dtype == torch.float32
    assert (lse - ref_lse).abs().max() < 1e-4 and rel_err(out, ref) < 1e-4
    assert torch_npu_sim.last_kwargs[FIA]["return_softmax_lse"] is True


def test_mx_runs_per_sample_where_value_blocks_would_straddle_samples(torch_npu_sim):
    out, ref = run_both(*qkv(b=2, s=64, s_k=50), granularity="mx")  # 50 tokens: not a multiple of 32
    assert torch_npu_sim.calls[FIA] == 2 and rel_err(out, ref) < 1e-4
    run_both(*qkv(b=2, s=64, s_k=64), granularity="mx")
    assert torch_npu_sim.calls[FIA] == 3  # one call for the whole batch


def test_sequence_padding_of_the_output_is_trimmed(torch_npu_sim):
    torch_npu_sim.cann_version = OLD_CANN
    torch_npu_sim.pad_output_rows = 128  # the op hands back 256 rows for 200 queries
    out, ref = run_both(*qkv(s=200))
    assert out.shape == ref.shape and torch.isfinite(out).all() and rel_err(out, ref) < 1e-4


def test_the_compile_time_choice_is_followed_at_run_time(mindiesd_sim, torch_npu_sim):
    q, k, v = qkv()
    npu.LOWERING.attention(q, k, v, **attention_kwargs(softmax_scale=0.2, kernel="mindiesd"))
    assert mindiesd_sim.calls[SD_FIA] == 1
    with pytest.raises(ValueError, match="does not run granularity"):
        npu.LOWERING.attention(q, k, v, **attention_kwargs(softmax_scale=0.2, kernel="fia_mx"))
    with pytest.raises(ValueError, match="no attention mask"):
        npu.LOWERING.attention(q, k, v, **attention_kwargs(softmax_scale=0.2, attn_mask=torch.ones(200, 200) > 0))
    torch_npu_sim.chip = "Ascend910B3"
    with pytest.raises(RuntimeError, match="no FP8 attention path.*Ascend910B3"):
        npu.LOWERING.attention(q, k, v, **attention_kwargs(softmax_scale=0.2))


# -- linears ----------------------------------------------------------------------------------------------
def linear_case(method="fp8", granularity="channel", bias=True, seed=0, m=30, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 64, generator=g).to(dtype)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    wq, ws = quant.quantize_weight(w, granularity, method=method)
    return x, wq, ws, b


def run_linear(lowering, x, wq, ws, b, *, method, granularity="channel", act="token", static=None):
    xq, xs = lowering.quantize_activation(x, static, method=method, granularity=act)
    return lowering.scaled_mm(
        xq, xs, wq, ws, b, method=method, weight_granularity=granularity, weight_block=None, out_dtype=x.dtype
    )


@pytest.mark.parametrize(
    "chip, method",
    [("Ascend950PR", "fp8"), ("Ascend950PR", "int8"), ("Ascend910B3", "int8"), ("Ascend910_9392", "int8")],
)
@pytest.mark.parametrize(
    "granularity, act, static",
    [("channel", "token", None), ("tensor", "token", None), ("channel", "tensor", None), ("channel", "tensor", 0.02)],
)
def test_linear_matches_the_reference(chip, method, granularity, act, static, torch_npu_sim):
    torch_npu_sim.chip = chip
    x, wq, ws, _ = linear_case(method, granularity, bias=False, m=32)
    s = torch.tensor(static) if static is not None else None
    out = run_linear(npu.LOWERING, x, wq, ws, None, method=method, granularity=granularity, act=act, static=s)
    ref = run_linear(REFERENCE, x, wq, ws, None, method=method, granularity=granularity, act=act, static=s)
    assert out.shape == (32, 96) and out.dtype == torch.bfloat16
    assert torch_npu_sim.calls["npu_quant_matmul"] == 1
    assert torch_npu_sim.calls["npu_dynamic_quant"] == int(act == "token" and static is None)
    assert torch_npu_sim.last_kwargs["npu_quant_matmul"]["x_dtype"] == quant.METHODS[method][0]
    assert rel_err(out, ref) < 1e-5  # same quantized operands, exact integer / fp32 accumulation


@pytest.mark.parametrize("method, dtype", [("fp8", torch.bfloat16), ("int8", torch.bfloat16), ("int8", torch.float16)])
def test_linear_bias_is_added_inside_the_matmul_in_fp32(method, dtype, torch_npu_sim):
    x, wq, ws, b = linear_case(method, dtype=dtype, m=32)
    out = run_linear(npu.LOWERING, x, wq, ws, b, method=method)
    ref = run_linear(REFERENCE, x, wq, ws, b, method=method)  # rounds twice (matmul, then + bias)
    assert torch_npu_sim.last_kwargs["npu_quant_matmul"]["bias_dtype"] == torch.float32
    assert out.dtype == dtype and rel_err(out, ref) < 5e-3


def test_weight_only_linear_uses_no_npu_op(torch_npu_sim):
    x, wq, ws, b = linear_case()
    out = npu.LOWERING.weight_only_linear(x, wq, ws, b, method="fp8", weight_granularity="channel", weight_block=None)
    assert sum(torch_npu_sim.calls.values()) == 0
    ref = REFERENCE.weight_only_linear(x, wq, ws, b, method="fp8", weight_granularity="channel", weight_block=None)
    assert rel_err(out, ref) < 1e-6


def test_weight_only_and_linear_reasons(torch_npu_sim):
    w = torch.empty(96, 64, dtype=torch.bfloat16)
    x = torch.empty(4, 64, dtype=torch.bfloat16)
    fp8, int8 = QuantizationConfig(), QuantizationConfig(method="int8")
    assert npu.LOWERING.fused_activation_quant
    assert npu.LOWERING.weight_only(w, fp8) is None and npu.LOWERING.weight_only(w, int8) is None
    assert "block weight scales" in npu.LOWERING.linear_reason(x, w, QuantizationConfig(weight_block_size=[32, 32]))
    assert "fp16/bf16" in npu.LOWERING.linear_reason(x.float(), w, fp8)
    assert "up to 65535" in npu.LOWERING.linear_reason(x, torch.empty(70000, 64, dtype=torch.bfloat16), int8)
    assert npu.LOWERING.linear_reason(x, w, fp8) is None and npu.LOWERING.linear_reason(x, w, int8) is None
    for chip in ("Ascend910B3", "Ascend910_9392"):  # Atlas A2 / A3
        torch_npu_sim.chip = chip
        msg = npu.LOWERING.weight_only(w, fp8)
        assert f"{chip} has no FP8 kernels" in msg and "int8" in msg
        assert npu.LOWERING.linear_reason(x, w, QuantizationConfig(weight_block_size=[32, 32])) is None  # weight-only
        assert npu.LOWERING.weight_only(w, int8) is None  # real INT8 W8A8
        assert npu.LOWERING.linear_reason(x, w, int8) is None


def test_scaled_mm_refuses_what_npu_quant_matmul_cannot_take(torch_npu_sim):
    # prepared QuantizedLinear modules reach the lowering without linear_reason: a clear error, not a vendor one
    x, wq, ws, _ = linear_case()
    xq, xs = npu.LOWERING.quantize_activation(x, None, method="fp8", granularity="token")
    with pytest.raises(ValueError, match="output dtype torch.float32"):
        npu.LOWERING.scaled_mm(
            xq, xs, wq, ws, None, method="fp8", weight_granularity="channel", weight_block=None, out_dtype=torch.float32
        )
    wq, ws = quant.quantize_weight(torch.randn(96, 64), "block", (32, 32))
    with pytest.raises(ValueError, match="block weight scales need weight-only"):
        npu.LOWERING.scaled_mm(
            xq,
            xs,
            wq,
            ws,
            None,
            method="fp8",
            weight_granularity="block",
            weight_block=(32, 32),
            out_dtype=torch.bfloat16,
        )


# -- end to end on tiny diffusers transformers -----------------------------------------------------------
def compile_pair(family, npu_options=None, ref_options=None, **kw):
    """(npu output, its report, CPU reference output) of the bf16 tiny `family` model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer(family, dtype=torch.bfloat16)
    inputs = example_inputs(family, model, dtype=torch.bfloat16)
    with torch.no_grad():
        out = output_tensor(
            torch.compile(model, backend="fp8_npu", options={**NPU_OPTIONS, **(npu_options or {})}, fullgraph=True)(
                **inputs
            )
        )
        report = fx_fp8.get_reports()[-1]
        torch._dynamo.reset()
        ref = output_tensor(
            torch.compile(model, backend="fp8", options={**REF_OPTIONS, **(ref_options or {})}, fullgraph=True)(
                **inputs
            )
        )
    return out, report, ref


def check_linears(report, calls):
    n_lin = report.count("linear", "fp8")
    groups = {e.act_quant_group for e in report.entries if e.op == "linear" and e.action != "native"}
    assert n_lin > 0 and calls["npu_quant_matmul"] == n_lin
    assert calls["npu_dynamic_quant"] == len(groups - {""})  # one per activation-quantization group


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_family_through_mindiesd(family, mindiesd_sim, torch_npu_sim):
    out, report, ref = compile_pair(family)
    assert report.lowering == "npu"
    n_attn = report.count("attention", "fp8")
    assert n_attn > 0 and mindiesd_sim.calls[SD_FIA] == n_attn and torch_npu_sim.calls[FIA] == 0
    assert mindiesd_sim.calls["fa_block_quant_preprocess"] == 3 * n_attn  # batch 1: one per Q, K, V
    last = mindiesd_sim.last_kwargs[SD_FIA]
    assert last["input_layout"] == "BNSD" and last["head_dim"] == 64 and last["out_dtype"] == torch.bfloat16
    assert last["softmax_scale"] == pytest.approx(1 / math.sqrt(32))  # the model's head dim, not the padded one
    check_linears(report, torch_npu_sim.calls)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize(
    "family, granularity, cann",
    [("flux", "block", OLD_CANN), ("wan", "block", OLD_CANN), ("flux", "mx", "9.1.0"), ("wan", "mx", "9.1.0")],
)
@pytest.mark.slow
def test_family_through_torch_npu_without_mindiesd(family, granularity, cann, torch_npu_sim):
    torch_npu_sim.cann_version = cann
    attention = {"attention": {"granularity": granularity}}
    out, report, ref = compile_pair(family, attention, attention)
    n_attn = report.count("attention", "fp8")
    assert n_attn > 0 and torch_npu_sim.calls[FIA] == n_attn
    assert torch_npu_sim.last_kwargs[FIA]["modes"] == ((7, 7, 7) if granularity == "block" else (6, 6, 8))
    check_linears(report, torch_npu_sim.calls)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.slow
def test_family_native_with_the_reason_where_no_path_fits(torch_npu_sim):
    out, report, ref = compile_pair("flux")  # current CANN refuses mode 7, MindIE-SD absent, granularity block
    attn = [e for e in report.entries if e.op == "attention"]
    assert attn and all(e.action == "native" for e in attn)
    assert all("refuses per-block FP8 attention" in e.reason and "mindiesd" in e.reason for e in attn)
    assert torch_npu_sim.calls[FIA] == 0
    assert torch.isfinite(out).all()


@pytest.mark.slow
def test_fp8_rows_name_the_attention_path(mindiesd_sim):
    """Needs the attention pass to ask `lowering.attention_kernel` (see its docstring) for FP8 nodes."""
    _, report, _ = compile_pair("flux")
    rows = [e for e in report.entries if e.op == "attention" and e.action == "fp8"]
    assert rows  # not vacuous: all() of nothing is True
    assert rows and all("MindIE-SD" in e.reason for e in rows), [e.reason for e in rows]


@pytest.mark.slow
def test_atlas_a2_fp8_keeps_attention_native_and_runs_linears_weight_only(torch_npu_sim, mindiesd_sim):
    torch_npu_sim.chip = "Ascend910B3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("wan", dtype=torch.bfloat16)
    kwargs = example_inputs("wan", model, dtype=torch.bfloat16)
    with torch.no_grad():
        native = output_tensor(model(**kwargs))
        with pytest.warns(UserWarning, match="Ascend910B3 has no FP8 kernels.*weight-only"):
            out = output_tensor(torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(**kwargs))
    report = fx_fp8.get_reports()[-1]
    attn = [e for e in report.entries if e.op == "attention" and "cross-attention" not in e.reason]
    assert attn  # not vacuous: all() of nothing is True
    assert attn and all(e.action == "native" and "Ascend910B3" in e.reason and "950" in e.reason for e in attn)
    weight_only = [e for e in report.entries if e.op == "linear" and e.action == "weight-only"]
    assert weight_only  # not vacuous: all() of nothing is True
    assert weight_only and all("weight-only" in e.reason for e in weight_only)
    # the FP8 layers dequantize natively; only the sensitive layers (weight-only INT8 by default) call the
    # weight-quant matmul
    sensitive = [e for e in weight_only if "sensitive: weight_only" in e.reason]
    assert sensitive and dict(torch_npu_sim.calls) == {"npu_weight_quant_batchmatmul": len(sensitive)}
    assert sum(mindiesd_sim.calls.values()) == 0
    assert rel_err(out, native) < 5e-2  # only the FP8 weight rounding remains


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["Ascend910B3", "Ascend950PR"])
def test_int8_w8a8_on_atlas_a2_and_950(chip, torch_npu_sim):
    torch_npu_sim.chip = chip
    options = {"quantization": "int8", "diffusion_kv_cache_dtype": None}
    out, report, ref = compile_pair("flux", options, options)
    rows = [e for e in report.entries if e.op == "linear" and e.action not in ("native", "weight-only")]
    assert rows and all(e.action == "int8" and "weight-only" not in e.reason for e in rows)
    calls = torch_npu_sim.calls
    assert calls["npu_quant_matmul"] == len(rows)
    assert calls["npu_dynamic_quant"] == len({e.act_quant_group for e in rows})
    assert torch_npu_sim.last_kwargs["npu_quant_matmul"]["x_dtype"] == torch.int8
    assert rel_err(out, ref) < 1e-2


def test_one_npu_dynamic_quant_per_activation_group_in_a_flux_block(torch_npu_sim):
    """q/k/v (and the other readers of one tensor) share one npu_dynamic_quant: one activation is
    quantized once, not once per reader."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux", layers=1, dtype=torch.bfloat16)
    inputs = example_inputs("flux", model, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(**inputs)
    rows = [e for e in fx_fp8.get_reports()[-1].entries if e.op == "linear" and e.action == "fp8"]
    groups = {}
    for e in rows:
        groups.setdefault(e.act_quant_group, []).append(e.module)
    assert "" not in groups and torch_npu_sim.calls["npu_dynamic_quant"] == len(groups) < len(rows)
    qkv_group = next(g for g in groups.values() if "transformer_blocks.0.attn.to_q" in g)
    assert {"transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"} <= set(qkv_group)


def test_dynamic_shapes_compile_once(mindiesd_sim):
    model = TinyAttention().to(torch.bfloat16).eval()
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, dynamic=True)
    with torch.no_grad():
        for s in (64, 96, 160):
            compiled(torch.randn(1, s, 128).to(torch.bfloat16))
    # no recompilation per sequence length, by Dynamo's own count
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0
    assert len(fx_fp8.get_reports()) == 1
    assert fx_fp8.get_reports()[-1].count("attention", "fp8") == 1 and mindiesd_sim.calls[SD_FIA] == 3


def test_fp32_model_stays_native_with_the_reason(torch_npu_sim, mindiesd_sim):
    model = TinyAttention().eval()
    with torch.no_grad():
        torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(torch.randn(1, 64, 128))
    report = fx_fp8.get_reports()[-1]
    assert report.summary() == {"attention": {"fp8": 0, "native": 1}, "linear": {"fp8": 0, "native": 2}}
    reasons = {e.module: e.reason for e in report.entries}
    assert "fp16/bf16" in reasons["to_qkv"] and any(
        "fp16/bf16" in e.reason for e in report.entries if e.op == "attention"
    )
    assert sum(torch_npu_sim.calls.values()) == 0


def test_masked_attention_stays_native(torch_npu_sim, mindiesd_sim):
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(2, 64, 128).to(torch.bfloat16)
    keep = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    keep[0, ..., 40:] = False
    with torch.no_grad():
        torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(x, keep)
    attn = [e for e in fx_fp8.get_reports()[-1].entries if e.op == "attention"]
    assert len(attn) == 1 and attn[0].action == "native" and "take no mask" in attn[0].reason
    assert mindiesd_sim.calls[SD_FIA] == 0


# -- backend choice -----------------------------------------------------------------------------------------
def test_fp8_npu_without_an_npu_warns_and_uses_the_reference():
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 128).to(torch.bfloat16)
    with torch.no_grad(), pytest.warns(UserWarning, match="found no Ascend NPU.*reference"):
        torch.compile(model, backend="fp8_npu")(x)
    report = fx_fp8.get_reports()[-1]
    assert report.lowering == "reference"
    assert report.count("attention", "fp8") == 1


def test_npugraph_ex_downstream_needs_the_dynamo_backend(torch_npu_sim):
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 128).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(Exception, match="downstream 'npugraph_ex' needs torch_npu"):
        torch.compile(model, backend="fp8_npu", options={"lowering": "npu", "downstream": "npugraph_ex"})(x)


def test_npugraph_ex_downstream_uses_the_registered_backend(mindiesd_sim, monkeypatch):
    from torch._dynamo.backends import registry

    seen = []

    def fake_npugraph_ex(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    monkeypatch.setitem(registry._BACKENDS, "npugraph_ex", None)
    monkeypatch.setitem(registry._COMPILER_FNS, "npugraph_ex", fake_npugraph_ex)
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 128).to(torch.bfloat16)
    with torch.no_grad():
        torch.compile(model, backend="fp8_npu", options={"lowering": "npu", "downstream": "npugraph_ex"})(x)
    assert len(seen) == 1 and torch.ops.fx_fp8.fp8_attention.default in seen[0]
    assert fx_fp8.get_reports()[-1].downstream == "npugraph_ex"
    assert mindiesd_sim.calls[SD_FIA] == 1
