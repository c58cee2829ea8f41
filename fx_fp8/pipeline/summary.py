"""fx_fp8.summary(pipe_or_model): one row per pipeline component of what fx_fp8 did to it, as
cache_dit.summary(pipe) gives one for caching: FP8 attention n/m, W8A8 linears n/m, weight-only
linears, the native nodes' top reasons, weight bytes before / after, and the kernels that run.

Read from what is there, after a compile (and a first call, which compiles): each component's
compile reports (on the compiled module, the model compiled in place, or its blocks under regional
compilation) and its modules (QuantizedLinear from prepare_model or a quantized load). A component
no one compiled yet shows its prepared linears only. Weight bytes "before" count each quantized
linear at its original dtype; "after" is every tensor the component now holds, the compile-time FP8
copies of the plain path included (which is why that path's "after" exceeds its "before").

A text encoder (any component compile_pipeline's component map compiles besides the denoising
transformers) is compiled with its linears only, by design: its attention rows say so, rather than
the attention pass's "set diffusion_kv_cache_dtype", which does not reach a text encoder.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.passes.attention_remedies import LINEARS_ONLY_ATTENTION
from fx_fp8.pipeline.state import STATE_ATTR, TRANSFORMER_ATTRS
from fx_fp8.quant.quantized_linear import QuantizedLinear, reachable_tensor_bytes
from fx_fp8.quant.rules import is_plain_linear
from fx_fp8.report import ModelRecord

#: native reasons shown per component
TOP_REASONS = 3


@dataclass
class ComponentSummary:
    component: str
    cls: str
    attention_fp8: int = 0
    attention_total: int = 0
    linear_w8a8: int = 0
    linear_total: int = 0
    linear_weight_only: int = 0
    native_reasons: list = field(default_factory=list)  # [(reason, count)], most frequent first
    bytes_before: int = 0
    bytes_after: int = 0
    kernels: str = ""
    compiled: bool = False

    def row(self) -> tuple:
        reasons = "; ".join(f"{n}x {r}" for r, n in self.native_reasons) or "-"
        return (
            self.component,
            self.cls,
            f"{self.attention_fp8}/{self.attention_total}",
            f"{self.linear_w8a8}/{self.linear_total}",
            self.linear_weight_only,
            reasons,
            f"{_mib(self.bytes_before)} -> {_mib(self.bytes_after)}",
            self.kernels or "not compiled",
        )


HEADERS = (
    "component",
    "class",
    "FP8 attention",
    "W8A8 linears",
    "weight-only",
    "native: top reasons",
    "weights before -> after",
    "kernels (lowering/downstream)",
)


class Summary(list):
    """ComponentSummary rows; str() is the table."""

    def table(self) -> str:
        from tabulate import tabulate

        return tabulate([c.row() for c in self], headers=HEADERS, maxcolwidths=[None] * 5 + [60, None, None])

    def to_dict(self) -> list:
        return [asdict(c) for c in self]

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _reports(module: nn.Module) -> list:
    """The primary-variant reports of `module` and of every submodule compiled on its own."""
    seen, out = set(), []
    for owner in (module, unwrap_compiled(module), *unwrap_compiled(module).modules()):
        record = getattr(owner, ModelRecord.ATTR, None)
        if record is None or id(record) in seen:
            continue
        seen.add(id(record))
        out += [r for r in record.reports if r.step_variant in (None, "fp8")]
    return out


def _weight_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes with every quantized linear at its original dtype, bytes of every tensor held now)."""
    quantized = [m for m in module.modules() if isinstance(m, QuantizedLinear)]
    own = {
        id(t)
        for m in quantized
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
        if t is not getattr(m, "bias", None)
    }
    seen, before = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        st = t.untyped_storage()
        if id(t) in own or (st.data_ptr(), st.device.type) in seen:
            continue
        seen.add((st.data_ptr(), st.device.type))
        before += st.nbytes()
    before += sum(m.in_features * m.out_features * m.orig_dtype.itemsize for m in quantized)
    return before, reachable_tensor_bytes(module)


def summarize_component(name: str, component, *, linears_only: bool = False) -> ComponentSummary:
    """The row of one component; `linears_only`: compiled with its linears only (a text encoder of
    compile_pipeline's component map), so its native attention says that rather than what the
    attention pass would ask of a transformer."""
    module = unwrap_compiled(component)
    s = ComponentSummary(component=name, cls=type(module).__name__)
    reports = _reports(component)
    reasons = collections.Counter()
    kernels = []
    for r in reports:
        for e in r.entries:
            if e.op == "attention":
                s.attention_total += 1
                s.attention_fp8 += e.action == "fp8"
            elif e.op == "linear":
                s.linear_total += 1
                s.linear_w8a8 += e.action in ("fp8", "int8")
                s.linear_weight_only += e.action == "weight-only"
            if e.action == "native":
                reasons[LINEARS_ONLY_ATTENTION if linears_only and e.op == "attention" else e.reason] += 1
        kernel = f"{r.lowering}/{r.downstream}"
        if kernel not in kernels:
            kernels.append(kernel)
    if not reports:  # not compiled (yet): what its modules hold
        layers = [m for m in module.modules() if isinstance(m, QuantizedLinear) or is_plain_linear(m)]
        s.linear_total = len(layers)
        s.linear_weight_only = sum(isinstance(m, QuantizedLinear) and m.weight_only for m in layers)
        s.linear_w8a8 = sum(isinstance(m, QuantizedLinear) for m in layers) - s.linear_weight_only
    s.native_reasons = reasons.most_common(TOP_REASONS)
    s.kernels = ", ".join(kernels)
    s.compiled = bool(reports)
    s.bytes_before, s.bytes_after = _weight_bytes(module)
    return s


def summary(pipe_or_model) -> Summary:
    """One ComponentSummary per nn.Module component of a diffusers pipeline (its `components`), or
    one for a model (torch.compile'd or not). print() it for the table; .to_dict() for the numbers."""
    components = getattr(pipe_or_model, "components", None)
    if isinstance(pipe_or_model, nn.Module) or not isinstance(components, dict):
        if not isinstance(pipe_or_model, nn.Module):
            raise TypeError(
                f"fx_fp8.summary expects a diffusers pipeline or an nn.Module, got {type(pipe_or_model).__name__}"
            )
        return Summary([summarize_component("model", pipe_or_model)])
    linears_only = _linears_only(pipe_or_model)
    return Summary(
        summarize_component(name, c, linears_only=name in linears_only)
        for name, c in components.items()
        if isinstance(c, nn.Module)
    )


def _linears_only(pipe) -> set:
    """The components compile_pipeline compiled with their linears only: every one it compiled but
    the denoising transformers (fx_fp8/config/components.py: attention is a denoising transformer's)."""
    state = getattr(pipe, STATE_ATTR, None)
    return {n for n in getattr(state, "compiled", None) or {} if n not in TRANSFORMER_ATTRS}
