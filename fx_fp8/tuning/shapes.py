"""The distinct linear and attention shapes of a model, as fx_fp8's backend sees them.

The model is compiled once by the `fp8` backend itself (quantization_config.kernel "rules", so no
earlier table shapes the roles; eager downstream: nothing is compiled twice) on the example
inputs, and its report rows give every node: a linear's M (tokens), K, N and its role ("w8a8"
where the rules quantize it W8A8, "weight_only" for a sensitive layer the rules run W8A16), an
attention's batch x heads, query and key lengths and head dim. Linears the rules keep native
(ignored_layers, small layers, odd shapes) have no candidate and are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fx_fp8.report import clear_reports, get_reports
from fx_fp8.steps import denoising_step


@dataclass(frozen=True)
class LinearShape:
    m: int
    k: int
    n: int
    dtype: str
    bias: bool
    role: str  # "w8a8" | "weight_only"

    def label(self) -> str:
        return f"linear M {self.m} K {self.k} N {self.n} {self.dtype}{' bias' if self.bias else ''} ({self.role})"


@dataclass(frozen=True)
class AttentionShape:
    bh: int
    s_q: int
    s_k: int
    d: int
    dtype: str
    mask: bool = False

    def label(self) -> str:
        return f"attention BH {self.bh} Sq {self.s_q} Sk {self.s_k} D {self.d} {self.dtype}"


def role_of(entry) -> str | None:
    """A report row's role, or None for a linear the rules keep native."""
    if entry.action == "weight-only":
        return "weight_only" if "sensitive: weight_only" in entry.reason else "w8a8"
    return None if entry.action == "native" else "w8a8"


def _linear_module(model, name: str):
    import torch.nn as nn

    try:
        mod = model.get_submodule(name)
    except (AttributeError, ValueError):
        return None
    return mod if isinstance(mod, nn.Linear) else None


def collect(model, example_inputs: dict, config, *, backend: str = "fp8") -> tuple[dict, dict]:
    """({LinearShape: module names}, {AttentionShape: module names}): the distinct shapes of
    `model` on `example_inputs` (keyword arguments of its forward), in graph order."""
    import torch

    cfg = config.replace(quantization_config={"kernel": "rules"}, downstream="eager")
    fallback_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    torch._dynamo.reset()
    clear_reports()
    compiled = torch.compile(model, backend=backend, options={"config": cfg})
    with torch.no_grad(), denoising_step(0, total=1):
        compiled(**example_inputs)
    linears, attention = {}, {}
    for report in get_reports():
        if report.step_variant not in (None, "fp8"):
            continue
        for e in report.entries:
            if not e.dims or any(d is None or None in d for d in e.dims[:3]):
                continue  # a symbolic size (or an input that is no tensor): nothing to time
            if e.op == "linear":
                role = role_of(e)
                x, w = e.dims[0], e.dims[-1]
                if role is None or x is None or w is None:
                    continue
                mod = _linear_module(model, e.module) if e.name_resolved else None
                dtype = str(mod.weight.dtype).replace("torch.", "") if mod is not None else fallback_dtype
                bias = mod.bias is not None if mod is not None else True
                shape = LinearShape(math.prod(x[:-1]), w[1], w[0], dtype, bias, role)
                linears.setdefault(shape, []).append(e.module)
            elif e.op == "attention":
                q, k = e.dims[0], e.dims[1]
                if q is None or k is None or len(q) != 4:
                    continue
                shape = AttentionShape(q[0] * q[1], q[2], k[2], q[3], fallback_dtype)
                attention.setdefault(shape, []).append(e.module)
    return linears, attention
