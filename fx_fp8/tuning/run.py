"""fx_fp8.tune: measure every FP8 decision of a model on this device, write the table `auto` follows.

    table = fx_fp8.tune(pipe, example_inputs={...})        # the transformer of a pipeline, or a model

Steps: the distinct shapes (fx_fp8.tuning.shapes, the backend's own analysis), every candidate of
each timed (fx_fp8.tuning.candidates), the table built (fx_fp8.ops.tune_table's format, picks by
its rules) and written to the per-user cache folder (the table `auto` reads for this GPU) and to
`out`. On a CPU (`dry_run=True`; no GPU otherwise refuses) the times are CPU times, the table's key
says "cpu" and its source says the timings are not a GPU's: it is written to `out` only.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from typing import Callable, Optional

import torch

from fx_fp8.ops import attention_table, tune_table
from fx_fp8.progress import bar
from fx_fp8.tuning.candidates import measure_attention, measure_linear
from fx_fp8.tuning.shapes import collect


#: the clock of tune's budget (a stand-in in tests)
_clock = time.perf_counter


def cuda_timer(fn: Callable, budget_ms: float = 200.0, max_reps: int = 20) -> float:
    """Median ms of `fn` on the current CUDA stream (events around each call, synchronised): one
    warm-up call, then as many calls as fit `budget_ms` (at least 3, at most `max_reps`), so that a
    2 s attention call at 75k keys costs seconds, not a minute."""

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    first = once()
    reps = max(3, min(max_reps, int(budget_ms / max(first, 1e-3))))
    return statistics.median(once() for _ in range(reps))


def cpu_timer(fn: Callable, warmup: int = 1, reps: int = 3) -> float:
    """Median wall ms on the CPU: a dry run's timings (never a GPU's)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _model_of(model_or_pipeline):
    model = getattr(model_or_pipeline, "transformer", None) or model_or_pipeline
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"fx_fp8.tune: expected a model (nn.Module) or a pipeline with a .transformer, got "
            f"{type(model_or_pipeline).__name__}"
        )
    return model


def _device_of(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _by_work(shapes: dict, flops) -> list:
    """The shapes, the largest share of the model's work (nodes x FLOPs per node) first."""
    return sorted(shapes, key=lambda s: -len(shapes[s]) * flops(s))


def attention_rows(measured: list) -> list[dict]:
    """Attention rows in the attention table's format, one per head dim, mask and key length (the
    longest query length kept per key length), with their key-length ranges."""
    best: dict = {}
    for shape, cells, ref_err in measured:
        prev = best.get((shape.d, shape.mask, shape.s_k))
        if prev is None or shape.s_q * shape.bh > prev[0].s_q * prev[0].bh:
            best[(shape.d, shape.mask, shape.s_k)] = (shape, cells, ref_err)
    rows = []
    for shape, cells, ref_err in best.values():
        kernels = {
            k: {"ms": c["ms"], "err": c["err"]}
            for k, c in cells.items()
            if c.get("ms") is not None and c.get("err") is not None
        }
        rows.append(
            {
                "d": shape.d,
                "mask": shape.mask,
                "s_measured": shape.s_k,
                "s_q": shape.s_q,
                "bh": shape.bh,
                "ref_err": ref_err,
                "baseline_ms": kernels.get("native", {}).get("ms"),
                "kernels": kernels,
                "errors": {k: c["error"] for k, c in cells.items() if c.get("error")},
                "pick": attention_table._pick(kernels, ref_err) if kernels else None,
            }
        )
    return _with_ranges(rows)


def _with_ranges(rows: list[dict]) -> list[dict]:
    """Attention rows with their key-length ranges: per head dim and mask, the measured lengths split
    at their geometric midpoints, the first and last open-ended."""
    out = []
    for d, mask in sorted({(r["d"], r["mask"]) for r in rows}):
        group = sorted((r for r in rows if (r["d"], r["mask"]) == (d, mask)), key=lambda r: r["s_measured"])
        cuts = [int(math.sqrt(a["s_measured"] * b["s_measured"])) for a, b in zip(group, group[1:])]
        out += [
            dict(r, s_min=cuts[i - 1] if i else 1, s_max=cuts[i] - 1 if i < len(cuts) else None)
            for i, r in enumerate(group)
        ]
    return out


def merged(old: Optional[dict], new: dict) -> dict:
    """`new`, keeping the rows of `old` (the cache's table of this GPU, another model tuned before)
    that `new` did not measure, when both have the same key; `new` alone otherwise."""
    if not old or old.get("key") != new["key"]:
        return new

    def shape_key(r):
        return (r["m"], r["k"], r["n"], r.get("dtype"), bool(r.get("bias")), r["role"])

    fresh = {shape_key(r) for r in new["linears"]}
    lengths = {(r["d"], r["mask"], r["s_measured"]) for r in new["attention"]}
    kept = [r for r in old.get("linears", []) if shape_key(r) not in fresh]
    kept_att = [r for r in old.get("attention", []) if (r["d"], r["mask"], r["s_measured"]) not in lengths]
    models = sorted({old["source"].get("model", "?"), new["source"].get("model", "?")})
    return dict(
        new,
        linears=kept + new["linears"],
        attention=_with_ranges(kept_att + new["attention"]),
        source=dict(
            new["source"],
            model=", ".join(models),
            merged=f"{len(kept)} linear and {len(kept_att)} attention rows kept from "
            f"{old['source'].get('date')}'s table",
        ),
    )


def linear_row(shape, cells: dict, modules: list, qcfg) -> dict:
    """The table row of one linear shape: every candidate's time and error, `pick` (what `auto` runs
    with the config tuned for: among the forms it emits) and `fastest` (among every form measured)."""
    ok = {k: {"ms": c["ms"], "err": c["err"]} for k, c in cells.items() if c.get("ms") is not None}
    row = {
        "m": shape.m,
        "k": shape.k,
        "n": shape.n,
        "dtype": shape.dtype,
        "bias": shape.bias,
        "role": shape.role,
        "modules": sorted(modules),
        "count": len(modules),
        "candidates": ok,
        "errors": {k: c["error"] for k, c in cells.items() if c.get("error")},
    }
    for field, allowed in (("pick", tune_table.emitted_candidates(qcfg, shape.role)), ("fastest", list(ok))):
        picked = tune_table.linear_pick(
            {"linears": [row]}, shape.m, shape.k, shape.n, shape.dtype, shape.bias, shape.role, allowed
        )
        row[field] = picked[0] if picked else None
    return row


def tune(
    model_or_pipeline,
    example_inputs: Optional[dict] = None,
    *,
    config=None,
    out=None,
    dry_run: bool = False,
    timer: Optional[Callable] = None,
    write_cache: bool = True,
    max_shapes: Optional[int] = None,
    budget_s: Optional[float] = None,
) -> dict:
    """Measure every candidate of every distinct linear / attention shape of the model on
    `example_inputs` (keyword arguments of its forward) and return the table; written to the cache
    folder (fx_fp8.ops.tune_table.cache_dir, a GPU run only) and to `out` when given.

    config: the FP8 config the model will be compiled with (its lowering, downstream, fast_accum,
    weight-only storage...); timer(fn) -> ms replaces the GPU / CPU timer (tests). Shapes are measured
    in order of their share of the model's work (nodes x FLOPs), so that a limit leaves out the least:
    max_shapes measures that many of each kind, budget_s starts no shape after that many seconds
    (the ones left are listed in the table's `unmeasured`, and the nodes of those shapes follow the rules)."""
    from fx_fp8.config.fp8_config import FP8Config

    if not isinstance(example_inputs, dict) or not example_inputs:
        raise ValueError(
            "fx_fp8.tune needs example_inputs: the keyword arguments of one forward call "
            f"(got {type(example_inputs).__name__})"
        )
    model = _model_of(model_or_pipeline)
    device = _device_of(model)
    if device.type != "cuda" and not dry_run:
        raise ValueError(
            f"fx_fp8.tune: the model is on {device.type}, not a CUDA GPU: timings there decide "
            "nothing on a GPU; pass dry_run=True (--dry-run) to exercise the run with CPU timings"
        )
    cfg = FP8Config.load(config)
    if timer is None:
        timer = cuda_timer if device.type == "cuda" else cpu_timer
    started = _clock()  # the budget and the reported seconds include the trace
    linears, attention = collect(model, example_inputs, cfg)
    traced = _clock() - started
    work = (
        _by_work(linears, lambda s: s.m * s.k * s.n)[:max_shapes]
        + _by_work(attention, lambda s: s.bh * s.s_q * s.s_k * s.d)[:max_shapes]
    )
    work = [("linear" if s in linears else "attention", s) for s in work]
    lin_rows, att_measured, unmeasured = [], [], []
    for kind, shape in bar(work, total=len(work), desc="fx_fp8 tune", unit="shape"):
        if budget_s is not None and _clock() - started > budget_s:
            unmeasured.append(shape.label())
            continue
        if kind == "linear":
            lin_rows.append(
                linear_row(shape, measure_linear(shape, cfg, device, timer), linears[shape], cfg.quantization_config)
            )
        else:
            cells, ref_err = measure_attention(shape, cfg, device, timer)
            att_measured.append((shape, cells, ref_err))
    seconds = _clock() - started
    key = tune_table.device_key(device)
    where = "GPU" if device.type == "cuda" else "CPU dry run: CPU timings, not a GPU's"
    table = {
        "format": tune_table.FORMAT,
        "key": key,
        "source": {
            "what": f"fx-fp8 tune on {key['gpu']} ({where})",
            "date": datetime.date.today().isoformat(),
            "tool": "fx_fp8.tune",
            "model": type(model).__name__,
            "seconds": round(seconds, 1),
            "trace_seconds": round(traced, 1),
            "timer": getattr(timer, "__name__", repr(timer)),
        },
        "bar": attention_table.BAR,
        "linears": lin_rows,
        "attention": attention_rows(att_measured),
    }
    if unmeasured:
        table["unmeasured"] = unmeasured
        table["source"]["budget"] = f"{budget_s:g} s reached: {len(unmeasured)} shapes not measured"
    tune_table.validate(table, "the tune result")
    written = []
    if write_cache and device.type == "cuda":
        cached = tune_table.cache_dir() / tune_table.file_name(key)
        try:  # another model tuned before on this GPU, same versions: its shapes stay
            old = tune_table.load(cached) if cached.is_file() else None
        except ValueError:
            old = None
        written.append(tune_table.write(merged(old, table), cached))
    if out is not None:
        written.append(tune_table.write(table, out))
    table["written"] = [str(p) for p in written]
    return table


def format_summary(table: dict) -> str:
    """One row per shape: the candidates' ms, the pick, its speed-up over native."""
    from tabulate import tabulate

    rows = []
    for r in table["linears"]:
        c = r["candidates"]
        rows.append(
            (
                f"linear {r['m']}x{r['k']}->{r['n']} {r['role']}",
                r.get("count", ""),
                ", ".join(f"{k} {v['ms']:.3f}" for k, v in sorted(c.items(), key=lambda t: t[1]['ms'])),
                _pick_text(r),
                _speedup(c, r["pick"]),
            )
        )
    for r in table["attention"]:
        c = r["kernels"]
        rows.append(
            (
                f"attention D{r['d']} Sq {r['s_q']} Sk {r['s_measured']}",
                "",
                ", ".join(f"{k} {v['ms']:.3f}" for k, v in sorted(c.items(), key=lambda t: t[1]['ms'])),
                r["pick"] or "-",
                _speedup(c, r["pick"]),
            )
        )
    head = (
        f"{table['source']['what']}: {len(table['linears'])} linear and {len(table['attention'])} attention "
        f"shapes in {table['source']['seconds']} s"
    )
    if table.get("unmeasured"):
        head += f"; budget {table['source']['budget']} ({', '.join(table['unmeasured'][:4])}...)"
    return head + "\n" + tabulate(rows, headers=["shape", "nodes", "candidates (ms)", "pick", "x native"])


def _pick_text(row: dict) -> str:
    pick, fastest = row["pick"] or "-", row.get("fastest")
    return pick if fastest in (None, row["pick"]) else f"{pick} (fastest: {fastest})"


def _speedup(cells: dict, pick) -> str:
    if not pick or pick not in cells or "native" not in cells or not cells[pick]["ms"]:
        return "-"
    return f"{cells['native']['ms'] / cells[pick]['ms']:.2f}x"
