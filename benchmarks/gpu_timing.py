"""Timing, GPU-kernel attribution and result files for the benchmarks run on one CUDA GPU.

Timer.measure(fn) gives, for one callable (its first call, the compile, already made):
  ms         triton.testing.do_bench median, L2 flushed before every call: the headline figure
  wall_ms    ms per call over back-to-back calls, synchronised once at the end (steady state)
  launch_ms  ms per call the CPU takes to issue those calls (not synchronised): launch ~ wall means
             the row is CPU-bound, launch << wall that the GPU is the limit
  kernel_ms  GPU kernel time per call from torch.profiler: the duration of every kernel (memcpy and
             memset included) the calls launched, summed, divided by the number of calls
  kernels    [(kernel, ms per call, share of kernel_ms)], largest first: e.g. the activation
             quantization kernel next to the GEMM
  host       [(Python function, ms per call of its own time)], largest first (cProfile over a few
             calls): where launch_ms goes when a row is CPU-bound
kernel_ms / wall_ms is how busy the GPU was: what is missing is CPU overhead and launch gaps.
On CPU (a dry run) the same figures come from perf_counter, and the profiler's outermost aten ops
stand in for kernels (their CPU time).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Timing:
    ms: float
    wall_ms: float
    launch_ms: float
    kernel_ms: float
    kernels_per_call: float
    kernels: list = field(default_factory=list)  # [(short name, ms per call, share)]
    host: list = field(default_factory=list)  # [(function, own ms per call)], cProfile

    def top_host(self, n: int = 5) -> str:
        return "; ".join(f"{name} {ms:.3f}" for name, ms in self.host[:n])

    @property
    def busy(self) -> float:
        """Share of the wall time the GPU spent in kernels."""
        return self.kernel_ms / self.wall_ms if self.wall_ms > 0 else float("nan")

    def top_kernels(self, n: int = 3) -> str:
        shown = [f"{name} {share:.0%}" for name, _, share in self.kernels[:n]]
        rest = len(self.kernels) - n
        return "; ".join(shown) + (f"; +{rest} more" if rest > 0 else "")


def short_kernel_name(name: str, width: int = 48) -> str:
    """A kernel's name without return type, template arguments, parameters or namespaces."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    kept, depth = [], 0
    for i, ch in enumerate(name):
        if ch in "<(":
            depth += 1
        elif ch == ")" or (ch == ">" and name[i - 1 : i] != "-"):  # "->" (Memcpy's direction) closes nothing
            depth = max(depth - 1, 0)
        elif depth == 0:
            kept.append(ch)
    name = "".join(kept).strip()
    if not name.startswith("aten::"):
        name = [p for p in name.split("::") if p][-1] if "::" in name else name
    return name if len(name) <= width else name[: width - 1] + "~"


def attribute(durations: Iterable[tuple[str, float]], calls: int) -> tuple[float, float, list]:
    """(kernel name, microseconds) of every kernel launched by `calls` calls ->
    (kernel ms per call, kernels per call, [(short name, ms per call, share)] largest first)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    per_name: dict[str, float] = {}
    count = 0
    for name, us in durations:
        short = short_kernel_name(name)
        per_name[short] = per_name.get(short, 0.0) + us
        count += 1
    total_us = sum(per_name.values())
    kernels = sorted(
        ((n, us / calls / 1e3, us / total_us if total_us > 0 else 0.0) for n, us in per_name.items()),
        key=lambda k: -k[1],
    )
    return total_us / calls / 1e3, count / calls, kernels


def kernel_durations(events, device: str) -> list[tuple[str, float]]:
    """(name, us) of the GPU kernels among a profiler's events; on CPU, of the outermost aten ops."""
    from torch.autograd import DeviceType

    if device == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    out = []
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out.append((e.name, e.time_range.elapsed_us()))
    return out


class Timer:
    """Measures callables on `device` ("cuda", or "cpu" for a dry run)."""

    def __init__(self, device: str, warmup_ms: int = 25, rep_ms: int = 100, batch_ms: float = 50.0):
        self.device, self.warmup_ms, self.rep_ms, self.batch_ms = device, warmup_ms, rep_ms, batch_ms

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def median_ms(self, fn: Callable) -> float:
        if self.device == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def wall_and_launch(self, fn: Callable, calls: int) -> tuple[float, float]:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t_launch = time.perf_counter() - t0
        self.sync()
        t_wall = time.perf_counter() - t0
        return t_wall / calls * 1e3, t_launch / calls * 1e3

    def profile(self, fn: Callable, calls: int) -> tuple[float, float, list]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self.sync()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            self.sync()
        return attribute(kernel_durations(prof.events(), self.device), calls)

    def host_profile(self, fn: Callable, calls: int, top: int = 8) -> list:
        """[(function, ms of its own time per call)] of the `calls` calls' Python functions (builtins such
        as a kernel launch included), largest first. cProfile inflates Python time (about 1.5-2x):
        the shares, not the sums, are what it tells."""
        import cProfile
        import pstats

        self.sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        self.sync()
        stats = pstats.Stats(prof).stats
        ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
        return [(_function_name(*where), own_s / calls * 1e3) for where, (_, _, own_s, _, _) in ranked]

    def calls_for(self, ms: float, most: int = 50) -> int:
        """Back-to-back calls that fill about batch_ms (at least 3)."""
        return max(3, min(most, int(self.batch_ms / max(ms, 1e-3))))

    def measure(self, fn: Callable, host: bool = True) -> Timing:
        """host: also profile the CPU side (host_profile); rows nobody reads it for skip those calls."""
        ms = self.median_ms(fn)
        calls = self.calls_for(ms)
        wall, launch = self.wall_and_launch(fn, calls)
        kernel_ms, per_call, kernels = self.profile(fn, min(calls, 10))
        host = self.host_profile(fn, min(calls, 20)) if host else []
        return Timing(ms, wall, launch, kernel_ms, per_call, kernels, host)


def _function_name(path: str, line: int, name: str) -> str:
    """cProfile's (file, line, function) as 'module.py:line(function)', or the builtin's name."""
    if path == "~":  # a builtin: "<built-in method torch._C._cuda_...>" / "<method 'run' of ...>"
        return name.strip("<>")
    return f"{os.path.basename(path)}:{line}({name})"


# -- tables and result files ----------------------------------------------------------------------
def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v).replace("|", "/")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _version(module: str) -> str:
    try:
        return getattr(__import__(module), "__version__", "?")
    except Exception as e:  # a missing optional package is a fact to record, not an error
        return f"not installed ({type(e).__name__})"


def environment(device: str) -> list[str]:
    """Date, machine and versions: the head of every dated section."""
    lines = [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"torch: {torch.__version__}",
    ]
    for module, label in (
        ("triton", "Triton"),
        ("torchao", "torchao"),
        ("diffusers", "diffusers"),
        ("cudnn", "nvidia-cudnn-frontend"),
        ("fx_fp8", "fx_fp8"),
    ):
        lines.append(f"{label}: {_version(module)}")
    try:
        import fx_fp8

        lines.append(f"fx_fp8 imported from: {os.path.dirname(fx_fp8.__file__)}")
    except Exception:
        pass
    try:
        rev = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if rev:
            lines.append(f"repository commit: {rev}")
    except Exception:
        pass
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        lines += [
            f"GPU: {p.name} (sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)",
            f"CUDA: {torch.version.cuda}, cuDNN: {torch.backends.cudnn.version()}",
        ]
    else:
        lines.append("device: CPU dry run (tiny shapes; timings meaningless)")
    return lines


def append_section(
    path: str,
    title: str,
    env: list[str],
    command: str,
    wall_s: float,
    body: str,
    when: Optional[datetime.datetime] = None,
) -> None:
    """Append a dated markdown section (RESULTS.md style) to `path`."""
    when = when or datetime.datetime.now()
    head = f"## {title} — {when:%Y-%m-%d %H:%M}\n\n"
    meta = "".join(f"- {x}\n" for x in env) + f"- command: `{command.strip()}`\n- wall: {wall_s:.0f} s\n\n"
    with open(path, "a") as f:
        f.write("\n" + head + meta + body)
