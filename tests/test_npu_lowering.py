"""The npu lowering under the torch_npu contract simulator: routing, counts, numerics, native reasons."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
import fx_fp8.backend as backend_mod
from fx_fp8.config import AttentionQuantConfig, QuantizationConfig
from fx_fp8.tools.families import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.ops import npu, quant
from fx_fp8.ops.reference import LOWERING as REFERENCE
from npu_sim import torch_npu_sim  # noqa: F401  (fixture)

NPU_OPTIONS = {"lowering": "npu", "downstream": "eager"}
ATTN = "npu_fused_infer_attention_score_v2"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def attention_kwargs(**over):
    kw = dict(attn_mask=None, softmax_scale=None, granularity="block", q_block=128, kv_block=256, hadamard=True,
              smooth_k=True, quantize_p=True, p_scale=448.0)
    kw.update(over)
    return kw


def qkv(b=1, h=2, s=200, d=32, s_k=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    s_k = s if s_k is None else s_k
    return (torch.randn(b, h, s, d, generator=g).to(dtype), torch.randn(b, h, s_k, d, generator=g).to(dtype),
            torch.randn(b, h, s_k, d, generator=g).to(dtype))


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


# -- end to end on tiny diffusers transformers ---------------------------------------
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_family_runs_every_fp8_node_through_the_simulated_ops(family, torch_npu_sim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer(family, dtype=torch.bfloat16)
    kwargs = example_inputs(family, model, dtype=torch.bfloat16)
    with torch.no_grad():
        out = output_tensor(torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(**kwargs))
        report = fx_fp8.get_reports()[-1]
        torch._dynamo.reset()
        ref = output_tensor(torch.compile(model, backend="fp8", options={"lowering": "reference", "downstream": "eager"},
                                          fullgraph=True)(**kwargs))
    assert report.lowering == "npu"
    n_attn, n_lin = report.count("attention", "fp8"), report.count("linear", "fp8")
    assert n_attn > 0 and n_lin > 0
    calls = torch_npu_sim.calls
    assert calls[ATTN] == n_attn
    assert calls["npu_quant_matmul"] == n_lin
    assert calls["npu_dynamic_quant"] == n_lin  # per-token activations by default
    last = torch_npu_sim.last_kwargs[ATTN]
    assert last["input_layout"] == "BNSD"
    assert last["softmax_scale"] == pytest.approx(1 / math.sqrt(32))  # the model's head dim, not the padded one
    assert last["head_dim"] == 64 and last["out_dtype"] == torch.bfloat16 and last["quant_scale_p"] == 448.0
    assert all(e.reason.startswith("npu:") for e in report.entries if e.action == "fp8")
    assert rel_err(out, ref) < 1e-2


def test_atlas_a2_keeps_attention_native_and_runs_linears_weight_only(torch_npu_sim, monkeypatch):
    import fx_fp8.passes.linear as linear_pass

    monkeypatch.setattr(linear_pass, "_WARNED_WEIGHT_ONLY", set())  # the pass warns once per message per process
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
    assert attn and all(e.action == "native" and "Ascend910B3" in e.reason and "950" in e.reason for e in attn)
    weight_only = [e for e in report.entries if e.op == "linear" and e.action == "fp8"]
    assert weight_only and all("weight-only" in e.reason for e in weight_only)
    assert sum(torch_npu_sim.calls.values()) == 0
    assert rel_err(out, native) < 5e-2  # only the FP8 weight rounding remains


def test_fp32_model_stays_native_with_the_reason(torch_npu_sim):
    model = TinyAttention().eval()
    x = torch.randn(1, 64, 128)
    with torch.no_grad():
        torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(x)
    report = fx_fp8.get_reports()[-1]
    assert report.summary() == {"attention": {"fp8": 0, "native": 1}, "linear": {"fp8": 0, "native": 2}}
    assert all("fp16/bf16" in e.reason for e in report.entries)
    assert sum(torch_npu_sim.calls.values()) == 0


def test_bool_mask_is_inverted_to_the_npu_convention(torch_npu_sim):
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(2, 64, 128).to(torch.bfloat16)
    keep = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    keep[0, ..., 40:] = False  # SDPA: True = attend; padding keys of sample 0 masked
    with torch.no_grad():
        out = torch.compile(model, backend="fp8_npu", options=NPU_OPTIONS, fullgraph=True)(x, keep)
        torch._dynamo.reset()
        ref = torch.compile(model, backend="fp8", options={"lowering": "reference", "downstream": "eager"})(x, keep)
    assert torch_npu_sim.calls[ATTN] == 1
    assert rel_err(out, ref) < 1e-3


def test_additive_and_per_head_masks_stay_native(torch_npu_sim):
    cfg = AttentionQuantConfig()
    q, k, v = qkv()
    assert "boolean masks only" in npu.LOWERING.attention_reason(q, k, v, cfg, torch.zeros(1, 1, 200, 200))
    assert "one mask for all heads" in npu.LOWERING.attention_reason(q, k, v, cfg, torch.ones(1, 2, 200, 200, dtype=torch.bool))
    assert "one mask for all heads" in npu.LOWERING.attention_reason(q, k, v, cfg, torch.ones(2, 200, 200, dtype=torch.bool))
    assert npu.LOWERING.attention_reason(q, k, v, cfg, torch.ones(200, 200, dtype=torch.bool)) is None


# -- attention numerics against the CPU reference -------------------------------------
@pytest.mark.parametrize("over", [
    dict(granularity="block"),
    dict(granularity="block", q_block=256, kv_block=512),
    dict(granularity="head"),
    dict(granularity="tensor", hadamard=False, smooth_k=False),
    dict(p_scale=224.0),
])
def test_attention_matches_the_reference(over, torch_npu_sim):
    out, ref = run_both(*qkv(s=300), **over)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("d, kernel_d", [(32, 64), (64, 64), (80, 128), (128, 128)])
def test_head_dims_are_zero_padded_to_the_kernel(d, kernel_d, torch_npu_sim):
    out, ref = run_both(*qkv(s=130, d=d))
    assert torch_npu_sim.last_kwargs[ATTN]["head_dim"] == kernel_d
    assert out.shape[-1] == d and rel_err(out, ref) < 1e-3


def test_cross_attention_and_fp16(torch_npu_sim):
    out, ref = run_both(*qkv(s=150, s_k=40, dtype=torch.float16))
    assert out.dtype == torch.float16 and out.shape == (1, 2, 150, 32)
    assert torch_npu_sim.last_kwargs[ATTN]["out_dtype"] == torch.float16
    assert rel_err(out, ref) < 1e-3


def test_sequence_padding_of_the_output_is_trimmed(torch_npu_sim):
    torch_npu_sim.pad_output_rows = 128  # the op hands back 256 rows for 200 queries
    out, ref = run_both(*qkv(s=200))
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("over, q_dtype, needle", [
    (dict(q_block=64), torch.bfloat16, "q_block=64"),
    (dict(quantize_p=False), torch.bfloat16, "always quantizes P"),
    ({}, torch.float32, "fp16/bf16"),
])
def test_attention_reasons(over, q_dtype, needle, torch_npu_sim):
    cfg = AttentionQuantConfig(**over)
    q, k, v = qkv(dtype=q_dtype)
    assert needle in npu.LOWERING.attention_reason(q, k, v, cfg)


def test_attention_reason_for_large_head_dim_and_single_query(torch_npu_sim):
    cfg = AttentionQuantConfig()
    q, k, v = qkv(d=256)
    assert "head dim 256" in npu.LOWERING.attention_reason(q, k, v, cfg)
    q, k, v = qkv(s=1, s_k=16)
    assert "query length 1" in npu.LOWERING.attention_reason(q, k, v, cfg)
    assert npu.LOWERING.attention_reason(*qkv(), cfg) is None


# -- linears ---------------------------------------------------------------------------
def linear_case(granularity="channel", bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 10, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    wq, ws = quant.quantize_weight(w, granularity)
    return x, wq, ws, b


@pytest.mark.parametrize("weight_granularity, act_granularity, static", [
    ("channel", "token", False), ("tensor", "token", False), ("channel", "tensor", False), ("channel", "token", True),
])
def test_linear_matches_the_reference(weight_granularity, act_granularity, static, torch_npu_sim):
    x, wq, ws, _ = linear_case(weight_granularity, bias=False)
    xs = torch.tensor(0.01) if static else None
    kw = dict(weight_granularity=weight_granularity, weight_block=None, act_granularity=act_granularity, weight_only=False)
    out = npu.LOWERING.linear(x, wq, ws, None, xs, **kw)
    ref = REFERENCE.linear(x, wq, ws, None, xs, **kw)
    assert out.shape == (3, 10, 96) and out.dtype == torch.bfloat16
    assert torch_npu_sim.calls["npu_quant_matmul"] == 1
    assert torch_npu_sim.calls["npu_dynamic_quant"] == int(act_granularity == "token" and not static)
    assert rel_err(out, ref) < 1e-6  # same quantized operands, same fp32 accumulation


def test_linear_bias_is_added_inside_the_matmul(torch_npu_sim):
    x, wq, ws, b = linear_case()
    kw = dict(weight_granularity="channel", weight_block=None, act_granularity="token", weight_only=False)
    out = npu.LOWERING.linear(x, wq, ws, b, None, **kw)
    ref = REFERENCE.linear(x, wq, ws, b, None, **kw)  # rounds twice (matmul, then + bias): bf16-ulp differences
    assert rel_err(out, ref) < 5e-3


def test_weight_only_linear_uses_no_npu_op(torch_npu_sim):
    x, wq, ws, b = linear_case()
    kw = dict(weight_granularity="channel", weight_block=None, act_granularity="token", weight_only=True)
    out = npu.LOWERING.linear(x, wq, ws, b, None, **kw)
    assert sum(torch_npu_sim.calls.values()) == 0
    assert rel_err(out, REFERENCE.linear(x, wq, ws, b, None, **kw)) < 1e-6


def test_linear_reasons(torch_npu_sim):
    w = torch.empty(96, 64, dtype=torch.bfloat16)
    x = torch.empty(4, 64, dtype=torch.bfloat16)
    assert "block weight scales" in npu.LOWERING.linear_reason(x, w, QuantizationConfig(weight_block_size=[32, 32]))
    assert "INT8" in npu.LOWERING.linear_reason(x, w, QuantizationConfig(method="int8"))
    assert "fp16/bf16" in npu.LOWERING.linear_reason(x.float(), w, QuantizationConfig())
    assert npu.LOWERING.linear_reason(x, w, QuantizationConfig()) is None
    torch_npu_sim.chip = "Ascend910_9392"  # A3: weight-only, so block weights are fine
    assert npu.LOWERING.linear_reason(x, w, QuantizationConfig(weight_block_size=[32, 32])) is None
    assert "Ascend910_9392 has no FP8 kernels" in npu.LOWERING.weight_only(w)


# -- backend choice -----------------------------------------------------------------------
def test_fp8_npu_without_an_npu_warns_and_uses_the_reference(monkeypatch):
    monkeypatch.setattr(backend_mod, "_WARNED", set())
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 128).to(torch.bfloat16)
    with torch.no_grad(), pytest.warns(UserWarning, match="found no Ascend NPU.*reference"):
        torch.compile(model, backend="fp8_npu")(x)
    report = fx_fp8.get_reports()[-1]
    assert (report.lowering, report.downstream) == ("reference", "eager")
    assert report.count("attention", "fp8") == 1


def test_npugraph_ex_downstream_needs_the_dynamo_backend(torch_npu_sim):
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 128).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(Exception, match="downstream 'npugraph_ex' needs torch_npu"):
        torch.compile(model, backend="fp8_npu", options={"lowering": "npu", "downstream": "npugraph_ex"})(x)


def test_npugraph_ex_downstream_uses_the_registered_backend(torch_npu_sim, monkeypatch):
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
    assert torch_npu_sim.calls[ATTN] == 1


def test_linear_refuses_what_npu_quant_matmul_cannot_take(torch_npu_sim):
    # prepared FP8Linear modules reach the lowering without linear_reason: a clear error, not a vendor one
    x, wq, ws, _ = linear_case()
    kw = dict(weight_granularity="channel", weight_block=None, act_granularity="token", weight_only=False)
    with pytest.raises(ValueError, match="input dtype torch.float32"):
        npu.LOWERING.linear(x.float(), wq, ws, None, None, **kw)
    wq, ws = quant.quantize_weight(torch.randn(96, 64), "block", (32, 32))
    with pytest.raises(ValueError, match="block weight scales need weight-only"):
        npu.LOWERING.linear(x, wq, ws, None, None, **dict(kw, weight_granularity="block", weight_block=(32, 32)))
