"""The one place fx_fp8 reads Python frames or PyTorch internals that carry no stability promise.

Everything here depends on how this torch release's Dynamo spells sources, keeps the frame it
traces, and hands fake tensors to backends. tests/graph/test_dynamo_internals.py checks each piece on
the installed torch; SUPPORTED_TORCH is the range those checks have passed on. Outside it the
backend still runs, but names may go unresolved (the report then says so, node by node).

- Dynamo's source spelling (`L['self'].transformer_blocks[0].attn`) -> a module path;
- the frame being traced (`InstructionTranslator.current_tx()`) and its real variables;
- the compiled model on the Python stack (`OptimizedModule`), at compile time only;
- the module running a graph that reads no parameter (a stack walk, at run time);
- Dynamo's tracing context (fake mode, shape env), so a graph compiled after the backend
  returned is keyed by the compile caches as one compiled inside Dynamo;
- graph modules whose Python code is generated only when something calls them (torch.fx's
  private lazy graph module: Inductor reads the graph, never the code);
- a copy of a method's code object under a new name (diffusers' cache hooks look hooks up by
  function identity), and a model's forward run on such a copy for a one-off trace (Dynamo keeps
  its cache entries per code object);
- torch.compile's `isolate_recompiles` (a one-off trace's entries count against no other compile's
  recompile limit).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import types
from typing import Any, Optional

import torch
import torch.nn as nn

#: (oldest, newest) torch minor releases these internals were checked on
SUPPORTED_TORCH = ((2, 11), (2, 15))

_ROOT = re.compile(r"^([LG])\[['\"]([^'\"]*)['\"]\]")
_DICT_MODULES = re.compile(r"\.__dict__\[['\"]_modules['\"]\]\[['\"]([^'\"]+)['\"]\]")
_MODULES = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
_ITEM_STR = re.compile(r"\[['\"]([^'\"]+)['\"]\]")
_ITEM_INT = re.compile(r"\[(\d+)\]")
_GETATTR = re.compile(r"getattr\((.*), ['\"]([^'\"]+)['\"]\)")


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_supported() -> bool:
    return SUPPORTED_TORCH[0] <= torch_version() <= SUPPORTED_TORCH[1]


# -- Dynamo's source spelling ------------------------------------------------------------------
def split_source(source: str) -> tuple[Optional[str], str]:
    """Dynamo's source spelling -> (root variable or None, dotted path from it).

    `L['self'].__dict__['_modules']['transformer_blocks'].0.attn` -> ('L:self', 'transformer_blocks.0.attn')
    `L['s'].m.blocks[0].to_qkv` -> ('L:s', 'm.blocks.0.to_qkv');  `G['orig'].__self__.attn` -> ('G:orig', '__self__.attn')
    """
    s = source
    while True:  # getattr(x, 'a') -> x.a, innermost first
        new = _GETATTR.sub(lambda m: f"{m.group(1)}.{m.group(2)}", s)
        if new == s:
            break
        s = new
    local = None
    m = _ROOT.match(s)
    if m:
        local = f"{m.group(1)}:{m.group(2)}"
        s = s[m.end() :]
    s = _DICT_MODULES.sub(r".\1", s)
    s = _MODULES.sub(r".\1", s)
    s = _ITEM_STR.sub(r".\1", s)
    s = _ITEM_INT.sub(r".\1", s)
    return local, s.strip(".")


# -- frames --------------------------------------------------------------------------------------
def is_compiled_module(obj) -> bool:
    """Is obj what `torch.compile(module)` returns?"""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(obj, OptimizedModule)


def find_compiled_model(param_ids: set[int]) -> tuple[Optional[nn.Module], Optional[Any], Optional[nn.Module]]:
    """(model, owner, caller) for the graph being compiled now, from the Python stack.

    model: the nn.Module whose names the passes use. owner: the object that
    owns this compile's reports and warnings (the OptimizedModule of
    `torch.compile(model)`, else the model itself). caller: the innermost module
    whose call led to the traced frame (a hook's forward is called by the module
    it replaced). None where there is none (a compiled function).
    """
    frame = sys._getframe(1)
    outermost = caller = None
    while frame is not None:
        obj = frame.f_locals.get("self")
        if is_compiled_module(obj):
            return obj._orig_mod, obj, caller
        if isinstance(obj, nn.Module) and (not param_ids or _owns_any(obj, param_ids)):
            outermost = obj
        if caller is None and isinstance(obj, nn.Module):
            caller = obj
        frame = frame.f_back
    return outermost, outermost, caller


def _owns_any(module: nn.Module, param_ids: set[int]) -> bool:
    return any(id(p) in param_ids for p in module.parameters())


def traced_frame_variables() -> dict:
    """The real variables of the frame Dynamo is compiling now, keyed as split_source names
    them ('L:self', 'G:orig'); {} outside Dynamo."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # private API: a torch without it only loses name resolution, loudly (see resolve_names)
        return {}
    if tx is None:
        return {}
    scope = {f"G:{k}": v for k, v in (getattr(tx, "f_globals", None) or {}).items()}
    scope.update({f"L:{k}": v for k, v in (getattr(tx, "f_locals", None) or {}).items()})
    return scope


def runtime_instance(module_name_of: dict[int, str]) -> Optional[str]:
    """At run time: the model's name of the innermost module on the Python stack (the instance
    whose forward is running the compiled graph), or None. Only for a graph that reads no
    parameter (the backend knows the others by their parameters, without a stack walk)."""
    frame = sys._getframe(2)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module):
            name = module_name_of.get(id(obj))
            if name is not None:
                return name
        frame = frame.f_back
    return None


# -- Dynamo's tracing context -----------------------------------------------------------------------
def unwrap_compiled(obj):
    """The module a torch.compile'd module wraps (its `_orig_mod`), else `obj` itself."""
    return getattr(obj, "_orig_mod", obj)


def current_tracing_context():
    """Dynamo's tracing context of the graph being compiled now (None outside Dynamo)."""
    return torch._guards.TracingContext.try_get()


def fake_inputs(tracing_context, example_inputs) -> Optional[list]:
    """The graph's inputs as the tracing context's fake tensors (no memory held), or None."""
    fake_mode = getattr(tracing_context, "fake_mode", None)
    if fake_mode is None:
        return None
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


def compiling_under(tracing_context):
    """Enter a tracing context captured at backend-call time (a no-op without one): a graph
    compiled later, on its first call, is then keyed by Inductor's caches as Dynamo's own."""
    if tracing_context is None:
        return contextlib.nullcontext()
    return torch._guards.tracing(tracing_context)


def is_fake_tensor(t) -> bool:
    """Whether `t` is one of Dynamo's fake tensors (a shape and dtype, no values to read)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_mode_of(graph: torch.fx.Graph):
    """The fake mode of the fake values Dynamo recorded on a graph's nodes, or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    return next(
        (v.fake_mode for n in graph.nodes for v in [n.meta.get("example_value")] if isinstance(v, FakeTensor)), None
    )


# -- graph modules ---------------------------------------------------------------------------------
def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule of `graph` sharing root's submodules and constants, whose code is generated
    on its first call, if ever (recompile() only marks it stale)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module

    return _make_graph_module(root, graph, graph_module_cls=_LazyGraphModule)


def generate_code_now(gm: torch.fx.GraphModule) -> None:
    """Generate a lazy graph module's code now, so its calls do not check for it each time."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)


# -- code objects ------------------------------------------------------------------------------------
def function_copy(func: types.FunctionType) -> types.FunctionType:
    """A new function object running func's code: equal behaviour, a different identity."""
    code = func.__code__.replace(co_name=func.__code__.co_name)
    new = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    new.__kwdefaults__ = copy.copy(func.__kwdefaults__)
    new.__qualname__ = func.__qualname__
    new.__dict__.update(func.__dict__)
    return new


def method_copy(bound) -> Any:
    """A copy of a bound method whose function has its own code object: Dynamo keeps compiled code
    per code object and would otherwise reuse one block's graph (its layer decisions baked in) for
    every block of the same class."""
    func = getattr(bound, "__func__", None)
    if func is None or not isinstance(func, types.FunctionType):
        return bound
    new = function_copy(func)
    return types.MethodType(new, bound.__self__)


@contextlib.contextmanager
def forward_on_private_code(model: nn.Module):
    """For the duration, `model.forward` runs a private copy of its class's forward code.

    Dynamo keeps its cache entries on the code object of the frame it compiles, and stops
    compiling a code object that holds `recompile_limit` (8) entries. A one-off trace (a fresh
    backend each time) adds an entry that never matches again: on the class's own forward, the
    9th trace of a model of that class would run eagerly, untraced, and the entries of every
    compile of that class count towards the same limit. On the copy, the entries die with it.
    A forward already replaced on the instance (diffusers hooks) is traced as it is."""
    forward = getattr(type(model), "forward", None)
    if "forward" in vars(model) or not isinstance(forward, types.FunctionType):
        yield
        return
    model.forward = method_copy(model.forward)
    try:
        yield
    finally:
        vars(model).pop("forward", None)


def isolated_compile_kwargs() -> dict:
    """torch.compile keywords that keep a one-off compile's cache entries in a region of their
    own (torch >= 2.13): they count against no other compile's recompile limit, for the frames a
    graph break hands to Dynamo afresh (a block's forward) as well. {} on a torch without it."""
    import inspect

    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
