"""The internals fx_fp8 depends on (fx_fp8/graph/dynamo_internals.py), checked on the installed
torch: a torch release that changes one of them fails here, by name, before it mis-names layers."""

import io
import pathlib
import tokenize

import torch
import torch.nn as nn

from fx_fp8.graph import dynamo_internals as di

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_installed_torch_is_in_the_checked_range():
    assert di.torch_supported(), (
        f"torch {torch.__version__} is outside {di.SUPPORTED_TORCH}: run this file and "
        "tests/graph/test_names.py on it, then widen SUPPORTED_TORCH"
    )
    low, high = di.SUPPORTED_TORCH
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"' in text, (
        "pyproject's torch range and SUPPORTED_TORCH disagree"
    )


def test_dynamo_source_spellings():
    assert di.split_source("L['self'].__dict__['_modules']['transformer_blocks'].0.attn") == (
        "L:self",
        "transformer_blocks.0.attn",
    )
    assert di.split_source("L['self'].transformer_blocks[3].ff") == ("L:self", "transformer_blocks.3.ff")
    assert di.split_source("getattr(L['self'].blocks, '2')") == ("L:self", "blocks.2")


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).relu()


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(x) * 2


def test_compile_time_view_of_the_traced_frame_and_the_compiled_model():
    seen = {}

    def backend(gm, example_inputs):
        params = {id(t) for t in example_inputs if isinstance(t, nn.Parameter)}
        seen["model"], seen["owner"], _ = di.find_compiled_model(params)
        seen["vars"] = di.traced_frame_variables()
        seen["ctx"] = di.current_tracing_context()
        seen["fake"] = di.fake_inputs(seen["ctx"], example_inputs)
        seen["mode"] = di.fake_mode_of(gm.graph)
        return gm.forward

    model = _Outer()
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(2, 4))
    assert seen["model"] is model and seen["owner"] is compiled and di.is_compiled_module(compiled)
    assert seen["vars"].get("L:self") is model  # the frame Dynamo traced, with its real `self`
    assert seen["ctx"] is not None and seen["ctx"].fake_mode is not None
    assert all(type(t).__name__ == "FakeTensor" for t in seen["fake"] if isinstance(t, torch.Tensor))
    assert seen["mode"] is not None  # the fake mode of the nodes' recorded values
    with di.compiling_under(seen["ctx"]):
        assert torch._guards.TracingContext.try_get() is seen["ctx"]


def test_runtime_instance_finds_the_running_module():
    model = _Outer()
    names = {id(m): n for n, m in model.named_modules()}
    found = []
    original = _Inner.forward

    def spy(self, x):
        found.append(_lookup(names))
        return original(self, x)

    _Inner.forward = spy
    try:
        model(torch.randn(1, 4))
    finally:
        _Inner.forward = original
    assert found == ["inner"]


def _lookup(names):
    return di.runtime_instance(names)  # two frames up from runtime_instance: spy's caller chain


def test_function_copy_has_its_own_identity_and_behaviour():
    def f(x, *, k=2):
        return x * k

    g = di.function_copy(f)
    assert g is not f and g.__code__ is not f.__code__ and g(3) == f(3) == 6 and g(3, k=3) == 9


def test_a_trace_on_the_private_forward_code_leaves_the_class_code_without_cache_entries():
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    assert di.isolated_compile_kwargs() == ({"isolate_recompiles": True} if di.torch_version() >= (2, 13) else {})
    model, seen = _Outer(), []
    with di.forward_on_private_code(model):
        assert "forward" in vars(model)
        torch.compile(model, backend=lambda gm, _: seen.append(gm) or gm.forward, **di.isolated_compile_kwargs())(
            torch.randn(2, 4)
        )
    assert "forward" not in vars(model) and len(seen) == 1  # traced, then the class's forward again
    assert _debug_get_cache_entry_list(_Outer.forward.__code__) == []


def test_no_other_module_reads_frames_or_dynamo_internals():
    """The one-place rule, checked on the source: frame walks, the traced-frame API, tracing
    contexts, fake-tensor classes and code-object copies appear only in dynamo_internals.py."""
    forbidden = (
        "_getframe",
        "f_locals",
        "f_back",
        "current_tx",
        "InstructionTranslator",
        "TracingContext",
        "torch._guards",
        "_subclasses.fake_tensor",
        "OptimizedModule",
        "__code__",
    )
    offenders = []
    for path in list((ROOT / "fx_fp8").rglob("*.py")) + list((ROOT / "passes").rglob("*.py")):
        if path.name == "dynamo_internals.py":
            continue
        code = _code_only(path.read_text())
        offenders += [f"{path.relative_to(ROOT)}: {token}" for token in forbidden if token in code]
    assert not offenders, offenders


def _code_only(source: str) -> str:
    """The source's tokens without comments and string literals (docstrings), joined."""
    skip = (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return " ".join(t.string for t in tokens if t.type not in skip).replace(" . ", ".")
