"""The attention rows of the measured tables behind `attention.kernel: auto` on CUDA.

The rows live in the per-GPU tune tables (fx_fp8.ops.tune_table: the user's own from `fx-fp8
tune`, else the shipped ones in tune_tables/); benchmarks/attention_kernels.py (`--table-from`)
writes a probe run's rows into the shipped table of its GPU. A row covers one
GPU (its torch.cuda.get_device_name), one head dim, key-padding mask or not, and a range of key
lengths; it keeps, for every kernel the CUDA lowering can run, the measured time (pre-pass
included) and relative error against float64 attention, next to cuDNN's BF16 time and the
reference lowering's error on the same inputs. Its pick is the fastest kernel whose error is at
most BAR x the reference's (the accuracy bar of the FP8 attention kernels); a row where none
passes picks nothing. The S ranges split the measured lengths at their geometric midpoints, the
first and last open-ended.

`auto_kernel` resolves "auto" at compile time from the table of this device (`rows_for`): the row for this GPU, head dim, mask and key length
whose pick the node can run (a kernel's own eligibility, e.g. cuDNN's per-tensor scales), else the
lowering's default (cuda.AUTO_KERNEL) with the reason in the report. A symbolic key length is not
specialised: the default runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

#: the shipped tune tables (one JSON per GPU, fx_fp8.ops.tune_table's format)
TABLE_PATH = Path(__file__).with_name("tune_tables")
#: a kernel's error may be at most this multiple of the reference lowering's to be picked
BAR = 1.5
#: benchmarks/attention_kernels.py candidate -> the attention.kernel value that runs it ("native": the node
#: stays native, BF16 SDPA, which Inductor lowers to cuDNN's attention on sm90)
PROBE_KERNELS = {"triton": "triton", "cudnn_fp8": "cudnn", "cudnn_bf16": "native"}
#: what a probe row is compared against (its time is kept in the row)
BASELINE = "cudnn_bf16"


def gpu_name(device) -> Optional[str]:
    """torch.cuda.get_device_name of the tensor's device, or None off CUDA / without a driver."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # a CPU-only torch, or fake CUDA tensors in tests
        return None


def _rows_of(table: dict) -> list[dict]:
    """A tune table's attention rows, each with its GPU's name (the table's key)."""
    return [dict(r, gpu=table["key"]["gpu"]) for r in table.get("attention", [])]


def load_table(path=TABLE_PATH) -> dict:
    """{"bar", "rows"}: the attention rows of every tune table in the folder `path` (every GPU)."""
    from fx_fp8.ops import tune_table

    tables = [tune_table.load(p) for p in sorted(Path(path).glob("*.json"))]
    return {
        "bar": BAR,
        "rows": [r for t in tables for r in _rows_of(t)],
        "sources": [dict(t["source"], device=t["key"]["gpu"]) for t in tables],
    }


def rows_for(device) -> Optional[dict]:
    """{"bar", "rows", "where"} of the tune table that applies to `device` (tune_table.table_for), or None."""
    from fx_fp8.ops import tune_table

    found = tune_table.table_for(device)
    if found is None:
        return None
    where, table = found
    return {"bar": table.get("bar", BAR), "rows": _rows_of(table), "where": where}


def _pick(kernels: dict, ref_err: Optional[float]) -> Optional[str]:
    ok = [
        (c["ms"], name)
        for name, c in kernels.items()
        if c.get("ms") is not None and c.get("err") is not None and ref_err and c["err"] <= BAR * ref_err
    ]
    return min(ok)[1] if ok else None


def table_from_probe(results: dict) -> dict:
    """The table from a benchmarks/attention_kernels.py results JSON (Gaussian rows only: the
    outlier row measures robustness, not what to pick)."""
    m = results["meta"]
    if "dry run" in str(m.get("device", "")):
        raise ValueError("a dry run's timings are meaningless: build the table from a GPU run")
    groups: dict[tuple, list] = {}
    for r in results["rows"]:
        if r.get("inputs") != "gaussian" or not r.get("ref_err"):
            continue
        groups.setdefault((r["d"], bool(r["mask"])), []).append(r)
    rows = []
    for (d, mask), measured in sorted(groups.items()):
        measured.sort(key=lambda r: r["s"])
        lengths = [r["s"] for r in measured]
        cuts = [int(math.sqrt(a * b)) for a, b in zip(lengths, lengths[1:])]
        for i, r in enumerate(measured):
            kernels = {}
            for probe_name, kernel in PROBE_KERNELS.items():
                c = r["cells"].get(probe_name, {})
                if "ms" in c and "err" in c:
                    kernels[kernel] = {"ms": round(c["ms"], 4), "err": round(c["err"], 6)}
            base = r["cells"].get(BASELINE, {}).get("ms")
            rows.append(
                {
                    "gpu": m["device"],
                    "d": d,
                    "mask": mask,
                    "s_min": cuts[i - 1] if i else 1,
                    "s_max": cuts[i] - 1 if i < len(cuts) else None,
                    "s_measured": r["s"],
                    "ref_err": round(r["ref_err"], 6),
                    "baseline_ms": round(base, 4) if base else None,
                    "kernels": kernels,
                    "pick": _pick(kernels, r["ref_err"]),
                }
            )
    return {
        "source": {k: m.get(k) for k in ("date", "device", "torch", "triton", "cudnn_frontend")},
        "bar": BAR,
        "rows": rows,
    }


def merged(old: dict, new: dict) -> dict:
    """`new`'s rows, and `old`'s rows of every GPU `new` did not measure (one probe run measures one GPU)."""
    gpus = {r["gpu"] for r in new["rows"]}
    rows = [r for r in old.get("rows", []) if r["gpu"] not in gpus] + list(new["rows"])
    sources = [
        s for s in (old.get("sources") or ([old["source"]] if old.get("source") else [])) if s.get("device") not in gpus
    ] + [new["source"]]
    return {"source": new["source"], "sources": sources, "bar": new["bar"], "rows": rows}


def write_table(table: dict, path=TABLE_PATH) -> None:
    """A probe table's rows into the tune table of each GPU in the folder `path` (made when missing,
    its linear rows kept)."""
    from fx_fp8.ops import tune_table

    for gpu in sorted({r["gpu"] for r in table["rows"]}):
        existing = [
            (p, t) for p in sorted(Path(path).glob("*.json")) for t in [tune_table.load(p)] if t["key"]["gpu"] == gpu
        ]
        src = table.get("source") or {}
        if existing:
            target, tt = existing[0]
        else:
            key = {f: None for f in tune_table.KEY_FIELDS}
            # the probe's meta names no capability unless it recorded one: a shipped table needs it to be found
            key.update(gpu=gpu, torch=src.get("torch"), triton=src.get("triton"), capability=src.get("capability"))
            target, tt = (
                Path(path) / tune_table.file_name(key),
                {"format": tune_table.FORMAT, "key": key, "linears": []},
            )
        rows = [{k: v for k, v in r.items() if k != "gpu"} for r in table["rows"] if r["gpu"] == gpu]
        tt = dict(
            tt,
            bar=table["bar"],
            attention=rows,
            source=dict(
                tt.get("source") or {},
                what=f"{src.get('date')} {gpu} probe run, attention",
                date=src.get("date"),
                tool="benchmarks/attention_kernels.py --table-from",
            ),
        )
        tune_table.write(tt, target)


def find_row(table: dict, gpu: Optional[str], d: int, s: Optional[int], mask: bool) -> Optional[dict]:
    if gpu is None or s is None:
        return None
    for row in table["rows"]:
        if (
            row["gpu"] == gpu
            and row["d"] == d
            and row["mask"] == mask
            and row["s_min"] <= s
            and (row["s_max"] is None or s <= row["s_max"])
        ):
            return row
    return None


def describe(row: dict, kernel: str) -> str:
    c = row["kernels"][kernel]
    span = f"S {row['s_min']}-{row['s_max'] if row['s_max'] is not None else 'inf'}"
    where = f"measured on {row['gpu']} D{row['d']}{' mask' if row['mask'] else ''} {span}"
    if kernel == "native":
        fp8 = sorted((o["ms"], k) for k, o in row["kernels"].items() if k != "native")
        others = ", ".join(f"FP8 {k} {ms:.3f} ms" for ms, k in fp8) or "no FP8 kernel measured"
        return f"{where}: BF16 SDPA {c['ms']:.3f} ms, {others}"
    base = f" vs cuDNN BF16 {row['baseline_ms']:.3f} ms" if row.get("baseline_ms") else ""
    return (
        f"{where}: {c['ms']:.3f} ms{base}, err {100 * c['err']:.2f} % = {c['err'] / row['ref_err']:.2f}x the reference"
    )


def auto_kernel(
    gpu: Optional[str],
    d: Optional[int],
    s_k: Optional[int],
    mask: bool,
    default: str,
    runnable: Callable[[str], bool],
    table: Optional[dict] = None,
) -> tuple[str, str]:
    """(kernel, why) for attention.kernel "auto"; `runnable(kernel)` says whether this node can run it."""
    table = load_table() if table is None else table
    if s_k is None:
        return default, f"key length symbolic: {default} by default"
    row = find_row(table, gpu, d, s_k, mask)
    if row is None:
        return (
            default,
            f"no measured row for {gpu or 'this device'} D{d} S{s_k}{' mask' if mask else ''}: {default} by default",
        )
    ranked = sorted((c["ms"], k) for k, c in row["kernels"].items() if c["err"] <= BAR * row["ref_err"] and runnable(k))
    if not ranked:
        return default, f"no kernel in the measured row meets the {BAR}x error bar here: {default} by default"
    kernel = ranked[0][1]
    return kernel, describe(row, kernel)


def format_rows(table: dict) -> str:
    lines = [f"{'gpu':<18} {'D':>4} {'mask':>5} {'S range':>15} {'cuDNN BF16':>10}  kernels (ms / err %)  -> pick"]
    for r in table["rows"]:
        span = f"{r['s_min']}-{r['s_max'] if r['s_max'] is not None else 'inf'}"
        ks = ", ".join(f"{k} {c['ms']:.3f} / {100 * c['err']:.2f}" for k, c in r["kernels"].items())
        base = f"{r['baseline_ms']:.3f}" if r.get("baseline_ms") else "-"
        lines.append(f"{r['gpu']:<18} {r['d']:>4} {str(r['mask']):>5} {span:>15} {base:>10}  {ks}  -> {r['pick']}")
    return "\n".join(lines)
