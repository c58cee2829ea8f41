"""The `inductor_options` backend option: Inductor config patches for every graph fx_fp8 hands to
Inductor (what torch.compile(backend="inductor", options=...) takes), on top of the mode's."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from fx_fp8.compile.downstream import check_inductor_options, choose_downstream, inductor_patches
from fx_fp8.config.fp8_config import FP8Config
from toy_models import ModulatedBlock


def _code(options: dict) -> str:
    """Inductor's generated code for a small block compiled by fx_fp8 on CPU with `options`."""
    m, x, t = ModulatedBlock().eval(), torch.randn(1, 16, 128), torch.randn(1, 128)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="fp8", options={"diffusion_kv_cache_dtype": None, **options})
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x, t)
        for a, b in zip(out, m(x, t)):
            assert ((a - b).norm() / b.norm()).item() < 0.05  # FP8 linears: quantization error only
    return "\n".join(codes)


def test_the_patches_reach_compile_fx_on_top_of_the_mode(monkeypatch):
    """What fx_fp8 hands Inductor: its compile_fx gets the mode's patches plus inductor_options."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.append(config_patches)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    opts = {
        "diffusion_kv_cache_dtype": None,
        "quantization": None,
        "mode": "max-autotune-no-cudagraphs",
        "inductor_options": {"size_asserts": False},
    }
    torch.compile(torch.nn.Linear(8, 8), backend="fp8", options=opts)(torch.randn(2, 8))
    assert seen == [{**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "size_asserts": False}]


@pytest.mark.slow
def test_the_patches_reach_inductor_and_select_it_as_downstream(downstream_compiles):
    """On CPU the default downstream is eager; inductor_options selects Inductor (as `mode` does), and
    a patch visibly changes the generated code: size_asserts False drops every assert_size_stride."""
    plain = _code({"downstream": "inductor"})
    patched = _code({"inductor_options": {"size_asserts": False}})
    assert downstream_compiles == ["inductor", "inductor"]
    assert re.search(r"assert_size_stride\(", plain)
    assert not re.search(r"assert_size_stride\(", patched)


def test_unknown_settings_and_wrong_types_are_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"unknown Inductor setting 'cpp_wraper' in inductor_options \(did you mean "
        r"'cpp_wrapper'\?\): the settings are torch._inductor.config's keys",
    ):
        check_inductor_options({"cpp_wraper": True})
    with pytest.raises(ValueError, match="inductor_options must be a mapping of Inductor settings to values, got list"):
        check_inductor_options(["cpp_wrapper"])
    assert check_inductor_options(None) == {}
    assert check_inductor_options({"triton.multi_kernel": 1}) == {"triton.multi_kernel": 1}
    m = ModulatedBlock()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown Inductor setting 'no_such_knob'"):  # through torch.compile too
        torch.compile(m, backend="fp8", options={"inductor_options": {"no_such_knob": 1}})(
            torch.randn(1, 16, 128), torch.randn(1, 128)
        )


def test_a_downstream_that_is_not_inductor_is_refused():
    eager = FP8Config.from_kwargs(downstream="eager")
    with pytest.raises(
        ValueError,
        match=r"inductor_options \['cpp_wrapper'\] configure Inductor, but downstream is "
        r"'eager'",
    ):
        choose_downstream(eager, "reference", None, {"cpp_wrapper": True})
    assert choose_downstream(eager, "reference", None, {}) == "eager"
    assert choose_downstream(FP8Config(), "reference", None, {"cpp_wrapper": True}) == "inductor"
    assert choose_downstream(FP8Config(), "reference", None, None) == "eager"


def test_patches_go_on_top_of_the_mode():
    mode = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    assert inductor_patches("max-autotune-no-cudagraphs") == mode
    key = next(iter(mode))
    assert inductor_patches("max-autotune-no-cudagraphs", {key: "mine", "cpp_wrapper": True}) == {
        **mode,
        key: "mine",
        "cpp_wrapper": True,
    }
    assert inductor_patches(None, None) == {}


def _recording_compile_fx(monkeypatch) -> list:
    """compile_fx replaced by one that records its config patches and runs the graph as it is."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.append(config_patches)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    return seen


class _BrokenWithHook(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.a.register_forward_pre_hook(lambda m, args: (args[0] * 2,))  # traced into the graph

    def forward(self, x):
        y = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(y)


def test_every_graph_gets_the_patches_with_dynamic_shapes_a_graph_break_and_a_hook(monkeypatch):
    seen = _recording_compile_fx(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _BrokenWithHook()
    compiled = torch.compile(
        m,
        backend="fp8",
        dynamic=True,
        options={"diffusion_kv_cache_dtype": None, "inductor_options": {"size_asserts": False}},
    )
    counts = []
    with torch.no_grad():
        for tokens in (5, 9):  # the pieces are symbolic in the token count: no recompile
            x = torch.randn(2, tokens, 32)
            assert ((compiled(x) - m(x)).norm() / m(x).norm()).item() < 0.1  # two FP8 linears in a row
            counts.append(len(seen))
    assert counts[0] >= 2 and counts[1] == counts[0], counts  # a graph on each side of the break
    assert seen  # not vacuous: all() of nothing is True
    assert all(p == {"size_asserts": False} for p in seen), seen


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chroma", "ltx-video", "stable-audio3"])
def test_zoo_models_compiled_regionally_with_dynamic_shapes_get_the_patches_in_every_block(name, monkeypatch):
    """Beyond the five families: a zoo model's blocks, each compiled on its own (diffusers'
    compile_repeated_blocks) with dynamic=True, each hand its graph to Inductor with the patches."""
    import diffusers

    from fx_fp8.tools.model_zoo.registry import MODELS, build, make_inputs, output_tensor

    if not hasattr(diffusers, MODELS[name].class_name):
        pytest.skip(f"{MODELS[name].class_name} is not in diffusers {diffusers.__version__}")
    seen = _recording_compile_fx(monkeypatch)
    torch._dynamo.reset()
    model = build(name)
    kw = make_inputs(name, model)
    with torch.no_grad():
        native = output_tensor(model(**kw))
        model.compile_repeated_blocks(
            backend="fp8", dynamic=True, options={"inductor_options": {"size_asserts": False}}
        )
        out = output_tensor(model(**kw))
    assert seen  # not vacuous: all() of nothing is True
    assert seen and all(p == {"size_asserts": False} for p in seen), seen
    assert ((out - native).norm() / native.norm()).item() < 0.05


@pytest.mark.slow
def test_weight_writes_and_two_instances_with_inductor_options(monkeypatch):
    """The model's lifecycle is the downstream's concern as little with inductor_options as without: a weight
    written after compiling is followed, and two instances of one class each run their own weights."""
    seen = _recording_compile_fx(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    opts = {"diffusion_kv_cache_dtype": None, "inductor_options": {"size_asserts": False}}
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    ca, cb = (torch.compile(m, backend="fp8", options=opts) for m in (a, b))
    x = torch.randn(4, 64)

    def close(compiled, module):
        return ((compiled(x) - module(x)).norm() / module(x).norm()).item() < 0.05

    with torch.no_grad():
        assert close(ca, a) and close(cb, b)
        a.weight.data = torch.randn(64, 64)  # written after compiling
        assert close(ca, a) and close(cb, b)
    assert seen  # not vacuous: all() of nothing is True
    assert seen and all(p == {"size_asserts": False} for p in seen), seen
