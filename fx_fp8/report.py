"""What each compile did: one entry per attention / linear node.

Reports belong to what was compiled: `fx_fp8.get_reports(compiled_model)`
returns that model's reports (kept on the torch.compile'd module, or on the
model for an in-place `model.compile()`). `fx_fp8.get_reports()` without an
argument reads a bounded log of the most recent compiles in this process, a
convenience for interactive use (REPORT_LOG_SIZE entries).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from tabulate import tabulate

from fx_fp8.graph.shapes import concrete

REPORT_LOG_SIZE = 256


def dims_of(*vals) -> list:
    """Input shapes as numbers, one list per input: [[1, 24, 4608, 128], ...]; a size that is
    symbolic (dynamic shapes) is None, an input that is not a tensor is None."""
    return [[concrete(d) for d in v.shape] if isinstance(v, torch.Tensor) else None for v in vals]


def node_flops(op: str, dims: Sequence) -> Optional[float]:
    """Multiply-add FLOPs (2 per MAC) of one attention or linear call from its input shapes
    (`dims_of`): None when a size it needs is symbolic or missing.

    linear: dims = [x, weight] with x [..., in] and weight [out, in]: 2 * tokens * out * in.
    attention: dims = [q, k, v], each [B, H, S, D] (every attention form the passes rewrite
    takes this layout): QK^T and PV, 2 * B * H * Sq * Sk * (Dqk + Dv).
    """
    try:
        if op == "linear":
            x, w = dims[0], dims[-1]
            sizes = [*x[:-1], w[0], w[1]]
        elif op == "attention":
            q, k, v = dims[0], dims[1], dims[2]
            sizes = [*q[:-1], k[-2], q[-1] + v[-1]] if None not in (q[-1], v[-1]) else [None]
        else:
            raise ValueError(f"node_flops: op must be 'linear' or 'attention', got {op!r}")
    except (IndexError, TypeError):
        return None  # a missing input or an unknown rank: no number rather than a wrong one
    if any(d is None for d in sizes):
        return None
    return 2.0 * math.prod(sizes)


@dataclass
class ReportEntry:
    op: str  # "attention" | "linear"
    module: str  # module name, as the model's named_modules() spells it (see name_resolved)
    layer: Optional[int]  # transformer layer index (the model's block order), None outside blocks or unknown
    action: str  # "fp8" | "int8" | "native"
    reason: str
    shapes: str = ""  # input shapes, e.g. "1x24x4608x128 ..." or "4608x3072 -> 3072" (symbols when dynamic)
    node: str = ""  # FX node name
    name_resolved: bool = True  # False: `module` is Dynamo's spelling relative to a graph piece
    form: str = ""  # attention: sdpa | flash | flash_cpu | efficient | cudnn
    act_quant_group: str = ""  # linear: the activation-quantization group it shares ("" if none)
    dims: list = field(default_factory=list)  # input shapes as numbers (`dims_of`; None where symbolic)
    flops: Optional[float] = None  # FLOPs per call from `dims` (`node_flops`); None when a size is symbolic
    timing: dict = field(default_factory=dict)  # {"pick": ms, "native": ms} from the tune table, when measured

    def __post_init__(self):
        if self.flops is None and self.dims:
            self.flops = node_flops(self.op, self.dims)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class CompileReport:
    backend: str
    lowering: str
    downstream: str
    step_variant: Optional[str]  # "fp8" | "native" | None (no step skips)
    entries: list[ReportEntry] = field(default_factory=list)
    layer_map: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # bytes before/after, whether the original copy is kept
    notes: list[str] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)  # stage -> graph code, when dump_graphs was asked
    graph_id: int = 0  # index of this graph among its owner's compiles

    def add(self, **kw) -> ReportEntry:
        entry = ReportEntry(**kw)
        self.entries.append(entry)
        return entry

    def count(self, op: Optional[str] = None, action: Optional[str] = None) -> int:
        """Entries of `op`; action "quantized" counts every non-native action."""

        def hit(e):
            return action is None or e.action == action or (action == "quantized" and e.action != "native")

        return sum(1 for e in self.entries if (op is None or e.op == op) and hit(e))

    def flops(self, actions: Sequence[str] = ("fp8", "int8")) -> float:
        """FLOPs per call of this graph's entries whose action is in `actions` (entries whose
        FLOPs are unknown, symbolic sizes, count 0)."""
        return sum(e.flops or 0.0 for e in self.entries if e.action in actions)

    def summary(self) -> dict:
        out = {}
        for op in ("attention", "linear"):
            actions = sorted({e.action for e in self.entries if e.op == op} | {"fp8", "native"})
            out[op] = {a: self.count(op, a) for a in actions}
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["graphs"]  # graph code goes to files (fx-fp8 dump), not into the JSON report
        d["summary"] = self.summary()
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        rows = [
            (
                e.module + ("" if e.name_resolved else " (?)"),
                "" if e.layer is None else e.layer,
                e.op,
                e.action,
                e.reason,
                e.shapes,
            )
            for e in self.entries
        ]
        return tabulate(rows, headers=["module", "layer", "op", "action", "reason", "shapes"])


class ReportLog:
    """The process's most recent compile reports (bounded), for get_reports() without an owner."""

    def __init__(self, size: int = REPORT_LOG_SIZE):
        self._lock = threading.Lock()
        self._reports: collections.deque = collections.deque(maxlen=size)

    def add(self, report: CompileReport) -> None:
        with self._lock:
            self._reports.append(report)

    def all(self) -> list[CompileReport]:
        with self._lock:
            return list(self._reports)

    def clear(self) -> None:
        with self._lock:
            self._reports.clear()


#: the one process-wide log (bounded; a convenience, never read by the backend itself)
RECENT = ReportLog()


class ModelRecord:
    """What one compiled model owns across all its graphs: their reports, and the warnings
    already given (each warning once per compiled model, not once per process).

    Kept on the owner (the torch.compile'd module, or the model compiled in place);
    a compiled function gets a record of its own per graph.
    """

    ATTR = "_fx_fp8_record"

    def __init__(self):
        self.reports: list[CompileReport] = []
        self.warned: set[str] = set()
        #: module instances planned for this model: by running the passes, or by reusing an equal instance's decisions
        self.plans = {"passes": 0, "reused": 0}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, owner) -> "ModelRecord":
        if owner is None:
            return cls()
        record = getattr(owner, cls.ATTR, None)
        if record is None:
            record = cls()
            object.__setattr__(owner, cls.ATTR, record)  # plain attribute, even on an nn.Module
        return record

    def add(self, report: CompileReport) -> None:
        with self._lock:
            report.graph_id = len(self.reports)
            self.reports.append(report)

    def warn(self, message: str) -> None:
        with self._lock:
            if message in self.warned:
                return
            self.warned.add(message)
        warnings.warn(message, stacklevel=3)


def _record(compiled) -> ModelRecord | None:
    for obj in (compiled, getattr(compiled, "_orig_mod", None)):
        record = getattr(obj, ModelRecord.ATTR, None) if obj is not None else None
        if record is not None:
            return record
    return None


def get_reports(compiled=None) -> list[CompileReport]:
    """The compile reports of `compiled` (a torch.compile'd module, or a model compiled in
    place), oldest first; without an argument, the recent compiles of this process."""
    if compiled is None:
        return RECENT.all()
    record = _record(compiled)
    return list(record.reports) if record is not None else []


def clear_reports(compiled=None) -> None:
    """Forget the reports of `compiled`, or the process's recent-compiles log."""
    if compiled is None:
        RECENT.clear()
        return
    record = _record(compiled)
    if record is not None:
        record.reports.clear()
