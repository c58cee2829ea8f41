"""Names belong to the model, not to the graph piece: module names, layer indices and the
sensitive-layer defaults resolve to the model's own named_modules() whatever wraps it
(graph breaks, diffusers hooks); what cannot be resolved is said, never silently ignored."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8.graph.dynamo_internals import split_source
from fx_fp8.graph.names import normalize_module_path
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

LAYERS = {
    "transformer_blocks.0.attn": 0,
    "transformer_blocks.1.attn": 1,
    "single_transformer_blocks.0.attn": 2,
    "single_transformer_blocks.1.attn": 3,
}


@pytest.fixture
def fp8_attention_calls(monkeypatch):
    """How many attention calls actually ran in FP8 (the reference lowering's kernel)."""
    from fx_fp8.ops.reference import ReferenceLowering

    calls = []
    real = ReferenceLowering.attention

    def spy(self, q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(self, q, *args, **kwargs)

    monkeypatch.setattr(ReferenceLowering, "attention", spy)
    return calls


def flux():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux")
    return model, example_inputs("flux", model)


def attention_rows(compiled):
    return {e.module: e for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == "attention"}


def linear_rows(compiled):
    return {e.module: e for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == "linear"}


def check_model_names(compiled, skipped):
    rows = attention_rows(compiled)
    assert {m: e.layer for m, e in rows.items()} == LAYERS and all(e.name_resolved for e in rows.values())
    assert {m for m, e in rows.items() if e.action == "native"} == {m for m, i in LAYERS.items() if i in skipped}
    lin = linear_rows(compiled)
    # the sensitive defaults find the model's conditioning and final layers, whatever piece they
    # were compiled in (layers Dynamo runs eagerly between pieces have no row)
    sensitive = [
        n
        for n in (
            "proj_out",
            "norm_out.linear",
            "x_embedder",
            "context_embedder",
            "time_text_embed.timestep_embedder.linear_1",
            "transformer_blocks.1.norm1.linear",
        )
        if n in lin
    ]
    assert "norm_out.linear" in sensitive and "transformer_blocks.1.norm1.linear" in sensitive
    for name in sensitive:  # weight-only by default (native where too small or not a multiple of 16)
        assert (
            lin[name].action in ("weight-only", "native")
            and "sensitive" in lin[name].reason
            or "multiples of 16" in lin[name].reason
            or "small layer" in lin[name].reason
        ), (name, lin[name].reason)
    assert lin["norm_out.linear"].action == "weight-only"
    assert lin["transformer_blocks.1.attn.to_q"].action == "fp8"
    assert all(e.name_resolved for e in lin.values())


def test_split_source_spellings():
    assert split_source("L['self'].__dict__['_modules']['transformer_blocks'].0.attn") == (
        "L:self",
        "transformer_blocks.0.attn",
    )
    assert split_source("L['s'].m.blocks[0].to_qkv") == ("L:s", "m.blocks.0.to_qkv")
    assert split_source("G['orig'].__self__.attn") == ("G:orig", "__self__.attn")
    assert normalize_module_path("getattr(L['self'].blocks, '3').attn") == "blocks.3.attn"


@pytest.mark.slow
def test_graph_break_inside_a_block_keeps_layer_numbers(fp8_attention_calls):
    model, kw = flux()
    block = model.transformer_blocks[1]
    original = block.forward

    def forward_with_break(*args, **kwargs):
        torch._dynamo.graph_break()
        return original(*args, **kwargs)

    block.forward = forward_with_break
    compiled = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_layers": "1,3"})
    with torch.no_grad():
        compiled(**kw)
    assert len(fx_fp8.get_reports(compiled)) > 2  # the break split the model into pieces
    check_model_names(compiled, skipped={1, 3})
    assert len(fp8_attention_calls) == 2  # what ran: layers 0 and 2 in FP8, 1 and 3 native


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["first_block_cache", "taylorseer"])
def test_cache_hooks_keep_model_names(hook, fp8_attention_calls):
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    model, kw = flux()
    config = FirstBlockCacheConfig(threshold=0.2) if hook == "first_block_cache" else TaylorSeerCacheConfig()
    model.enable_cache(config)
    compiled = torch.compile(model, backend="fp8", options={"diffusion_kv_cache_skip_layers": "1"})
    with torch.no_grad(), model.cache_context("cond"):
        compiled(**kw)
    check_model_names(compiled, skipped={1})
    # Dynamo runs one graph for every block of a class here; each block ran its own decisions
    assert len(fp8_attention_calls) == 3


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 192) for _ in range(2)])


def attend(blocks, x):
    """A compiled *function* handed a module list: no model on the stack to name things by."""
    for lin in blocks:
        q, k, v = lin(x).view(1, -1, 3, 2, 32).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, -1, 64)
    return x


def test_unresolvable_layers_are_said_not_guessed():
    blocks, x = Blocks().blocks, torch.randn(1, 32, 64)
    compiled = torch.compile(attend, backend="fp8", options={"diffusion_kv_cache_skip_layers": "0"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(blocks, x)
    (report,) = fx_fp8.get_reports()[-1:]
    rows = [e for e in report.entries if e.op == "attention"]
    assert len(rows) == 2 and all(not e.name_resolved and e.action == "native" for e in rows)
    assert all("layer unknown" in e.reason and "kept native rather than guessing" in e.reason for e in rows)
    msgs = [str(i.message) for i in w if "cannot be applied" in str(i.message)]
    assert len(msgs) == 1 and "2 attention node(s)" in msgs[0]
    # without a layer selector the same attention is simply FP8
    torch._dynamo.reset()
    plain = torch.compile(attend, backend="fp8")
    with torch.no_grad():
        plain(blocks, x)
    assert [e.action for e in fx_fp8.get_reports()[-1].entries if e.op == "attention"] == ["fp8", "fp8"]
