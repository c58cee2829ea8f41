"""What each compile did: one entry per attention / linear node."""
from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ReportEntry:
    op: str                 # "attention" | "linear"
    module: str             # fully qualified module name, as named_modules() spells it
    layer: Optional[int]    # transformer layer index (execution order), None outside blocks
    action: str             # "fp8" | "native"
    reason: str
    shapes: str = ""        # input shapes, e.g. "1x24x4608x128 ..." or "4608x3072 -> 3072"
    node: str = ""          # FX node name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class CompileReport:
    backend: str
    lowering: str
    downstream: str
    step_variant: Optional[str]          # "fp8" | "native" | None (no step skips)
    entries: list[ReportEntry] = field(default_factory=list)
    layer_map: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)   # bytes before/after, whether a BF16 copy is kept
    notes: list[str] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)    # stage -> graph code, when dump_graphs was asked
    graph_id: int = 0

    def add(self, **kw) -> ReportEntry:
        entry = ReportEntry(**kw)
        self.entries.append(entry)
        return entry

    def count(self, op: Optional[str] = None, action: Optional[str] = None) -> int:
        return sum(1 for e in self.entries if (op is None or e.op == op) and (action is None or e.action == action))

    def summary(self) -> dict:
        out = {}
        for op in ("attention", "linear"):
            out[op] = {"fp8": self.count(op, "fp8"), "native": self.count(op, "native")}
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["graphs"]  # graph code goes to files (fx-fp8 dump), not into the JSON report
        d["summary"] = self.summary()
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        from tabulate import tabulate

        rows = [(e.module, "" if e.layer is None else e.layer, e.op, e.action, e.reason, e.shapes) for e in self.entries]
        return tabulate(rows, headers=["module", "layer", "op", "action", "reason", "shapes"])


_LOCK = threading.Lock()
_REPORTS: list[CompileReport] = []


def record_report(report: CompileReport) -> None:
    with _LOCK:
        report.graph_id = len(_REPORTS)
        _REPORTS.append(report)


def get_reports() -> list[CompileReport]:
    """All compile reports since the last clear_reports(), newest last."""
    with _LOCK:
        return list(_REPORTS)


def clear_reports() -> None:
    with _LOCK:
        _REPORTS.clear()
