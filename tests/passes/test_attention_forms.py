"""Every attention form gets a report row: F.scaled_dot_product_attention and the aten flash /
efficient / cudnn / CPU-flash ops diffusers' backends (and ring attention) call directly.
Rewritten where their outputs allow it (the result, or the result and the log-sum-exp in a
layout the FP8 op produces), native with the reason otherwise."""

import math
import operator
import warnings

import pytest
import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops.lowering import get_lowering
from fx_fp8.passes.base import compile_contexts
from fx_fp8.passes.attention import FP8AttentionPass
from fx_fp8.graph.names import LayerMap
from fx_fp8.report import CompileReport

aten = torch.ops.aten


class FlashCPU(nn.Module):
    """Calls the CPU flash kernel directly and uses its log-sum-exp (as ring attention does)."""

    def __init__(self, use_lse: bool):
        super().__init__()
        self.use_lse = use_lse

    def forward(self, q, k, v):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return (out, lse) if self.use_lse else out


def qkv(s=96, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, s, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize("use_lse", [False, True])
def test_cpu_flash_op_rewritten_with_and_without_lse(use_lse):
    q, k, v = qkv()
    m = FlashCPU(use_lse)
    compiled = torch.compile(m, backend="fp8", options={"diffusion_kv_cache_dtype": "fp8"})
    got, ref = compiled(q, k, v), m(q, k, v)
    (entry,) = fx_fp8.get_reports(compiled)[0].entries
    assert entry.action == "fp8" and entry.form == "flash_cpu"
    out, ref_out = (got[0], ref[0]) if use_lse else (got, ref)
    assert float((out - ref_out).norm() / ref_out.norm()) < 0.08  # about 22 dB: the e4m3 floor
    assert not torch.equal(out, ref_out)  # the FP8 op ran
    if use_lse:
        assert got[1].shape == ref[1].shape and float((got[1] - ref[1]).abs().max()) < 0.05


def _graph(op, *, use=(0,), mask=False, device="cuda", dtype=torch.float16):
    """A hand-built graph calling an aten attention op whose outputs `use` are read; node
    metadata are FakeTensors on `device` (these kernels do not run on CPU)."""
    g = torch.fx.Graph()
    names = ["q", "k", "v"] + (["mask"] if mask else [])
    ph = [g.placeholder(n) for n in names]
    with FakeTensorMode():
        vals = [torch.empty(1, 2, 128, 64, device=device, dtype=dtype) for _ in range(3)]
        if mask:
            vals.append(torch.zeros(1, 1, 1, 128, device=device, dtype=dtype))
        for node, val in zip(ph, vals):
            node.meta["val"] = val
        if op is aten._scaled_dot_product_flash_attention.default:
            call = g.call_function(op, (ph[0], ph[1], ph[2]))
        elif op is aten._scaled_dot_product_efficient_attention.default:
            call = g.call_function(op, (ph[0], ph[1], ph[2], ph[3] if mask else None, 1 in use))
        else:  # cudnn
            call = g.call_function(op, (ph[0], ph[1], ph[2], ph[3] if mask else None, 1 in use))
    outs = [g.call_function(operator.getitem, (call, i)) for i in use]
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(nn.Module(), g)
    inputs, out = compile_contexts(
        gm,
        vals,
        FP8Config(quantization=None),
        get_lowering("reference"),
        CompileReport("fp8", "reference", "eager", None),
        LayerMap({}),
        warnings.warn,
    )
    changed = FP8AttentionPass(inputs, out).run(gm)
    gm.graph.lint()
    (entry,) = out.report.entries
    return changed, entry, gm


@pytest.mark.parametrize(
    "op, form",
    [
        (aten._scaled_dot_product_flash_attention.default, "flash"),
        (aten._scaled_dot_product_efficient_attention.default, "efficient"),
        (aten._scaled_dot_product_cudnn_attention.default, "cudnn"),
    ],
)
def test_aten_forms_rewritten_when_only_the_output_is_read(op, form):
    changed, entry, gm = _graph(op, use=(0,))
    assert changed == 1 and (entry.action, entry.form) == ("fp8", form)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.fx_fp8.fp8_attention.default in targets and op not in targets


@pytest.mark.parametrize(
    "op, form, rewritten",
    [
        (aten._scaled_dot_product_flash_attention.default, "flash", True),  # lse (B, H, Sq): produced
        (aten._scaled_dot_product_cudnn_attention.default, "cudnn", True),  # lse (B, H, Sq, 1): unsqueezed
        (aten._scaled_dot_product_efficient_attention.default, "efficient", False),  # lse padded to 32 rows
    ],
)
def test_aten_forms_with_log_sum_exp(op, form, rewritten):
    changed, entry, gm = _graph(op, use=(0, 1))
    assert entry.form == form and (entry.action == "fp8") == rewritten and changed == int(rewritten)
    if rewritten:
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert torch.ops.fx_fp8.fp8_attention_lse.default in targets
    else:
        assert "log-sum-exp layout" in entry.reason


def test_aten_form_reading_other_outputs_stays_native():
    _, entry, _ = _graph(aten._scaled_dot_product_flash_attention.default, use=(0, 6))  # the rng state
    assert entry.action == "native" and "outputs other than the result and log-sum-exp" in entry.reason


def test_lse_under_context_parallel_merge_is_exact_enough():
    """Two halves of the keys merged by their log-sum-exp (what ring attention does) equal the
    FP8 attention over all keys."""
    q, k, v = qkv(s=128, d=32, seed=3)
    scale = 1 / math.sqrt(32)
    kw = dict(
        granularity="block",
        q_block=128,
        kv_block=256,
        hadamard=True,
        smooth_k=True,
        quantize_p=True,
        p_scale=448.0,
        attention_kernel="auto",
        lowering="reference",
    )
    halves = [
        torch.ops.fx_fp8.fp8_attention_lse(q, k[:, :, i : i + 64], v[:, :, i : i + 64], None, scale, **kw)
        for i in (0, 64)
    ]
    (o1, l1), (o2, l2) = halves
    lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert float((merged - full).norm() / full.norm()) < 0.08
