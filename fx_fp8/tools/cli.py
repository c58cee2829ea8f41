"""`fx-fp8`: did FP8 apply, and where? Which layers and steps must stay native?

    fx-fp8 inspect     [--model tiny] [--format table|json]   one row per attention / linear node
    fx-fp8 dump        --out DIR                              graphs before/after each pass + report.json
    fx-fp8 compare     [--out compare.png]                    native vs FP8: latency, PSNR, SSIM, max abs error
                       [--ulysses-degree N --ring-degree N --cache-backend NAME --cache-config JSON]
    fx-fp8 sensitivity [--target-psnr 30]                     per-block/step sensitivity -> recommended YAML

`--model`: `tiny` (the shipped trained model, default), a family name (flux,
qwen-image, wan, z-image, sd3: random weights, no download) or a local diffusers
folder (pipeline folder or transformer folder). Config: `--config YAML` plus the
flags, which override it. Bad input (a model that cannot be loaded, a size the
pipeline cannot make, an output path that cannot be written) is found before the
work starts and exits with status 2 and one line on stderr.

`--format json` and the JSON files are strict JSON (RFC 8259): numbers that are
not finite, such as the PSNR of identical images, are written as the strings
"inf", "-inf" and "nan" (as in sensitivity.json).
"""
from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

PROG = "fx-fp8"


class UsageError(Exception):
    """Bad command-line input: exit status 2, one line on stderr."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one short line instead of the usage block
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- config flags -------------------------------------------------------------------------------
def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from fx_fp8.tools import cli_flags

    cli_flags.add_fp8_flags(p)  # --config, --quantization, --ignored-layers, --diffusion-kv-cache-*, --backend, ...


def _config(args):
    """FP8Config from --config and the flags (flags win)."""
    from fx_fp8.tools import cli_flags

    try:
        return cli_flags.config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _source(args):
    from fx_fp8.tools.model_source import ModelSourceError, resolve_model

    try:
        return resolve_model(args.model)
    except ModelSourceError as e:
        raise UsageError(str(e)) from None


def _check_source(source, *, pipeline: bool, args=None) -> None:
    """What the model can be found unable to do before loading it: inspect/dump need a loadable
    transformer with an example-input builder; compare/sensitivity a pipeline at --height/--width."""
    from fx_fp8.tools.model_source import ModelSourceError

    try:
        if pipeline:
            source.check_pipeline()
            source.check_size(args.height, args.width)
        else:
            source.check_transformer()
    except ModelSourceError as e:
        raise UsageError(str(e)) from None


# -- output paths: checked before the work starts -------------------------------------------------
def _check_dir(flag: str, path) -> None:
    from fx_fp8.tools import cli_flags

    try:
        cli_flags.check_output_dir(flag, path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_file(flag: str, path, suffixes=None, kind: str = "file") -> None:
    from fx_fp8.tools import cli_flags

    try:
        cli_flags.check_output_file(flag, path, suffixes, kind=kind)
    except ValueError as e:
        raise UsageError(str(e)) from None


# -- strict JSON ------------------------------------------------------------------------------------
def _strict(obj):
    """Non-finite floats -> "inf" / "-inf" / "nan"; tuples -> lists; numpy scalars -> Python."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        obj = float(obj)
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def to_json(obj) -> str:
    """Strict JSON text (no bare Infinity / NaN: those become the strings "inf", "-inf", "nan")."""
    return json.dumps(_strict(obj), indent=1, allow_nan=False)


def _quiet():
    """diffusers/transformers/torch chatter (deprecations, accelerate hints) is not our output."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")
    try:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
    except ImportError:
        pass
    try:  # diffusers' pipeline loading imports transformers' processors, which warn about torchvision
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
    except ImportError:
        pass


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- inspect / dump -----------------------------------------------------------------------------
def compile_and_report(source, config, *, backend: str = "fp8", dump_graphs: bool = False) -> dict:
    """Compile the transformer on example inputs (fullgraph) and collect what fx_fp8 did."""
    import torch

    import fx_fp8

    model = source.load_transformer()
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
            with torch.no_grad(), fx_fp8.denoising_step(0):  # a published step: no warning with skip steps
                compiled(**kwargs)
            break
        except torch._dynamo.exc.Unsupported as e:
            if not fullgraph:
                raise
            # e.g. Z-Image's rotary cache (`with torch.device(...)`): report every graph instead
            print(f"{PROG}: note: {source.class_name} has graph breaks ({str(e).splitlines()[0]}); "
                  "compiled without fullgraph", file=sys.stderr)
            torch._dynamo.reset()
            fx_fp8.clear_reports()
    reports = fx_fp8.get_reports()
    primary = [r for r in reports if r.step_variant in (None, "fp8")]
    q_before = sum(r.weights.get("quantized_linear_bytes_before", 0) for r in primary)
    q_after = sum(r.weights.get("quantized_linear_bytes_after", 0) for r in primary)
    totals = {op: {"fp8": 0, "native": 0} for op in ("attention", "linear")}
    for r in primary:
        for op, counts in r.summary().items():
            for action, n in counts.items():  # fp8, int8, native
                totals[op][action] = totals[op].get(action, 0) + n
    data = {
        "model": source.spec,
        "class": source.class_name,
        "config": config.to_dict(),
        "graphs": [dict(r.to_dict(), graph_index=i) for i, r in enumerate(reports)],
        "summary": {
            "graphs": len(reports),
            "step_variants": [r.step_variant or "single" for r in reports],
            "nodes": totals,   # over the graphs that run on non-skipped steps
            "weights": {"model_bytes_before": bytes_before,
                        "model_bytes_after": bytes_before - q_before + q_after,
                        "quantized_linear_bytes_before": q_before, "quantized_linear_bytes_after": q_after},
        },
    }
    graphs = {i: getattr(r, "graphs", None) for i, r in enumerate(reports)}
    return data, graphs


def _rows(graph: dict) -> list[tuple]:
    return [(e["module"], "" if e["layer"] is None else e["layer"], e["op"], e["action"], e["reason"], e["shapes"])
            for e in graph["entries"]]


def format_inspect(data: dict) -> str:
    from tabulate import tabulate

    out = [f"model: {data['model']} ({data['class']})"]
    graphs = data["graphs"]
    shown = [g for g in graphs if g["step_variant"] in (None, "fp8")]
    for g in shown:
        variant = g["step_variant"] or "single"
        out.append(f"\ngraph {g['graph_index']} (step variant: {variant}; lowering {g['lowering']}, "
                   f"downstream {g['downstream']}; layers {g['layer_map']})")
        out.append(tabulate(_rows(g), headers=["module", "layer", "op", "action", "reason", "shapes"])
                   if g["entries"] else "(no attention or linear nodes)")
    s = data["summary"]
    out.append("\nsummary")
    actions = sorted({a for c in s["nodes"].values() for a in c}, key=lambda a: (a == "native", a))
    out.append(tabulate([(op, *(c.get(a, 0) for a in actions)) for op, c in s["nodes"].items()],
                        headers=["op", *actions]))
    w = s["weights"]
    out.append(f"weights: model {_mib(w['model_bytes_before'])} -> {_mib(w['model_bytes_after'])} with prepare_model "
               f"(quantized linears {_mib(w['quantized_linear_bytes_before'])} -> "
               f"{_mib(w['quantized_linear_bytes_after'])})")
    line = f"graphs: {s['graphs']} (step variants: {', '.join(s['step_variants'])})"
    for g in graphs:
        if g not in shown:
            c = g["summary"]
            parts = [f"{op} " + " / ".join(f"{n} {a}" for a, n in c[op].items() if n or a in ("fp8", "native"))
                     for op in ("attention", "linear")]
            line += f"; variant {g['step_variant']} (skipped steps): {', '.join(parts)}"
    out.append(line)
    for note in sorted({n for g in shown for n in g["notes"]}):
        out.append(f"note: {note}")
    return "\n".join(out)


def cmd_inspect(args) -> int:
    source, config = _source(args), _config(args)
    _check_source(source, pipeline=False)
    data, _ = compile_and_report(source, config, backend=args.backend)
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
    source, config = _source(args), _config(args)
    _check_source(source, pipeline=False)
    _check_dir("--out", args.out)
    data, graphs = compile_and_report(source, config, backend=args.backend, dump_graphs=True)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    removed = _remove_previous_dump(out)
    if removed:
        print(f"removed {removed} files of a previous dump in {out}", file=sys.stderr)
    written = []
    for i, g in enumerate(data["graphs"]):
        stages = graphs.get(i)
        if not stages:
            raise RuntimeError("the backend attached no graph dumps (report.graphs): fx_fp8.backend lacks dump_graphs?")
        folder = out / f"graph{i}_{g['step_variant'] or 'single'}"
        folder.mkdir(exist_ok=True)
        for j, (stage, code) in enumerate(stages.items()):
            path = folder / f"{j:02d}_{stage}.py"
            path.write_text(code)
            written.append(path)
    (out / "report.json").write_text(to_json(data))
    (out / "report.txt").write_text(format_inspect(data) + "\n")
    written += [out / "report.json", out / "report.txt"]
    for p in written:
        print(p)
    print(f"{len(written)} files in {out} (TORCH_LOGS=\"+fx_fp8\" prints the same graphs through PyTorch logging)",
          file=sys.stderr)
    return 0


def _check_sizes(args) -> None:
    for name in ("steps", "prompts", "height", "width"):
        v = getattr(args, name)
        if v < 1:
            raise UsageError(f"invalid --{name} {v}: expected a positive integer")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- sensitivity ---------------------------------------------------------------------------------
def cmd_sensitivity(args) -> int:
    from tabulate import tabulate

    from fx_fp8.tools import cli_flags
    from fx_fp8.tools.model_source import ModelSourceError
    from fx_fp8.tools.sensitivity import run_sensitivity, save_chart

    config = _config(args)
    _check_sizes(args)
    edges = _step_edges(args, config)   # before the model source: bad flags fail fast
    source = _source(args)
    try:
        import matplotlib  # noqa: F401  (the chart)
    except ImportError:
        raise UsageError("sensitivity draws its chart with matplotlib, which is not installed: "
                         "pip install 'fx-fp8[cli]'") from None
    _check_source(source, pipeline=True, args=args)
    out = Path(args.out).expanduser()
    yaml_path = Path(args.yaml).expanduser() if args.yaml else out / "recommended.yaml"
    chart_path = Path(args.chart).expanduser() if args.chart else out / "sensitivity.png"
    _check_dir("--out", args.out)
    _check_file("--yaml" if args.yaml else "--out", args.yaml or yaml_path, kind="YAML")
    _check_file("--chart" if args.chart else "--out", args.chart or chart_path, cli_flags.chart_suffixes(),
                kind="chart")
    try:
        run = source.load_pipeline(prompts=args.prompts, height=args.height, width=args.width, seed=args.seed)
    except ModelSourceError as e:
        raise UsageError(str(e)) from None
    for p in (yaml_path, chart_path, out / "sensitivity.json"):
        p.parent.mkdir(parents=True, exist_ok=True)
    print(f"sensitivity of {source.spec}: {len(run.labels)} sample(s) x {args.steps} steps at {args.height}x{args.width}, "
          f"target {args.target_psnr:g} dB (PSNR of the final latents vs native)", file=sys.stderr, flush=True)
    res = run_sensitivity(run, config, steps=args.steps, target_psnr=args.target_psnr, yaml_path=yaml_path,
                          verify=not args.no_verify, step_policy=bool(edges), step_edges=edges or (1,))
    save_chart(res, chart_path)
    (out / "sensitivity.json").write_text(to_json(res.to_dict()))

    total = res.all_fp8.mse or 1.0
    native = set(res.native_items)
    rows = [(i.label, f"{i.psnr:.2f}", f"{100 * i.mse / total:.1f}", "native" if i.label in native else "fp8")
            for i in res.ranking()]
    print("ranking (one item in FP8 at a time; lower PSNR = more sensitive):")
    print(tabulate(rows, headers=["item", "PSNR alone (dB)", "MSE % of all-FP8", "recommended"]))
    if res.step_candidates:
        chosen = res.step_policy.label if res.step_policy is not None else None
        rows = [(c.label, f"{c.psnr:.2f}", f"{100 * c.fp8_work_fraction:.0f}", "chosen" if c.label == chosen else "")
                for c in res.step_candidates]
        print("\nstep policies (first and last k steps in higher precision):")
        print(tabulate(rows, headers=["policy", "PSNR (dB)", "FP8 FLOPs kept %", ""]))
    cfg = res.recommended
    qc = cfg.quantization_config
    print(f"\nall FP8:            {res.all_fp8.psnr:.2f} dB")
    if edges:
        print(f"step policy:        {res.step_policy.label if res.step_policy is not None else 'none'} "
              f"(diffusion_kv_cache_skip_steps '{cfg.diffusion_kv_cache_skip_steps}', quantization_config.skip_steps "
              f"'{qc.skip_steps}', skip_steps_mode {qc.skip_steps_mode})")
    print(f"recommended config: skip layers '{','.join(map(str, sorted(cfg.diffusion_kv_cache_skip_layers)))}', "
          f"skip steps '{','.join(map(str, sorted(cfg.diffusion_kv_cache_skip_steps)))}', ignored_layers "
          f"{list(cfg.quantization_config.ignored_layers) if cfg.quantization_config.ignored_layers is not None else 'defaults'}")
    print(f"predicted PSNR:     {res.predicted_psnr:.2f} dB")
    print(f"re-measured PSNR:   {res.measured_psnr:.2f} dB ({'meets' if res.measured_psnr >= res.target_psnr else 'MISSES'} "
          f"the {res.target_psnr:g} dB target)")
    print(f"FP8 kept:           {100 * res.fp8_work_fraction:.1f}% of the all-FP8 FLOPs "
          f"({len(res.native_items)} of {len(res.items)} items native)")
    runs = len(res.items) + 2 + len(res.history) - 1 + sum(1 for c in res.step_candidates if c.seconds > 0)
    print(f"measurements:       {runs} runs in {res.seconds:.1f} s")
    print(f"wrote {yaml_path} (use: --config {yaml_path}), {chart_path}, {out / 'sensitivity.json'}")
    return 0 if res.measured_psnr >= res.target_psnr else 1


def _step_edges(args, config) -> tuple:
    """--step-policy K[,K...]: the k values (first and last k steps), checked against --steps and
    the base config (the search starts from no step policy)."""
    if args.step_policy is None:
        return ()
    try:
        edges = tuple(int(k) for k in args.step_policy.split(","))
    except ValueError:
        raise UsageError(f"invalid --step-policy {args.step_policy!r}: expected k values like '1,2'") from None
    from fx_fp8.tools.sensitivity import _check_step_edges

    try:
        _check_step_edges(edges, args.steps)
    except ValueError as e:
        raise UsageError(f"invalid --step-policy {args.step_policy!r}: {e}") from None
    for key, sel in (("--diffusion-kv-cache-skip-steps", config.diffusion_kv_cache_skip_steps),
                     ("--quantization-skip-steps", config.quantization_config.skip_steps)):
        if list(sel):
            raise UsageError(f"--step-policy searches the step policy itself: drop {key} {str(sel)!r} "
                             f"(or the YAML key) from the base config")
    return edges


# -- parser ----------------------------------------------------------------------------------------
JSON_HELP = ("table or json (strict JSON: infinite / NaN numbers, e.g. the PSNR of identical images, are "
             "written as the strings \"inf\", \"-inf\", \"nan\")")
SENSITIVITY_HELP = """\
Measure how much FP8 in each block's attention, each block's linears and each
denoising step's attention changes the final latents, rank them, and search the
smallest set kept native that reaches --target-psnr.

Method: one item quantized at a time (everything else native), not one left out:
each measurement is then a clean error owned by one item, and independent
quantization errors add up, so the isolated errors predict any candidate config
(calibrated by one all-FP8 run). Greedy search: keep native the item with the
largest predicted error reduction per FP8 FLOP given up until the predicted PSNR
reaches the target, run that config, recalibrate and continue if it misses.
The recommended config is written as YAML (load it with --config or
fx_fp8.compile_pipeline) and re-measured through compile_pipeline. Exit status 1
if the re-measured PSNR misses the target. Progress goes to stderr.

--step-policy first measures step policies (the first and last k steps with
attention native and/or linears weight-only or native) and takes the one that
keeps the most FP8 FLOPs while meeting the target; the layer search starts from
it and the YAML carries its keys (diffusion_kv_cache_skip_steps,
quantization_config.skip_steps, skip_steps_mode).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{inspect,dump,compare,sensitivity}")
    sub.required = True

    def common(p):
        p.add_argument("--model", default="tiny",
                       help="'tiny' (shipped trained model, default), a family (flux, qwen-image, wan, z-image, sd3; "
                            "random weights) or a local diffusers pipeline/transformer folder")
        _add_config_flags(p)

    def run_flags(p, steps: int, prompts: int):
        p.add_argument("--steps", type=int, default=steps, help=f"denoising steps (default {steps})")
        p.add_argument("--prompts", type=int, default=prompts,
                       help=f"prompts (tiny, local folders) or samples (families) (default {prompts})")
        p.add_argument("--height", type=int, default=32)
        p.add_argument("--width", type=int, default=32)
        p.add_argument("--seed", type=int, default=0)

    kw = dict(allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p = sub.add_parser("inspect", help="one row per attention / linear node: FP8 or native, and why", **kw,
                       description="Compile the transformer on example inputs (backend fp8, fullgraph) and print "
                                   "what fx_fp8 did with every attention and linear node, then a summary.")
    common(p)
    p.add_argument("--format", choices=("table", "json"), default="table", help=JSON_HELP)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("dump", help="graph code before/after each pass and per step variant, plus report.json", **kw,
                       description="Write the FX graph as readable Python before and after each fx_fp8 pass, for "
                                   "each step variant, plus the report (JSON and table). The same graphs reach "
                                   "PyTorch logging with TORCH_LOGS=\"+fx_fp8\".")
    common(p)
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_dump)

    p = sub.add_parser("compare", help="native vs FP8 pipeline: latency, PSNR, SSIM, max abs error, side-by-side PNG",
                       **kw, description="Run the pipeline natively and with fx_fp8.compile_pipeline, same seeds; "
                                         "print latency, image PSNR/SSIM and the final latents' max abs error.")
    common(p)
    run_flags(p, steps=8, prompts=2)
    from fx_fp8.tools import cli_flags as _flags

    _flags.add_pipeline_flags(p)
    p.add_argument("--out", default=None, help="side-by-side PNG (native | FP8 | difference)")
    p.add_argument("--format", choices=("table", "json"), default="table", help=JSON_HELP)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("sensitivity", help="per-block / per-step FP8 sensitivity and a recommended config", **kw,
                       description=SENSITIVITY_HELP)
    common(p)
    run_flags(p, steps=8, prompts=2)
    p.add_argument("--target-psnr", type=float, default=30.0,
                   help="PSNR (dB) of the final latents vs native that the recommendation must reach (default 30)")
    p.add_argument("--out", default="fx_fp8_sensitivity", help="output folder (default fx_fp8_sensitivity/)")
    p.add_argument("--yaml", default=None, help="recommended config path (default OUT/recommended.yaml)")
    p.add_argument("--chart", default=None, help="chart path (default OUT/sensitivity.png)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the final re-measurement through compile_pipeline (the in-process one still runs)")
    p.add_argument("--step-policy", nargs="?", const="1,2", default=None, metavar="K[,K...]",
                   help="also propose a step policy: the first and last K steps in higher precision (attention "
                        "native, linears weight-only or native, or both), chosen before the layers and written "
                        "into the YAML (K values default 1,2)")
    p.set_defaults(func=cmd_sensitivity)
    return parser


def _cmd_compare(args) -> int:
    from fx_fp8.tools.cli_compare import cmd_compare  # its own module: it imports this one's helpers

    return cmd_compare(args)


def main(argv: Optional[list] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _quiet()
        return args.func(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        from fx_fp8.tools.model_source import ModelSourceError

        if not isinstance(e, ModelSourceError):
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)   # a model that fails to load
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `fx-fp8 inspect | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
