"""The backend computes what the model computes, except the nodes it reports as rewritten.

Across the diffusers zoo (fx_fp8.tools.model_zoo: every image, video and audio transformer): with both
features off the output is bit-identical to Dynamo's own eager backend; with FP8 on it stays
within 5 % wherever something was rewritten. Plus the graph shapes that broke this once:
in-place side effects whose results are unused, vmap level markers, and the manager's own check.
"""

import pytest
import torch
import torch.fx
import torch.nn as nn

import fx_fp8
from fx_fp8.passes.base import FXPass, compile_contexts
from fx_fp8.passes.manager import PassManager
from fx_fp8.tools.model_zoo import registry as zoo
from graph_capture import Capture, compile_stored

OFF = {"diffusion_kv_cache_dtype": None, "quantization": None}
# in every run: models with in-place side effects (CogVideoX, ConsisID), an audio and a video model
FAST = ["cogvideox", "consisid", "flux2", "stable-audio"]


def rel_err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def check_zoo_model(name):
    model = zoo.build(name)
    kw = zoo.make_inputs(name, model)
    with torch.no_grad():
        torch._dynamo.reset()
        eager = zoo.output_tensor(torch.compile(model, backend="eager")(**kw))
        torch._dynamo.reset()
        passthrough = zoo.output_tensor(torch.compile(model, backend="fp8", options=OFF)(**kw))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fp8")
        fp8 = zoo.output_tensor(compiled(**kw))
    assert torch.equal(passthrough, eager), f"{name}: passthrough differs from backend='eager'"
    reports = fx_fp8.get_reports(compiled)
    rewritten = sum(r.count(None, "quantized") for r in reports)
    if rewritten:
        err = rel_err(fp8, eager)
        assert 1e-6 < err < 0.05, f"{name}: FP8 relative error {err:.3g}"
    else:
        assert torch.equal(fp8, eager)
    # every attention node of every graph has a report row
    assert any(True for r in reports for e in r.entries)  # not vacuous: all() of nothing is True
    assert all(e.node for r in reports for e in r.entries)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_zoo_passthrough_exact_and_fp8_close(name):
    check_zoo_model(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in zoo.MODELS if n not in FAST])
def test_zoo_passthrough_exact_and_fp8_close_all(name):
    check_zoo_model(name)


def test_zoo_is_broad():
    kinds = {e.kind for e in zoo.MODELS.values()}
    assert len(zoo.MODELS) >= 25 and kinds == {"image", "video", "audio"}


class SideEffects(nn.Module):
    """In-place updates whose results are unused, and a vmap: all must survive the passes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.register_buffer("seen", torch.zeros(4, 64))

    def forward(self, x):
        h = self.proj(x)
        self.seen.copy_(h[:, 0].detach())  # copy_: result unused
        h.masked_fill_(h > 3.0, 3.0)  # masked_fill_: result unused
        return torch.vmap(lambda row: row * 2.0)(h) + self.seen.sum()


def test_in_place_side_effects_and_vmap_survive():
    m, x = SideEffects().eval(), torch.randn(4, 16, 64) * 3
    with torch.no_grad():
        torch._dynamo.reset()
        ref = torch.compile(m, backend="eager")(x)
        seen_ref = m.seen.clone()
        m.seen.zero_()
        torch._dynamo.reset()
        out = torch.compile(m, backend="fp8", options=OFF)(x)
    assert torch.equal(out, ref) and torch.equal(m.seen, seen_ref)


class _Sloppy(FXPass):
    """A pass that deletes a node it did not replace."""

    name = "sloppy"

    def run(self, gm):
        victim = next(n for n in gm.graph.nodes if n.op == "call_function" and not n.users)
        gm.graph.erase_node(victim)
        return 0


def test_manager_refuses_a_pass_that_removes_what_it_did_not_replace():
    cap = Capture()
    m, x = SideEffects().eval(), torch.randn(4, 16, 64)
    with torch.no_grad():
        torch.compile(m, backend=cap)(x)
    ((gm, inputs),) = cap.graphs
    assert any(n.op == "call_function" and not n.users for n in gm.graph.nodes)  # the in-place ops
    _, report = compile_stored(gm, inputs, fx_fp8.FP8Config())
    from fx_fp8.ops.lowering import get_lowering
    from fx_fp8.graph.names import LayerMap

    contexts = compile_contexts(gm, inputs, fx_fp8.FP8Config(), get_lowering("reference"), report, LayerMap({}), print)
    with pytest.raises(AssertionError, match="sloppy removed nodes it did not replace"):
        PassManager([_Sloppy]).run(*contexts)
