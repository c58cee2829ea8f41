"""The compiler a rewritten graph goes to: its choice and the call (eager, Inductor, npugraph_ex)."""

from __future__ import annotations

import contextlib
import types
import typing
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.values import did_you_mean, short_repr
from fx_fp8.graph.dynamo_internals import generate_code_now
from fx_fp8.ops.lowering import npu_available


def check_inductor_options(value: Any) -> dict:
    """The `inductor_options` backend option: Inductor config patches ({"cpp_wrapper": True,
    "triton.multi_kernel": 1, ...}: what torch.compile(backend="inductor", options=...) takes) for
    every graph fx_fp8 hands to Inductor. Every key must name an Inductor setting."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"inductor_options must be a mapping of Inductor settings to values, got "
            f"{type(value).__name__} {short_repr(value)}"
        )
    import torch._inductor.config as inductor_config

    known = set(inductor_config._config)
    for key, setting in value.items():
        if not isinstance(key, str) or key not in known:
            raise ValueError(
                f"unknown Inductor setting {short_repr(key)} in inductor_options{did_you_mean(str(key), sorted(known))}:"
                " the settings are torch._inductor.config's keys"
            )
        expected = inductor_config.get_type(key)
        if not _of_type(setting, expected):
            why = " (Inductor would read any other value by its truth: 'no' turns it on)" if expected is bool else ""
            raise ValueError(
                f"invalid inductor_options {key!r} {short_repr(setting)} ({type(setting).__name__}): expected "
                f"{_type_name(expected)}, the type of torch._inductor.config.{key}{why}"
            )
    return dict(value)


def _of_type(value, expected) -> bool:
    """Whether `value` fits the annotated type of an Inductor setting: a class (an int for a float
    too), a union of them, a Literal's values, a generic's container class. What cannot be checked
    (a string annotation, a setting whose default is None and has no annotation) passes."""
    if expected is None or expected is type(None) or expected is Any or isinstance(expected, str):
        return True
    origin = typing.get_origin(expected)
    if origin is typing.Literal:
        return any(value == v and type(value) is type(v) for v in typing.get_args(expected))
    if origin is typing.Union or origin is types.UnionType:
        return any(_of_type(value, t) if t is not type(None) else value is None for t in typing.get_args(expected))
    if origin is not None:
        return not isinstance(origin, type) or isinstance(value, origin)
    if not isinstance(expected, type):
        return True
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int and isinstance(value, bool):
        return False  # True is no thread count
    return isinstance(value, expected)


def _type_name(expected) -> str:
    origin = typing.get_origin(expected)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(expected))
    if origin is typing.Union or origin is types.UnionType:  # Optional[int] (older torch) and int | None alike
        return " | ".join("None" if t is type(None) else _type_name(t) for t in typing.get_args(expected))
    return getattr(expected, "__name__", None) or str(expected)


def inductor_patches(mode: Optional[str], inductor_options: Optional[Mapping] = None) -> dict:
    """Inductor's config patches: the mode's (torch._inductor.list_mode_options), then inductor_options."""
    patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    patches.update(inductor_options or {})
    return patches


def check_downstream_takes(config: FP8Config, inductor_options: Optional[Mapping]) -> None:
    """inductor_options need the Inductor downstream ("auto" becomes it)."""
    if inductor_options and config.downstream not in ("auto", "inductor"):
        raise ValueError(
            f"inductor_options {sorted(inductor_options)} configure Inductor, but downstream is "
            f"{config.downstream!r}: use downstream 'inductor' (or 'auto') or drop inductor_options"
        )


def choose_downstream(
    config: FP8Config, lowering: str, mode: Optional[str], inductor_options: Optional[Mapping] = None
) -> str:
    check_downstream_takes(config, inductor_options)
    if config.downstream != "auto":
        return config.downstream
    if mode or inductor_options:
        return "inductor"
    if lowering == "npu" and npu_available():
        return "npugraph_ex"
    if lowering == "cuda":
        return "inductor"
    return "eager"


def compile_downstream(
    name: str, gm: torch.fx.GraphModule, example_inputs, mode: Optional[str], inductor_options: Optional[Mapping] = None
) -> Callable:
    if name == "eager":
        generate_code_now(gm)  # now, not on every call
        return gm.forward
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = inductor_patches(mode, inductor_options)
        with _inputs_from_examples(gm, patches):
            return compile_fx(gm, example_inputs, config_patches=patches)
    if name == "npugraph_ex":
        try:
            backend = torch._dynamo.lookup_backend("npugraph_ex")
        except Exception as e:
            from fx_fp8.install_hint import install_hint

            raise RuntimeError(f"downstream 'npugraph_ex' needs torch_npu ({install_hint('npu')}): {e}") from None
        return backend(gm, example_inputs)
    raise ValueError(f"unknown downstream compiler {name!r}")


@contextlib.contextmanager
def _inputs_from_examples(gm: torch.fx.GraphModule, patches: Mapping):
    """With a C++ (or FX) wrapper, Inductor reads its inputs from the placeholders' meta["val"] as
    for an exported graph, where any placeholder has one, and None for those without: Dynamo's
    placeholders have none, the quantized weights fx_fp8 appends do, so the model's own inputs
    became None ("'NoneType' object has no attribute 'shape'"). Hidden while Inductor compiles, no
    placeholder has one and Inductor takes the example inputs, as for a graph straight from Dynamo."""
    import torch._inductor.config as inductor_config

    wrapper = any(patches.get(k, getattr(inductor_config, k)) for k in ("cpp_wrapper", "fx_wrapper"))
    hidden = {
        node: node.meta.pop("val") for node in gm.graph.find_nodes(op="placeholder") if wrapper and "val" in node.meta
    }
    try:
        yield
    finally:
        for node, val in hidden.items():
            node.meta["val"] = val
