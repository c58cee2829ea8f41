"""INFO records for the long first compiled call: what each compiled graph holds, which kernels it
runs, and how long the backend and the downstream compiler took.

Everything goes to `logging.getLogger("fx_fp8")`, to which the package adds no handler: nothing is
printed unless the application asks, for example

    logging.basicConfig(level=logging.INFO)          # every library's INFO records
    logging.getLogger("fx_fp8").setLevel(logging.INFO) # with a handler of your own

Per downstream compile (one per graph and step variant; block instances that decide alike share
one) two records: before it, what the graph holds; after it, the seconds it took and the model's
totals so far. The backend calls `compiling` around its downstream compile; nothing here changes
what is compiled.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import weakref
from typing import Iterable, Optional

import torch.fx

log = logging.getLogger("fx_fp8")

#: record -> when the backend first saw that model (time.perf_counter()), for "since the first graph"
_STARTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: report actions that run a quantized kernel, in the order the counts are printed
QUANTIZED_ACTIONS = ("fp8", "int8", "weight-only")


def count_actions(reports: Iterable, op: str) -> str:
    """'12 fp8, 3 weight-only, 4 native of 19' for the entries of `op` in `reports`."""
    counts = collections.Counter(e.action for r in reports for e in r.entries if e.op == op)
    total = sum(counts.values())
    if not total:
        return "none"
    order = [a for a in QUANTIZED_ACTIONS if counts[a]] + sorted(a for a in counts if a not in QUANTIZED_ACTIONS)
    return ", ".join(f"{counts[a]} {a}" for a in order) + f" of {total}"


def kernels(graph: Optional[torch.fx.GraphModule]) -> str:
    """The fx_fp8 ops the rewritten graph calls, counted: 'fp8_attention[triton] x2, scaled_mm x12'
    (the attention kernel the pass chose in brackets), and the FP8 GEMMs written into it as aten ops
    (the CUDA lowering's: 'aten._scaled_mm x12')."""
    if graph is None:
        return "unknown"
    counts: collections.Counter = collections.Counter()
    for node in graph.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        if name == "aten._scaled_mm.default":
            counts["aten._scaled_mm"] += 1
            continue
        if not name.startswith("fx_fp8."):
            continue
        name = name[len("fx_fp8.") :].removesuffix(".default")
        kernel = node.kwargs.get("attention_kernel")
        counts[name + (f"[{kernel}]" if kernel else "")] += 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "none (every node stays native)"


def _graph_title(report) -> str:
    variant = f", step variant {report.step_variant}" if report.step_variant else ""
    return f"graph {report.graph_id}{variant}"


def first_seen(record) -> float:
    """When the backend first saw the model owning `record` (the start of its first compiled call,
    less Dynamo's tracing of that first graph)."""
    if record is None:
        return time.perf_counter()
    return _STARTED.setdefault(record, time.perf_counter())


#: models (their records) already told about the compile-time FP8 copies: once per model
_COPIES_NOTED: "weakref.WeakSet" = weakref.WeakSet()


def _note_fp8_copies(report, record) -> None:
    """Once per model, the first graph whose linears got compile-time FP8 copies (the plain
    torch.compile path: the full-precision weights stay, for LoRA, weight writes and restore): how
    many bytes the copies hold and how to avoid them."""
    w = report.weights
    if not w.get("original_copy_kept") or not w.get("quantized_linear_bytes_after"):
        return
    if record is not None:
        if record in _COPIES_NOTED:
            return
        _COPIES_NOTED.add(record)
    log.info(
        "fx_fp8: %s made FP8 copies of its linears' weights at compile time: %.2f MiB, kept beside the %.2f MiB "
        "of full-precision weights they come from (further graphs add theirs; fx_fp8.summary(model) shows the "
        "total). To hold only the FP8 weights, quantize before compiling: fx_fp8.prepare_model(model), "
        "compile_pipeline(pipe) (prepare=True, its default) or from_pretrained(..., "
        "quantization_config=fx_fp8.DiffusersConfig())",
        _graph_title(report),
        w["quantized_linear_bytes_after"] / 2**20,
        w.get("quantized_linear_bytes_before", 0) / 2**20,
    )


@contextlib.contextmanager
def compiling(report, graph: Optional[torch.fx.GraphModule], *, downstream: str, passes_s: float, record=None):
    """Wraps one downstream compile of `graph` (the rewritten graph `report` describes): an INFO record
    before (its attention / linear decisions, kernels, lowering, the seconds the passes took) and
    one after (the compile's seconds, the model's totals over its graphs of this step variant)."""
    started = first_seen(record)
    if not log.isEnabledFor(logging.INFO):
        yield
        return
    log.info(
        "fx_fp8: %s: attention %s; linear %s; kernels: %s; lowering %s; passes %.2f s; compiling with %s...",
        _graph_title(report),
        count_actions([report], "attention"),
        count_actions([report], "linear"),
        kernels(graph),
        report.lowering,
        passes_s,
        downstream,
    )
    _note_fp8_copies(report, record)
    t0 = time.perf_counter()
    yield
    now = time.perf_counter()
    same = [r for r in (record.reports if record is not None else [report]) if r.step_variant == report.step_variant]
    log.info(
        "fx_fp8: %s compiled by %s in %.2f s (%.2f s since the model's first graph reached the backend); "
        "model so far: %d graph instance(s), attention %s, linear %s",
        _graph_title(report),
        downstream,
        now - t0,
        now - started,
        len(same),
        count_actions(same, "attention"),
        count_actions(same, "linear"),
    )
