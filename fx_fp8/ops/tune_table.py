"""The per-GPU tune table: what `fx-fp8 tune` measured, and the pick `auto` takes from it.

One JSON file per GPU (format FORMAT), keyed by the GPU's name, compute capability, CUDA, torch,
Triton and fx_fp8 versions (`device_key`). It holds, per distinct linear shape (M, K, N, dtype,
bias, role: "w8a8" for a linear the rules quantize W8A8, "weight_only" for a sensitive one) and
per attention shape, every candidate's measured time and its error against native on the same
inputs. Written by fx_fp8.tuning to the per-user cache folder (`cache_dir`) and to `--out`; the
package ships tables measured on real GPUs in tune_tables/ (their `source` says which run).

Which table applies to a device (`table_for`):
* an explicit file (quantization_config.tune_table): its whole key must match;
* the cache folder's file for this GPU: its whole key must match (re-run `fx-fp8 tune` after
  upgrading torch, Triton, CUDA or fx_fp8);
* a shipped table: GPU name and compute capability must match (the versions it was measured
  with are named in the report).
A table from another key is ignored with an INFO line on logging.getLogger("fx_fp8") saying which
field differs.

The linear pick (`linear_pick`): among the candidates this config can emit for the node's role,
the fastest whose error is at most LINEAR_ERR_MAX; native unless that candidate is more than
MIN_GAIN faster than native. M between two measured M's is interpolated linearly between them,
outside the measured ones it takes the nearest; the report says which. `shape_decision` turns the
pick into a linear's kind; fx_fp8.quant.tuned_plan applies it to a plan, the one step the linear pass
and prepare_model (at the M of its trace on example inputs) both take.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Optional

log = logging.getLogger("fx_fp8")

FORMAT = "fx_fp8.tune/1"
SHIPPED_DIR = Path(__file__).with_name("tune_tables")
#: every field of a table's key, in the order the INFO line names a mismatch
KEY_FIELDS = ("gpu", "capability", "cuda", "torch", "triton", "fx_fp8")
#: what a shipped table must share with the device (it was measured with other versions, said in the report)
SHIPPED_KEY_FIELDS = ("gpu", "capability")
#: source fields every table fills in
SOURCE_FIELDS = ("what", "date", "tool")
#: a candidate faster than native by less than this fraction is no gain (timing noise): native stays
MIN_GAIN = 0.03
#: a linear candidate's relative error against native (Frobenius) must be at most this to be picked
LINEAR_ERR_MAX = 0.1
ROLES = ("w8a8", "weight_only")
#: linear candidates: name -> what the linear pass emits for it ("native", "quantized": W8A8 with the
#: config's recipe, "weight_only": the config's W8A16 recipe)
LINEAR_CANDIDATES = {
    "native": "native",
    "fp8_rowwise": "quantized",
    "fp8_block": "quantized",
    "int8_rowwise": "quantized",
    "weight_only_int8": "weight_only",
    "weight_only_fp8": "weight_only",
}
UNMEASURED = "not measured on this GPU (fx-fp8 tune)"


def cache_dir() -> Path:
    """$FX_FP8_TUNE_DIR, else $XDG_CACHE_HOME/fx_fp8/tune, else ~/.cache/fx_fp8/tune."""
    if os.environ.get("FX_FP8_TUNE_DIR"):
        return Path(os.environ["FX_FP8_TUNE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "fx_fp8" / "tune"


@functools.lru_cache(maxsize=None)  # read once: every linear node's decision asks for the key
def _version(module: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:  # the installed distribution's version (torch's carries its build: 2.11.0+cu130)
        return version(module)
    except PackageNotFoundError:  # not installed: the key says so with None
        return None


def device_key(device) -> dict:
    """The table key of `device`: a CUDA GPU's name and capability, or {"gpu": "cpu"} (CPU timings,
    `fx-fp8 tune --dry-run`), with the versions of CUDA, torch, Triton and fx_fp8."""
    import torch

    if getattr(device, "type", None) == "cuda":
        from fx_fp8.ops.attention_table import gpu_name

        try:
            cap = list(torch.cuda.get_device_capability(device))
        except Exception:  # a CPU-only torch compiling for fake CUDA tensors
            cap = None
        gpu = gpu_name(device)
    else:
        gpu, cap = "cpu", None
    return {
        "gpu": gpu,
        "capability": cap,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fx_fp8": _version("fx_fp8"),
    }


def file_name(key: dict) -> str:
    """nvidia_h200-sm90.json"""
    slug = re.sub(r"[^a-z0-9]+", "_", str(key["gpu"]).lower()).strip("_")
    cap = key.get("capability")
    return f"{slug}-sm{cap[0]}{cap[1]}.json" if cap else f"{slug}.json"


def _bad(where, what: str):
    return ValueError(f"{where}: not an fx_fp8 tune table: {what}")


def _check_cells(where, cells, label: str) -> None:
    if not isinstance(cells, dict) or not cells:
        raise _bad(where, f"{label} has no candidates")
    for name, c in cells.items():
        if not isinstance(c, dict):
            raise _bad(where, f"{label} candidate {name!r} is {c!r}, not a mapping")
        for f in ("ms", "err"):
            v = c.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise _bad(where, f"{label} candidate {name!r} has {f} {v!r} (a number >= 0 or null)")


def validate(table, where="table") -> dict:
    """`table` itself when it is a well-formed tune table; else a ValueError naming the bad value."""
    if not isinstance(table, dict):
        raise _bad(where, f"expected a JSON object, got {type(table).__name__}")
    if table.get("format") != FORMAT:
        raise _bad(where, f"format {table.get('format')!r} (expected {FORMAT!r})")
    key, source = table.get("key"), table.get("source")
    if not isinstance(key, dict) or set(key) != set(KEY_FIELDS):
        raise _bad(where, f"key {key!r} (expected the fields {', '.join(KEY_FIELDS)})")
    if not isinstance(source, dict) or not all(source.get(f) for f in SOURCE_FIELDS):
        raise _bad(where, f"source {source!r} (expected {', '.join(SOURCE_FIELDS)} filled in)")
    for i, row in enumerate(table.get("linears", [])):
        label = f"linears[{i}]"
        for f in ("m", "k", "n"):
            if not isinstance(row.get(f), int) or isinstance(row.get(f), bool) or row[f] < 1:
                raise _bad(where, f"{label} has {f} {row.get(f)!r} (a positive integer)")
        if row.get("role") not in ROLES:
            raise _bad(where, f"{label} has role {row.get('role')!r} (one of {', '.join(ROLES)})")
        _check_cells(where, row.get("candidates"), label)
        unknown = set(row["candidates"]) - set(LINEAR_CANDIDATES)
        if unknown:
            raise _bad(
                where, f"{label} has unknown candidates {sorted(unknown)} (known: {', '.join(LINEAR_CANDIDATES)})"
            )
    for i, row in enumerate(table.get("attention", [])):
        for f in ("d", "mask", "s_min", "s_max", "ref_err", "kernels"):
            if f not in row:
                raise _bad(where, f"attention[{i}] has no {f!r}")
        _check_cells(where, row["kernels"], f"attention[{i}]")
    return table


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> dict:
    try:
        table = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise _bad(path, f"invalid JSON ({e})") from e
    return validate(table, path)


def load(path) -> dict:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"tune table {str(path)!r} does not exist (write one with `fx-fp8 tune`)")
    return _load(str(p), p.stat().st_mtime)


def write(table: dict, path) -> Path:
    p = Path(path).expanduser()
    validate(table, str(p))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(table, indent=1) + "\n")
    return p


def shipped_tables() -> list[tuple[Path, dict]]:
    return [(p, load(p)) for p in sorted(SHIPPED_DIR.glob("*.json"))]


def key_mismatch(table_key: dict, key: dict, fields=KEY_FIELDS) -> Optional[str]:
    """Which field of the table's key differs from the device's, or None."""
    for f in fields:
        a, b = table_key.get(f), key.get(f)
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            return f"{f} {a!r} != this device's {b!r}"
    return None


_said: set = set()


def _ignored(path, why: str) -> None:
    if (str(path), why) not in _said:  # once per table and reason
        _said.add((str(path), why))
        log.info("fx_fp8: tune table %s ignored: %s", path, why)


def table_for(device, explicit=None) -> Optional[tuple[str, dict]]:
    """(where, table) that applies to `device`, or None (see the module's docstring)."""
    key = device_key(device)
    if explicit is not None:
        table = load(explicit)
        why = key_mismatch(table["key"], key)
        if why:
            _ignored(explicit, why)
            return None
        return str(explicit), table
    if key["gpu"] is None or key["gpu"] == "cpu":
        return None  # the cache and the shipped tables are GPU measurements
    cached = cache_dir() / file_name(key)
    if cached.is_file():
        try:
            table = load(cached)
            why = key_mismatch(table["key"], key)
        except ValueError as e:
            table, why = None, str(e)
        if why is None:
            return str(cached), table
        _ignored(cached, why)
    for path, table in shipped_tables():
        if key_mismatch(table["key"], key, SHIPPED_KEY_FIELDS) is None:
            return f"shipped {path.name}", table
    return None


def describe_source(where: str, table: dict) -> str:
    s, k = table["source"], table["key"]
    return f"{where}: {s['what']} ({s['date']}; torch {k['torch']}, Triton {k['triton']})"


# -- linears ---------------------------------------------------------------------------------
def emitted_candidates(qcfg, role: str) -> list[str]:
    """The candidates this config lets the linear pass emit for a linear of `role`."""
    wo = f"weight_only_{qcfg.weight_only_method or qcfg.method}"
    if role == "weight_only":
        return ["native", wo]
    if qcfg.method == "int8":
        w8a8 = "int8_rowwise"
    else:
        w8a8 = "fp8_block" if qcfg.weight_granularity == "block" else "fp8_rowwise"
    return ["native", w8a8, wo]


def _times_at(rows: list[dict], m: int) -> tuple[dict, str]:
    """({candidate: {"ms", "err"}} at M `m`, how: measured / interpolated / nearest) from rows of
    one K, N, dtype, role."""
    rows = sorted(rows, key=lambda r: r["m"])
    for r in rows:
        if r["m"] == m:
            return r["candidates"], f"measured at M {m}"
    below = [r for r in rows if r["m"] < m]
    above = [r for r in rows if r["m"] > m]
    if below and above:
        lo, hi = below[-1], above[0]
        t = (m - lo["m"]) / (hi["m"] - lo["m"])
        out = {}
        for name in set(lo["candidates"]) & set(hi["candidates"]):
            a, b = lo["candidates"][name], hi["candidates"][name]
            if a.get("ms") is None or b.get("ms") is None:
                continue
            err = max(a.get("err") or 0.0, b.get("err") or 0.0) if name != "native" else 0.0
            out[name] = {"ms": a["ms"] + t * (b["ms"] - a["ms"]), "err": err}
        return out, f"interpolated between M {lo['m']} and {hi['m']}"
    near = below[-1] if below else above[0]
    return near["candidates"], f"nearest measured M {near['m']}"


def linear_pick(
    table: dict, m: Optional[int], k: int, n: int, dtype: str, bias: bool, role: str, allowed: list[str]
) -> Optional[tuple[str, dict, str]]:
    """(candidate, {candidate: ms} of the allowed ones, how M was matched) for one linear, or None
    when the table has no row of this K, N, dtype and role (or M is symbolic)."""
    if m is None:
        return None
    rows = [r for r in table.get("linears", []) if (r["k"], r["n"], r.get("dtype"), r["role"]) == (k, n, dtype, role)]
    same_bias = [r for r in rows if bool(r.get("bias")) == bias]
    rows = same_bias or rows
    if not rows:
        return None
    cells, how = _times_at(rows, m)
    times = {c: cells[c]["ms"] for c in allowed if c in cells and cells[c].get("ms") is not None}
    native = times.get("native")
    ok = sorted(
        (ms, c)
        for c, ms in times.items()
        if c != "native" and cells[c].get("err") is not None and cells[c]["err"] <= LINEAR_ERR_MAX
    )
    if native is None:
        return (ok[0][1], times, how) if ok else None
    if ok and ok[0][0] < native * (1 - MIN_GAIN):
        return ok[0][1], times, how
    return "native", times, how


def follows_table(qcfg, lowering: str) -> bool:
    """Whether quantization_config.kernel "auto" consults a tune table under `lowering` (the
    lowering's name): on CUDA, or anywhere with an explicit tune_table."""
    return qcfg.kernel == "auto" and (lowering == "cuda" or qcfg.tune_table is not None)


def linear_decision(
    kind: str, why: Optional[str], x, w, has_bias: bool, qcfg, lowering: str, sensitive: bool = False
) -> tuple[str, Optional[str], dict]:
    """The linear pass's hook: shape_decision for a linear node's input `x` and weight `w` (fake
    values; the dtype looked up is the activations': a prepared layer's weight holds codes)."""
    from fx_fp8.graph.shapes import token_count

    return shape_decision(
        kind,
        why,
        token_count(x),
        int(w.shape[1]),
        int(w.shape[0]),
        str(x.dtype).replace("torch.", ""),
        x.device,
        has_bias,
        qcfg,
        lowering,
        sensitive,
    )


def shape_decision(
    kind: str,
    why: Optional[str],
    m: Optional[int],
    k: int,
    n: int,
    dtype: str,
    device,
    has_bias: bool,
    qcfg,
    lowering: str,
    sensitive: bool = False,
) -> tuple[str, Optional[str], dict]:
    """(kind, why, timing) for a linear the rules planned as `kind` ("quantized", "weight_only" or
    "native"), of M `m` (None: unknown or symbolic) x K `k` -> N `n` on activations of `dtype` on
    `device`. quantization_config.kernel "auto" follows the measured table of this device (on CUDA,
    or anywhere with an explicit tune_table); "rules" and an explicit `sensitive: fp8` keep the
    rules' plan. timing: {"pick": ms, "native": ms} when measured."""
    if kind == "native" or not follows_table(qcfg, lowering) or (sensitive and qcfg.sensitive == "fp8"):
        return kind, why, {}
    found = table_for(device, qcfg.tune_table)
    if found is None:
        return kind, _join(why, UNMEASURED), {}
    where, table = found
    role = "weight_only" if kind == "weight_only" else "w8a8"
    picked = linear_pick(table, m, k, n, dtype, has_bias, role, emitted_candidates(qcfg, role))
    if picked is None:
        if not table.get("linears"):
            return kind, _join(why, f"{UNMEASURED}: {where} has attention rows only"), {}
        return (
            kind,
            _join(
                why,
                f"not measured at this shape (fx-fp8 tune): {where} has no {role} row for K "
                f"{k} N {n} {dtype}{'' if m else ' (M symbolic)'}",
            ),
            {},
        )
    pick, times, how = picked
    listed = ", ".join(f"{c} {ms:.3f} ms" for c, ms in sorted(times.items(), key=lambda t: t[1]))
    if pick == "native":
        gain = f" (no FP8 candidate more than {MIN_GAIN:.0%} faster within the error bound)"
    else:
        gain = f" ({times['native'] / times[pick]:.2f}x native)" if "native" in times else ""
    text = f"tuned: {pick}{gain}; {listed} ({how}; {describe_source(where, table)})"
    new_kind = LINEAR_CANDIDATES[pick]
    timing = {"pick": times.get(pick), "native": times.get("native")}
    return new_kind, _join(why, text), timing


def _join(a: Optional[str], b: str) -> str:
    return f"{a}; {b}" if a else b
