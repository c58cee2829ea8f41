"""Reading shapes and scalars of a traced graph without specialising them.

A Dynamo backend sees FakeTensors whose sizes may be symbolic (`SymInt`).
`int()`, `bool()`, `==` or `<` on such a size adds a guard: Dynamo then
recompiles the model for every new resolution. Every decision fx_fp8 takes at
compile time goes through these helpers, which only answer what is known
statically and never add a guard. Python floats that Dynamo lifts into graph
inputs (`dropout_p`, `scale` under `dynamic=True`) are read by `scalar_value`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import guard_float, is_concrete_int, statically_known_true

Size = Union[int, torch.SymInt]


def concrete(x) -> Optional[int]:
    """The Python int of a size when it is a constant, else None (never guards)."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt) and is_concrete_int(x):
        return int(x)  # a constant SymInt: int() adds no guard
    return None


def token_count(x) -> Optional[int]:
    """A linear input's rows (the product of every dimension but the last: the M of its matmul),
    or None when one of them is symbolic (never guards)."""
    m = 1
    for s in x.shape[:-1]:
        s = concrete(s)
        if s is None:
            return None
        m *= s
    return m


def known_equal(a: Size, b: Size) -> bool:
    """True only when a == b holds for every value of the symbols (no guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def known_true(condition) -> bool:
    """True only when a (possibly symbolic) condition holds for every value of the symbols (no guard)."""
    return condition if isinstance(condition, bool) else bool(statically_known_true(condition))


def known_one(a: Size) -> bool:
    return known_equal(a, 1)


def known_at_least(a: Size, n: int) -> bool:
    if isinstance(a, int):
        return a >= n
    return bool(statically_known_true(a >= n))


def broadcasts_to(shape, target) -> bool:
    """Does `shape` broadcast to `target` for every value of the symbols?"""
    if len(shape) > len(target):
        return False
    shape = (1,) * (len(target) - len(shape)) + tuple(shape)
    return all(known_one(a) or known_equal(a, b) for a, b in zip(shape, target))


def size_str(d) -> str:
    """'128' for a constant, the symbol ('s0') or its expression ('(s0+s1)') otherwise."""
    c = concrete(d)
    if c is not None:
        return str(c)
    text = str(d).replace(" ", "")
    return text if text.isidentifier() else f"({text})"


def shape_str(*vals) -> str:
    """'1x24x4608x128 ...' for tensors ('-' for anything else); symbolic sizes as symbols."""
    return " ".join("x".join(size_str(d) for d in v.shape) if isinstance(v, torch.Tensor) else "-" for v in vals)


def scalar_value(arg, default=None):
    """The Python value of a scalar call argument.

    Under dynamic shapes Dynamo lifts float attributes and defaults (dropout_p,
    scale) into graph inputs: the argument is then a node whose fake value is a
    SymFloat. Its value is read with a guard on that value (the graph is reused
    while it stays the same, recompiled if it ever changes, which for these
    model constants is never): never `float(node)`.
    Returns `default` for None and raises TypeError when the value is unknown.
    """
    if arg is None:
        return default
    if isinstance(arg, torch.fx.Node):
        val = arg.meta.get("val", arg.meta.get("example_value"))
        if isinstance(val, torch.SymFloat):
            return guard_float(val)
        if isinstance(val, torch.SymBool):
            return bool(val)  # guards: a bool flag of a call is a model constant
        if isinstance(val, (int, float, bool)):
            return val
        raise TypeError(f"scalar argument {arg.name} has no known value (meta {type(val).__name__})")
    if isinstance(arg, (torch.SymFloat, torch.SymInt, torch.SymBool)):
        return guard_float(arg) if isinstance(arg, torch.SymFloat) else arg
    return arg
