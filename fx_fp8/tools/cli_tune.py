"""`fx-fp8 tune`: every FP8 decision of the transformer measured on this GPU (fx_fp8.tune), a summary
table, and the per-GPU table `auto` follows (the cache folder's, and --out)."""

from __future__ import annotations

import sys

from fx_fp8.tools.cli_common import PROG, UsageError, _check_source, _config, _source, to_json

TUNE_HELP = (
    "Trace the transformer once on example inputs with fx_fp8's analysis, collect its distinct linear "
    "and attention shapes, and time every candidate fx_fp8 could emit for each on this GPU (native, FP8 "
    "W8A8 row-wise and block-scaled, weight-only INT8 / FP8, INT8 W8A8 where FP8 matrix units are "
    "missing, every attention kernel), compiled as the backend compiles them, with each candidate's "
    "error against native. The table goes to the per-user cache folder ($FX_FP8_TUNE_DIR, else "
    "$XDG_CACHE_HOME/fx_fp8/tune), where quantization_config.kernel: auto and attention.kernel: auto "
    "find it, and to --out. --dry-run runs it on the CPU with CPU timings (labelled so; not a GPU's), "
    "written to --out only."
)


def add_tune_flags(p) -> None:
    p.add_argument("--out", default=None, help="also write the table here (JSON)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU, CPU timings (not a GPU's): checks the run, decides nothing on a GPU",
    )
    p.add_argument(
        "--max-shapes",
        type=int,
        default=None,
        help="measure only the first N linear and N attention shapes (a time budget)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no shape after this many seconds (the largest shares of the model's work go first)",
    )
    p.add_argument("--format", choices=("table", "json"), default="table", help="summary as a table or the JSON table")


def _placed(source, dry_run: bool):
    """(model, example inputs) on the GPU in bf16, or on the CPU for a dry run."""
    import torch

    if dry_run:
        model = source.load_transformer()
        return model, source.example_inputs(model)
    if not torch.cuda.is_available():
        raise UsageError(
            "tune measures on a CUDA GPU and none is visible: run it on the GPU it is for, or give "
            "--dry-run to check the run with CPU timings"
        )
    model = source.load_transformer(dtype=torch.bfloat16).to("cuda")
    kwargs = source.example_inputs(model)
    moved = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value.to("cuda", dtype=torch.bfloat16 if value.is_floating_point() else value.dtype)
        moved[name] = value
    return model, moved


def cmd_tune(args) -> int:
    import fx_fp8
    from fx_fp8.tuning import format_summary

    source, config = _source(args), _config(args)
    if args.max_shapes is not None and args.max_shapes < 1:
        raise UsageError(f"invalid --max-shapes {args.max_shapes}: expected a positive integer")
    if args.budget is not None and not args.budget > 0:
        raise UsageError(f"invalid --budget {args.budget}: expected a positive number of seconds")
    _check_source(source, pipeline=False)
    model, kwargs = _placed(source, args.dry_run)
    table = fx_fp8.tune(
        model,
        kwargs,
        config=config,
        out=args.out,
        dry_run=args.dry_run,
        max_shapes=args.max_shapes,
        budget_s=args.budget,
    )
    print(to_json(table) if args.format == "json" else format_summary(table))
    for path in table["written"]:
        print(f"{PROG} tune: wrote {path}", file=sys.stderr)
    return 0
