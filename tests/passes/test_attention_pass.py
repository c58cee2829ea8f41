"""FP8AttentionPass: which SDPA nodes are rewritten, which stay native and why, on all five families."""

import warnings

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.ops.lowering import get_lowering
from fx_fp8.passes.base import compile_contexts
from fx_fp8.passes.attention import FP8AttentionPass
from fx_fp8.graph.forms import is_attention
from fx_fp8.graph.fx_utils import meta_val
from fx_fp8.graph.names import LayerMap, module_name
from fx_fp8.report import CompileReport
from graph_capture import Capture, compile_stored

ATTENTION_ONLY = {"diffusion_kv_cache_dtype": "fp8"}  # linears off: isolate the attention pass


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _family_run(family):
    """Native compile (counting backend) and fp8 compile (fullgraph) of one tiny model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer(family)
    kw = example_inputs(family, model)
    cap = Capture()
    fullgraph = True
    torch._dynamo.reset()
    with torch.no_grad():
        # diffusers' Z-Image builds a RoPE cache on its first call under a `device`
        # context manager Dynamo cannot trace: warm it up eagerly.
        model(**kw)
        native = output_tensor(torch.compile(model, backend=cap, fullgraph=fullgraph)(**kw))
        torch._dynamo.reset()
        fx_fp8.clear_reports()
        out = output_tensor(torch.compile(model, backend="fp8", fullgraph=fullgraph, options=ATTENTION_ONLY)(**kw))
    nodes = cap.sdpa_nodes()
    cross = [
        n
        for n in nodes
        if meta_val(n.kwargs.get("key", n.args[1] if len(n.args) > 1 else None)).shape[2]
        != meta_val(n.kwargs.get("query", n.args[0] if n.args else None)).shape[2]
    ]
    reports = fx_fp8.get_reports()
    assert len(reports) == len(cap.graphs) and (len(reports) == 1 or not fullgraph)
    entries = [e for r in reports for e in r.entries]
    return dict(
        model=model,
        kw=kw,
        native=native,
        out=out,
        reports=reports,
        entries=entries,
        nodes=nodes,
        cross=cross,
        graph=max(cap.graphs, key=lambda g: sum(map(is_attention, g[0].graph.nodes))),
    )


def count(entries, op, action=None):
    return sum(1 for e in entries if e.op == op and (action is None or e.action == action))


_RUNS = {}


def get_run(family):
    """One native + one fp8 compile per family, shared by the tests of this file."""
    if family not in _RUNS:
        _RUNS[family] = _family_run(family)
        torch._dynamo.reset()  # leave no cache or report behind for the calling test
        fx_fp8.clear_reports()
    return _RUNS[family]


@pytest.fixture
def run(family):
    return get_run(family)


def test_every_self_attention_rewritten(run, family):
    entries = run["entries"]
    assert len(run["nodes"]) >= 2
    expected_fp8 = len(run["nodes"]) - len(run["cross"])
    assert count(entries, "attention", "fp8") == expected_fp8
    assert count(entries, "attention") == len(run["nodes"])
    assert count(entries, "linear", "fp8") == 0 and count(entries, "linear") > 0  # linears were off
    if family == "wan":
        assert len(run["cross"]) == 2  # attn2 of each block
    else:
        assert not run["cross"]


def test_cross_attention_stays_native_with_reason(run, family):
    native = [e for e in run["entries"] if e.op == "attention" and e.action == "native"]
    assert len(native) == len(run["cross"])
    for e in native:
        assert e.module.endswith("attn2") and e.reason.startswith("cross-attention"), e


def test_output_close_but_quantized(run):
    err = rel_err(run["out"], run["native"])
    assert 1e-4 < err < 0.05, err


def test_report_entries_describe_fp8(run):
    for e in run["entries"]:
        if e.op == "attention" and e.action == "fp8":
            assert e.reason.startswith("reference: block scales") and "Hadamard" in e.reason
            assert e.layer is not None and e.shapes.count("x") == 9  # three 4-D shapes


def test_cross_attention_opt_in():
    run = get_run("wan")
    gm, inputs = run["graph"]
    cfg = FP8Config.from_kwargs(diffusion_kv_cache_dtype="fp8", attention={"cross_attention": True})
    _, report = compile_stored(gm, inputs, cfg)
    assert report.count("attention", "fp8") == len(run["nodes"]) == 4


def test_skip_layers_flux():
    run = get_run("flux")
    # Flux tiny: 2 double blocks (layers 0-1), then 2 single blocks (layers 2-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux")
    kw = example_inputs("flux", model)
    with torch.no_grad():
        out = output_tensor(
            torch.compile(model, backend="fp8", options={**ATTENTION_ONLY, "diffusion_kv_cache_skip_layers": "0-2"})(
                **kw
            )
        )
    (report,) = fx_fp8.get_reports()
    assert report.layer_map == {"transformer_blocks": "0-1", "single_transformer_blocks": "2-3"}
    att = {e.module: e for e in report.entries if e.op == "attention"}
    assert {m: e.layer for m, e in att.items()} == {
        "transformer_blocks.0.attn": 0,
        "transformer_blocks.1.attn": 1,
        "single_transformer_blocks.0.attn": 2,
        "single_transformer_blocks.1.attn": 3,
    }
    native = sorted(m for m, e in att.items() if e.action == "native")
    assert native == ["single_transformer_blocks.0.attn", "transformer_blocks.0.attn", "transformer_blocks.1.attn"]
    for m in native:
        assert "diffusion_kv_cache_skip_layers" in att[m].reason
    assert att["single_transformer_blocks.1.attn"].action == "fp8"
    # one fp8 layer left: closer to native than all four quantized
    assert rel_err(out, run["native"]) < rel_err(run["out"], run["native"])


def test_skip_layers_beyond_model_warns():
    run = get_run("flux")
    gm, inputs = run["graph"]
    cfg = FP8Config.from_kwargs(diffusion_kv_cache_dtype="fp8", diffusion_kv_cache_skip_layers="1,7-9")
    with pytest.warns(UserWarning, match=r"diffusion_kv_cache_skip_layers names layers 7-9 but the model has 4 layers"):
        compile_stored(gm, inputs, cfg)


# -- unsupported calls ---------------------------------------------------------
class _Call(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kw)


class _Variants(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = _Call()
        self.dropout = _Call(dropout_p=0.1)
        self.causal = _Call(is_causal=True)
        self.gqa = _Call(enable_gqa=True)
        self.scaled = _Call(scale=0.3)

    def forward(self, q, kv1):
        a = self.plain(q, q, q) + self.dropout(q, q, q) + self.causal(q, q, q) + self.scaled(q, q, q)
        b = self.gqa(q, kv1, kv1)
        flat = F.scaled_dot_product_attention(q[0], q[0], q[0])  # 3-D call at the root
        return a + b + flat


def test_unsupported_calls_stay_native_with_reason():
    q, kv1 = torch.randn(1, 4, 32, 32), torch.randn(1, 2, 32, 32)
    torch.compile(_Variants(), backend="fp8", options=ATTENTION_ONLY)(q, kv1)
    (report,) = fx_fp8.get_reports()
    got = {e.module: (e.action, e.reason) for e in report.entries if e.op == "attention"}
    assert got["plain"][0] == "fp8" and got["scaled"][0] == "fp8"
    assert got["dropout"] == (
        "native",
        "dropout_p=0.1 (FP8 attention is inference-only); run the model in eval mode "
        "(model.eval(): no attention dropout)",
    )
    assert got["causal"] == (
        "native",
        "is_causal=True not supported by the FP8 kernels; nothing to set: the FP8 "
        "kernels cannot take this call, it stays native",
    )
    assert got["gqa"][0] == "native" and "grouped-query attention (4 query heads, 2 kv heads)" in got["gqa"][1]
    assert got[""][0] == "native" and "expected 4-D" in got[""][1]


def test_explicit_scale_is_kept():
    q = torch.randn(1, 2, 64, 32)
    m = _Call(scale=0.05)
    out = torch.compile(m, backend="fp8", options=ATTENTION_ONLY)(q, q, q)
    assert rel_err(out, m(q, q, q)) < 0.05  # a default 1/sqrt(d) scale would be far off
    assert rel_err(out, F.scaled_dot_product_attention(q, q, q)) > 0.1


def _pass_on_mask(mask_val):
    """Run the attention pass on a hand-built graph whose mask has the given metadata
    (such masks are refused by SDPA itself, so Dynamo never produces them)."""

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    gm = torch.fx.symbolic_trace(f)
    q = torch.randn(1, 2, 16, 32)
    for node, val in zip([n for n in gm.graph.nodes if n.op == "placeholder"], [q, q, q, mask_val]):
        node.meta["val"] = val
    inputs, out = compile_contexts(
        gm,
        [q, q, q, mask_val],
        FP8Config(quantization=None),
        get_lowering("reference"),
        CompileReport("fp8", "reference", "eager", None),
        LayerMap({}),
        warnings.warn,
    )
    changed = FP8AttentionPass(inputs, out).run(gm)
    (entry,) = out.report.entries
    return changed, entry


@pytest.mark.parametrize(
    "mask, needle",
    [
        (torch.zeros(2, 2, 16, 16), "attention mask of shape (2, 2, 16, 16) not broadcastable"),
        (torch.zeros(1, 1, 1, 2, 16, 16), "attention mask of shape (1, 1, 1, 2, 16, 16)"),
        (torch.zeros(16, 16, dtype=torch.int32), "attention mask dtype torch.int32 not supported"),
    ],
)
def test_unsupported_mask_stays_native(mask, needle):
    changed, entry = _pass_on_mask(mask)
    assert changed == 0 and entry.action == "native" and needle in entry.reason, entry.reason


@pytest.mark.parametrize(
    "mask", [torch.ones(1, 1, 1, 16, dtype=torch.bool), torch.zeros(16, 16), torch.zeros(2, 1, 16)]
)
def test_broadcastable_masks_rewritten(mask):
    changed, entry = _pass_on_mask(mask)
    assert changed == 1 and entry.action == "fp8"


class _NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return torch.relu(self.conv(x)).mean(dim=(2, 3))


def test_no_sdpa_no_linear_zero_rewrites():
    m, x = _NoAttention(), torch.randn(2, 3, 8, 8)
    compiled = torch.compile(m, backend="fp8")
    out = compiled(x)
    (report,) = fx_fp8.get_reports(compiled)
    assert report.entries == [] and report.summary() == {
        "attention": {"fp8": 0, "native": 0},
        "linear": {"fp8": 0, "native": 0},
    }
    torch.testing.assert_close(out, m(x))


def test_layer_map_and_module_names_on_graph(run, family):
    names = {module_name(n) for n in run["nodes"]}
    model_names = dict(run["model"].named_modules())
    assert names <= set(model_names), names - set(model_names)
    # every attention module belongs to a layer, and the layers are numbered 0..N-1 without gaps
    layers = sorted(e.layer for e in run["entries"] if e.op == "attention")
    assert None not in layers and sorted(set(layers)) == list(range(len(set(layers))))
