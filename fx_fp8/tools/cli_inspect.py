"""`fx-fp8 inspect` and `fx-fp8 dump`: compile the transformer on example inputs and show (or
write) what fx_fp8 did with every attention and linear node, and the graphs before and after
each pass."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from fx_fp8.tools.cli_common import (
    PROG,
    Placement,
    UsageError,
    _check_dir,
    _check_source,
    _choose_config,
    _config,
    _placement,
    _source,
    to_json,
)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


#: the run the example call stands in for, when no --steps is given (compare's default)
DEFAULT_STEPS = 8


def compile_and_report(
    source,
    config,
    *,
    backend: str = "fp8",
    dump_graphs: bool = False,
    steps: int = DEFAULT_STEPS,
    placement: Placement = None,
    config_source: str = "the library default",
) -> dict:
    """Compile the transformer, loaded in `placement`'s dtype on its device (CPU float32 when None),
    on example inputs (fullgraph) and collect what fx_fp8 did. The call is published as step 0 of a
    run of `steps` steps (step selectors counting from the end need the run's number of steps)."""
    import torch

    import fx_fp8

    if placement is None:
        placement = Placement("cpu", torch.float32)
    model = source.load_transformer(placement.dtype).to(placement.device)
    kwargs = source.example_inputs(model)
    bytes_before = fx_fp8.reachable_tensor_bytes(model)
    torch._dynamo.reset()
    fx_fp8.clear_reports()
    options = {"config": config}
    if dump_graphs:
        options["dump_graphs"] = True
    for fullgraph in (True, False):
        compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, options=options)
        try:
            with torch.no_grad(), fx_fp8.denoising_step(0, total=steps):  # no warning with skip steps; last:k placed
                compiled(**kwargs)
            break
        except torch._dynamo.exc.Unsupported as e:
            if not fullgraph:
                raise
            # e.g. Z-Image's rotary cache (`with torch.device(...)`): report every graph instead
            print(
                f"{PROG}: note: {source.class_name} has graph breaks ({str(e).splitlines()[0]}); "
                "compiled without fullgraph",
                file=sys.stderr,
            )
            torch._dynamo.reset()
            fx_fp8.clear_reports()
    reports = fx_fp8.get_reports()
    component = fx_fp8.summary(compiled)[0]
    component.component = "transformer"
    primary = [r for r in reports if r.step_variant in (None, "fp8")]
    q_before = sum(r.weights.get("quantized_linear_bytes_before", 0) for r in primary)
    q_after = sum(r.weights.get("quantized_linear_bytes_after", 0) for r in primary)
    totals = {op: {"fp8": 0, "native": 0} for op in ("attention", "linear")}
    for r in primary:
        for op, counts in r.summary().items():
            for action, n in counts.items():  # fp8, int8, native
                totals[op][action] = totals[op].get(action, 0) + n
    timed = [e.timing for r in primary for e in r.entries if e.timing.get("native") is not None]
    data = {
        "model": source.spec,
        "class": source.class_name,
        "device": placement.device,
        "dtype": placement.dtype_name,
        "config_source": config_source,
        "config": config.to_dict(),
        "graphs": [dict(r.to_dict(), graph_index=i) for i, r in enumerate(reports)],
        "component_summary": [component.__dict__.copy()],  # fx_fp8.summary's row (plain path: FP8 copies kept)
        "summary": {
            "graphs": len(reports),
            "step_variants": [r.step_variant or "single" for r in reports],
            "steps": steps,  # the run the step selectors are placed in
            "skipped_steps": _skipped_steps(config, steps),
            "nodes": totals,  # over the graphs that run on non-skipped steps
            # the tune table's measured ms of every measured node: what it picked, and native
            "tuned": {
                "nodes": len(timed),
                "predicted_ms": sum(t["pick"] or t["native"] for t in timed),
                "native_ms": sum(t["native"] for t in timed),
                "lowerings": sorted({r.lowering for r in primary}),
            },
            "weights": {
                "model_bytes_before": bytes_before,
                "model_bytes_after": bytes_before - q_before + q_after,
                "quantized_linear_bytes_before": q_before,
                "quantized_linear_bytes_after": q_after,
            },
        },
    }
    graphs = {i: getattr(r, "graphs", None) for i, r in enumerate(reports)}
    return data, graphs


def _skipped_steps(config, steps: int) -> dict:
    """{"attention" / "linear": the steps their selector skips in a run of `steps` steps}."""
    out = {}
    if config.attention_step_skips:
        out["attention"] = str(config.diffusion_kv_cache_skip_steps.resolve(steps))
    if config.linear_step_skips:
        out["linear"] = str(config.quantization_config.skip_steps.resolve(steps))
    return out


def _check_steps(args) -> None:
    if args.steps < 1:
        raise UsageError(f"invalid --steps {args.steps}: expected a positive integer")


def _rows(graph: dict) -> list[tuple]:
    return [
        (e["module"], "" if e["layer"] is None else e["layer"], e["op"], e["action"], e["reason"], e["shapes"])
        for e in graph["entries"]
    ]


def format_inspect(data: dict) -> str:
    from tabulate import tabulate

    out = [
        f"model: {data['model']} ({data['class']})",
        f"ran on: device {data['device']}, dtype {data['dtype']}; config: {data['config_source']}",
    ]
    graphs = data["graphs"]
    shown = [g for g in graphs if g["step_variant"] in (None, "fp8")]
    for g in shown:
        variant = g["step_variant"] or "single"
        out.append(
            f"\ngraph {g['graph_index']} (step variant: {variant}; lowering {g['lowering']}, "
            f"downstream {g['downstream']}; layers {g['layer_map']})"
        )
        out.append(
            tabulate(_rows(g), headers=["module", "layer", "op", "action", "reason", "shapes"])
            if g["entries"]
            else "(no attention or linear nodes)"
        )
    s = data["summary"]
    out.append("\nsummary")
    actions = sorted({a for c in s["nodes"].values() for a in c}, key=lambda a: (a == "native", a))
    out.append(
        tabulate([(op, *(c.get(a, 0) for a in actions)) for op, c in s["nodes"].items()], headers=["op", *actions])
    )
    w = s["weights"]
    out.append(
        f"weights: model {_mib(w['model_bytes_before'])} -> {_mib(w['model_bytes_after'])} with prepare_model "
        f"(quantized linears {_mib(w['quantized_linear_bytes_before'])} -> "
        f"{_mib(w['quantized_linear_bytes_after'])})"
    )
    out.append(_predicted_line(s.get("tuned")))
    line = f"graphs: {s['graphs']} (step variants: {', '.join(s['step_variants'])})"
    for g in graphs:
        if g not in shown:
            c = g["summary"]
            parts = [
                f"{op} " + " / ".join(f"{n} {a}" for a, n in c[op].items() if n or a in ("fp8", "native"))
                for op in ("attention", "linear")
            ]
            line += f"; variant {g['step_variant']} (skipped steps): {', '.join(parts)}"
    out.append(line)
    if s.get("skipped_steps"):
        out.append(
            f"skipped steps in a run of {s['steps']} (--steps): "
            + "; ".join(f"{op} {sel or 'none'}" for op, sel in s["skipped_steps"].items())
        )
    for note in sorted({n for g in shown for n in g["notes"]}):
        out.append(f"note: {note}")
    return "\n".join(out)


def _predicted_line(tuned) -> str:
    """The model's predicted time by the tune table (sum over its measured nodes) next to native."""
    if not tuned or not tuned["nodes"]:
        if "cuda" in (tuned or {}).get("lowerings", []):
            return "predicted total: no node measured on this GPU (fx-fp8 tune)"
        return (
            "predicted total: none (no tune table applies to this lowering; quantization_config.tune_table names one)"
        )
    p, n = tuned["predicted_ms"], tuned["native_ms"]
    return (
        f"predicted total (fx-fp8 tune table): {p:.3f} ms over {tuned['nodes']} measured linears, native "
        f"{n:.3f} ms ({n / p:.2f}x)"
    )


def _inputs(args):
    """(source, config, where it came from, placement): every input checked before the work starts."""
    source = _source(args)
    config_source = _choose_config(args, source)  # the same rule as compare and sensitivity
    config = _config(args)
    _check_steps(args)
    placement = _placement(args)
    _check_source(source, pipeline=False)
    return source, config, config_source, placement


def format_summary(data: dict) -> str:
    """The compact view (--summary): fx_fp8.summary's table for the compiled transformer."""
    from fx_fp8.pipeline.summary import ComponentSummary, Summary

    rows = Summary(ComponentSummary(**row) for row in data["component_summary"])
    return "\n".join(
        [
            f"model: {data['model']} ({data['class']})",
            f"ran on: device {data['device']}, dtype {data['dtype']}; config: {data['config_source']}",
            "",
            rows.table(),
        ]
    )


def cmd_inspect(args) -> int:
    source, config, config_source, placement = _inputs(args)
    data, _ = compile_and_report(
        source, config, backend=args.backend, steps=args.steps, placement=placement, config_source=config_source
    )
    if args.summary:
        keep = ("model", "class", "device", "dtype", "config_source", "component_summary")
        print(to_json({k: data[k] for k in keep}) if args.format == "json" else format_summary(data))
    else:
        print(to_json(data) if args.format == "json" else format_inspect(data))
    return 0


_DUMP_FOLDER = re.compile(r"graph\d+_\w+")
_DUMP_FILE = re.compile(r"\d\d_\w+\.py")


def _remove_previous_dump(out: Path) -> int:
    """Delete what an earlier `dump` wrote in `out` (graph<i>_<variant>/NN_<stage>.py, report.json,
    report.txt), so a new dump never mixes with an old one; other files are left alone."""
    removed = 0
    for folder in out.iterdir():
        if folder.is_dir() and _DUMP_FOLDER.fullmatch(folder.name):
            for f in folder.iterdir():
                if f.is_file() and _DUMP_FILE.fullmatch(f.name):
                    f.unlink()
                    removed += 1
            if not any(folder.iterdir()):
                folder.rmdir()
    for name in ("report.json", "report.txt"):
        if (out / name).is_file():
            (out / name).unlink()
            removed += 1
    return removed


def cmd_dump(args) -> int:
    source, config, config_source, placement = _inputs(args)
    _check_dir("--out", args.out)
    data, graphs = compile_and_report(
        source,
        config,
        backend=args.backend,
        dump_graphs=True,
        steps=args.steps,
        placement=placement,
        config_source=config_source,
    )
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    removed = _remove_previous_dump(out)
    if removed:
        print(f"removed {removed} files of a previous dump in {out}", file=sys.stderr)
    written = []
    for i, g in enumerate(data["graphs"]):
        stages = graphs.get(i)
        if not stages:
            raise RuntimeError(
                "the backend attached no graph dumps (report.graphs): fx_fp8.compile.backend lacks dump_graphs?"
            )
        folder = out / f"graph{i}_{g['step_variant'] or 'single'}"
        folder.mkdir(exist_ok=True)
        for j, (stage, code) in enumerate(stages.items()):
            path = folder / f"{j:02d}_{stage}.py"
            path.write_text(code)
            written.append(path)
    (out / "report.json").write_text(to_json(data))
    (out / "report.txt").write_text(format_inspect(data) + "\n")
    written += [out / "report.json", out / "report.txt"]
    print(f"ran on: {placement.describe()}; config: {config_source}", file=sys.stderr)
    for p in written:
        print(p)
    print(
        f"{len(written)} files in {out} (TORCH_LOGS=\"+fx_fp8\" prints the same graphs through PyTorch logging)",
        file=sys.stderr,
    )
    return 0
