#!/usr/bin/env python
"""How the sensitive linears should run: quantization_config.sensitive native / weight_only / fp8.

The sensitive linears (timestep / pooled embedders, adaLN modulation, final projection) are
measured three ways, and weight-only with several weight storages:

  --zoo    every zoo class (fx_fp8.tools.zoo, tiny random models, built with seed 0): relative
           error of the output vs the native model, mean over --inputs input seeds (size variant 1),
           FP8 W8A8 linears, attention native: the sensitive linears found once per class by the
           backend's structural analysis, then prepare_model per mode and an eager run (the same
           reference kernels as the compiled graph, one trace per class instead of one compile per
           mode); per class, how many linears each mode changes against sensitive: native;
           then mean / median / max per mode and the classes where a mode is worse than
           sensitive: native by more than --worse (relative).
  --tiny   the shipped tiny model, default config (FP8 attention + linears) with each mode:
           PSNR / SSIM against native over --num-prompts prompts x seeds (benchmarks/tiny_quality.py),
           or over a whole held-out set (--prompt-set heldout / confirm), with the per-image
           difference to the first mode (paired).
  --bytes  live weight bytes after prepare_model on a bf16 Flux-like model (width 3072,
           --double + --single blocks; benchmarks/linear_memory.py's model), as a fraction of bf16.

    python benchmarks/sensitive_modes.py --zoo --tiny --bytes          # everything (15-30 min on 2 shared cores)
    python benchmarks/sensitive_modes.py --zoo --models flux wan sd3 --inputs 1
    python benchmarks/sensitive_modes.py --tiny --num-prompts 4 --modes native wo-int8-ch
    python benchmarks/sensitive_modes.py --tiny --prompt-set heldout --modes native wo-int8-g32
    python benchmarks/sensitive_modes.py --zoo --models <half of the classes> > a.txt   # (and the other half > b.txt)
    python benchmarks/sensitive_modes.py --merge a.txt b.txt                            # one table from both

Nothing is written to RESULTS.md: the tables are printed (copy them into a dated section).
"""

from __future__ import annotations

import argparse
from copy import deepcopy
import os
import statistics
import sys
import time
import warnings

import torch
from tabulate import tabulate

import fx_fp8
from fx_fp8.tools.model_zoo import registry as zoo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from defaults_zoo import rel_err  # noqa: E402  (one definition of the error)

#: mode -> quantization_config keys. "wo-<storage>-<scales>": sensitive: weight_only with FP8 or
#: INT8 weights, one scale per output channel ("ch") or per output channel and g input columns ("g<g>").
#: Every key is given: the modes do not move when the defaults do (the default is wo-int8-g32).
MODES = {
    "native": {"sensitive": "native"},
    "wo-fp8-ch": {"sensitive": "weight_only", "weight_only_method": "fp8", "weight_only_group_size": None},
    "wo-fp8-g32": {"sensitive": "weight_only", "weight_only_method": "fp8", "weight_only_group_size": 32},
    "wo-int8-ch": {"sensitive": "weight_only", "weight_only_method": "int8", "weight_only_group_size": None},
    "wo-int8-g128": {"sensitive": "weight_only", "weight_only_method": "int8", "weight_only_group_size": 128},
    "wo-int8-g32": {"sensitive": "weight_only", "weight_only_method": "int8", "weight_only_group_size": 32},
    "wo-int8-g16": {"sensitive": "weight_only", "weight_only_method": "int8", "weight_only_group_size": 16},
    "fp8": {"sensitive": "fp8"},
}
#: at zoo widths (16-64 features) a 128-column group is one group per channel: same as "ch"
ZOO_MODES = ["native", "wo-fp8-ch", "wo-int8-g32", "wo-int8-g16", "fp8"]
TINY_MODES = ["native", "wo-fp8-ch", "wo-int8-ch", "wo-int8-g32", "wo-int8-g16", "fp8"]
BYTES_MODES = ["native", "wo-fp8-ch", "wo-int8-ch", "wo-int8-g128", "wo-int8-g32", "wo-int8-g16", "fp8"]


def linear_actions(compiled) -> dict[str, str]:
    """module -> action of every linear row of the compiled model's reports."""
    return {e.module: e.action for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == "linear"}


# -- zoo ---------------------------------------------------------------------------------------
def zoo_class(name: str, modes: list[str], n_inputs: int, min_features=None) -> dict:
    """One zoo class: the sensitive linears found once by structure (one Dynamo trace, as the backend
    finds them), then per mode a copy of the model through prepare_model, run eagerly (its
    QuantizedLinear modules call the same reference kernels as the compiled graph; attention native)."""
    from fx_fp8.graph.sensitive import sensitive_linear_names

    model = zoo.build(name, seed=0)
    inputs = [zoo.make_inputs(name, model, seed=s, variant=1) for s in range(n_inputs)]
    with torch.no_grad():
        natives = [zoo.output_tensor(model(**kw)) for kw in inputs]
    sensitive = sensitive_linear_names(model, (), inputs[0])
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    row = {"model": name, "err": {}, "changed": {}, "linears": len(linears)}
    base = None
    for mode in modes:
        qc = dict(MODES[mode])
        if min_features is not None:
            qc["min_features"] = min_features
        copy = deepcopy(model)
        res = fx_fp8.prepare_model(
            copy,
            {"quantization": "fp8", "diffusion_kv_cache_dtype": None, "quantization_config": qc},
            sensitive=sensitive,
        )
        wo = set(res["weight_only"])
        actions = {n: "weight-only" if n in wo else "w8a8" if n in res["quantized"] else "native" for n in linears}
        try:
            with torch.no_grad():
                errs = [rel_err(zoo.output_tensor(copy(**kw)), ref) for kw, ref in zip(inputs, natives)]
            row["err"][mode] = sum(errs) / len(errs)
        except Exception as e:  # one mode failing must not lose the sweep: reported in the table
            row["err"][mode] = None
            row.setdefault("errors", {})[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if base is None:
            base = actions
            row["w8a8"] = sum(1 for a in actions.values() if a != "native")
        row["changed"][mode] = sum(1 for n, a in actions.items() if a != base[n])
    return row


def zoo_tables(rows: list[dict], modes: list[str], worse: float) -> str:
    ref = modes[0]
    per_class = []
    for r in rows:
        cells = [r["model"], f"{r['w8a8']}/{r['linears']}"]
        for m in modes:
            e = r["err"][m]
            shown = "error" if e is None else f"{e:.3g}"
            cells.append(shown if m == ref else f"{shown} ({r['changed'][m]})")
        per_class.append(cells)
    out = [
        tabulate(
            per_class,
            headers=["class", f"W8A8 linears ({ref})"] + [m if m == ref else f"{m} (layers changed)" for m in modes],
            tablefmt="github",
        )
    ]
    failed = [f"{r['model']} {m}: {why}" for r in rows for m, why in r.get("errors", {}).items()]
    rows = [r for r in rows if None not in r["err"].values()]  # the statistics compare complete rows only
    summary = []
    for m in modes:
        errs = [r["err"][m] for r in rows]
        if not errs:
            continue
        touched = [r for r in rows if r["changed"][m]]
        ratios = [r["err"][m] / r["err"][ref] for r in touched if r["err"][ref] > 0]
        bad = [r["model"] for r in touched if r["err"][m] > (1 + worse) * r["err"][ref]]
        better = [r["model"] for r in touched if r["err"][m] < r["err"][ref] / (1 + worse)]
        changed = [r["err"][m] for r in rows if any(r["changed"].values())]
        summary.append(
            [
                m,
                f"{statistics.mean(errs):.4g}",
                f"{statistics.median(errs):.4g}",
                f"{statistics.median(changed):.4g}" if changed else "-",
                f"{max(errs):.4g}",
                len(touched),
                f"{statistics.median(ratios):.3f}" if ratios else "-",
                f"{max(ratios):.2f}" if ratios else "-",
                len(bad),
                len(better),
                ", ".join(bad[:6]) + (" ..." if len(bad) > 6 else ""),
            ]
        )
    out.append(
        tabulate(
            summary,
            headers=[
                "mode",
                "mean err",
                "median err",
                "median err (classes any mode changes)",
                "max err",
                "classes changed",
                f"median err / {ref}'s",
                "max ratio",
                f"worse > {worse:.0%}",
                f"better > {worse:.0%}",
                "worse (first 6)",
            ],
            tablefmt="github",
        )
    )
    if failed:
        out.append("failed (left out of the statistics):\n" + "\n".join(f"- {f}" for f in failed))
    return "\n\n".join(out)


def parse_zoo_output(path: str) -> tuple[list[str], list[dict]]:
    """(modes, rows) back from the per-class table a --zoo run printed (for --merge)."""
    modes, rows = None, []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| class"):
            if modes is not None:
                break
            modes = [c.split(" (")[0] for c in cells[2:]]
            continue
        if modes is None or not line.startswith("| ") or set(cells[0]) <= {"-"}:
            if modes is not None and rows and not line.startswith("|"):
                break
            continue
        row = {"model": cells[0], "err": {}, "changed": {}}
        row["w8a8"], row["linears"] = (int(v) for v in cells[1].split("/"))
        for m, c in zip(modes, cells[2:]):
            value, _, changed = c.partition(" (")
            row["err"][m] = None if value == "error" else float(value)
            row["changed"][m] = int(changed.rstrip(")")) if changed else 0
            if value == "error":
                row.setdefault("errors", {})[m] = "failed (see the run's output)"
        rows.append(row)
    if modes is None:
        raise SystemExit(f"--merge: no per-class zoo table in {path}")
    return modes, rows


# -- tiny model --------------------------------------------------------------------------------
def paired(diffs) -> str:
    """mean +- 2 standard errors of per-image differences (a change is measurable when 0 is outside)."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    se = d.std(ddof=1) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return f"{d.mean():+.3g} +- {2 * se:.2g}"


def tiny_table(modes: list[str], num_prompts: int, steps: int | None, prompt_set: str = "tuning") -> str:
    import numpy as np

    import tiny_quality as tq
    from fx_fp8.tools.image_metrics import compare_images
    from fx_fp8.tools.tiny_model import DEFAULT_NUM_INFERENCE_STEPS, load_tiny_pipeline

    steps = steps or DEFAULT_NUM_INFERENCE_STEPS
    from fx_fp8.tools.tiny_model.prompt_sets import prompt_cases

    # the tuning set's first num_prompts cases; a held-out set is taken whole
    cases = tq.prompts_and_seeds(num_prompts) if prompt_set == "tuning" else prompt_cases(prompt_set)
    num_prompts = len(cases)
    pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    native = tq.generate(pipe, cases, steps)
    base = fx_fp8.FP8Config()
    rows, first = [], None
    for mode in modes:
        torch._dynamo.reset()
        fx_fp8.clear_reports()
        pipe = load_tiny_pipeline()
        pipe.set_progress_bar_config(disable=True)
        fx_fp8.compile_pipeline(pipe, base.replace(quantization_config=MODES[mode]), backend="fp8")
        scores = [compare_images(ref, img) for ref, img in zip(native, tq.generate(pipe, cases, steps))]
        psnr = np.minimum([sc["psnr"] for sc in scores], 99.0)
        ssim = np.array([sc["ssim"] for sc in scores])
        summary = [x for x in fx_fp8.get_reports() if x.step_variant in (None, "fp8")][-1].summary()
        w8a8 = sum(n for a, n in summary["linear"].items() if a not in ("native", "weight-only"))
        first = first or (mode, psnr, ssim)
        ok = "yes" if psnr.mean() >= tq.TARGET_PSNR and ssim.mean() >= tq.TARGET_SSIM else "no"
        rows.append(
            [
                mode,
                f"{w8a8}/{sum(summary['linear'].values())}",
                summary["linear"].get("weight-only", 0),
                f"{psnr.mean():.2f}",
                f"{psnr.min():.2f}",
                f"{ssim.mean():.4f}",
                f"{ssim.min():.4f}",
                ok,
                paired(psnr - first[1]) if mode != first[0] else "-",
                paired(ssim - first[2]) if mode != first[0] else "-",
            ]
        )
        print(f"tiny {mode}: {psnr.mean():.2f} dB, SSIM {ssim.mean():.4f}", file=sys.stderr, flush=True)
    return (
        f"{num_prompts} {prompt_set} prompts x seeds, {steps} steps, default config (FP8 attention + FP8 linears) with each "
        f"mode, against the native model; paired = per-image difference to {modes[0]}, mean +- 2 SE\n\n"
        + tabulate(
            rows,
            headers=[
                "mode",
                "W8A8 linears",
                "weight-only",
                "PSNR dB (mean)",
                "PSNR min",
                "SSIM (mean)",
                "SSIM min",
                "meets 30 dB / 0.97",
                f"paired dPSNR vs {modes[0]}",
                f"paired dSSIM vs {modes[0]}",
            ],
            tablefmt="github",
        )
    )


# -- bytes -------------------------------------------------------------------------------------
def bytes_table(modes: list[str], double: int, single: int) -> str:
    from linear_memory import build_flux

    rows = []
    for mode in modes:
        model = build_flux(double, single)
        before = fx_fp8.reachable_tensor_bytes(model)
        res = fx_fp8.prepare_model(
            model, {"quantization": "fp8", "diffusion_kv_cache_dtype": "fp8", "quantization_config": MODES[mode]}
        )
        after = fx_fp8.reachable_tensor_bytes(model)
        rows.append(
            [
                mode,
                len(res["quantized"]) - len(res["weight_only"]),
                len(res["weight_only"]),
                f"{before / 2**20:.1f}",
                f"{after / 2**20:.1f}",
                f"{after / before:.3f}",
            ]
        )
        print(f"bytes {mode}: {after / before:.3f}", file=sys.stderr, flush=True)
        del model
    params = "width 3072, %d double + %d single blocks, bf16" % (double, single)
    return f"live weight bytes after prepare_model (Flux-like, {params})\n\n" + tabulate(
        rows,
        headers=["mode", "W8A8 linears", "weight-only", "MiB before", "MiB after", "after / before"],
        tablefmt="github",
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", action="store_true", help="the zoo sweep (relative error)")
    p.add_argument("--tiny", action="store_true", help="the shipped tiny model (PSNR / SSIM)")
    p.add_argument("--bytes", action="store_true", help="live weight bytes on a bf16 Flux-like model")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=None,
        help="modes to measure (default: per part; with --zoo the first is the reference: 'native')",
    )
    p.add_argument("--models", nargs="+", default=None, help="zoo classes (default: all)")
    p.add_argument("--inputs", type=int, default=3, help="zoo input seeds per class (the error is their mean)")
    p.add_argument(
        "--min-features",
        type=int,
        default=None,
        help="zoo: quantization_config.min_features (default the config's, 32; 16 makes more linears eligible)",
    )
    p.add_argument("--worse", type=float, default=0.10, help="zoo: 'worse' means error > (1 + this) x native's")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument(
        "--prompt-set",
        choices=("tuning", "heldout", "confirm"),
        default="tuning",
        help="--tiny: the tuning set's first --num-prompts cases, or a whole held-out set",
    )
    p.add_argument("--num-inference-steps", type=int, default=None)
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="OUTPUT",
        default=None,
        help="print the zoo tables of several --zoo runs' saved outputs (e.g. halves of the classes "
        "run in parallel) as one; measures nothing",
    )
    args = p.parse_args(argv)
    if args.merge:
        modes, rows = None, []
        for path in args.merge:
            m, r = parse_zoo_output(path)
            if modes is not None and m != modes:
                raise SystemExit(f"--merge: {path} has modes {m}, the first output {modes}")
            modes, rows = m, rows + r
        print(f"## zoo: {len(rows)} classes (merged from {len(args.merge)} runs)\n")
        print(zoo_tables(rows, modes, args.worse))
        return 0
    if not (args.zoo or args.tiny or args.bytes):
        p.error("give at least one of --zoo, --tiny, --bytes")
    if args.zoo and args.modes is not None and args.modes[0] != "native":
        p.error(f"--zoo: --modes must start with 'native' (the reference), got {args.modes[0]!r}")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    start = time.time()
    if args.zoo:
        modes = args.modes or ZOO_MODES
        rows = []
        for name in args.models or zoo.names():
            t = time.time()
            rows.append(zoo_class(name, modes, args.inputs, args.min_features))
            errs = " ".join("-" if e is None else f"{e:.3g}" for e in rows[-1]["err"].values())
            print(f"zoo {name}: {errs} ({time.time() - t:.1f} s)", file=sys.stderr, flush=True)
        print(
            f"## zoo: {len(rows)} classes, {args.inputs} input seeds, FP8 linears (prepare_model, eager; "
            f"attention native), min_features "
            f"{args.min_features or 32}, error vs native model (layers changed: linears that run differently "
            f"from {(args.modes or ZOO_MODES)[0]})\n"
        )
        print(zoo_tables(rows, modes, args.worse) + "\n")
    if args.tiny:
        print(
            "## tiny model: "
            + tiny_table(args.modes or TINY_MODES, args.num_prompts, args.num_inference_steps, args.prompt_set)
            + "\n"
        )
    if args.bytes:
        print("## bytes: " + bytes_table(args.modes or BYTES_MODES, args.double, args.single) + "\n")
    print(f"{time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
