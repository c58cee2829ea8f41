"""`fx-fp8`: did FP8 apply, and where? Which layers and steps must stay native?

    fx-fp8 inspect     [--model tiny] [--format table|json]   one row per attention / linear node
                       [--summary]                            (or one compact row: fx_fp8.summary)
                       [--steps N]                            (the run last:k step selectors count in)
    fx-fp8 dump        --out DIR [--steps N]                  graphs before/after each pass + report.json
    fx-fp8 compare     [--out compare.png]                    native vs FP8: latency, PSNR, SSIM, max abs error
                       [--ulysses-degree N --ring-degree N --cache-backend NAME --cache-config JSON]
    fx-fp8 sensitivity [--target-psnr 30]                     per-block/step sensitivity -> recommended YAML
    fx-fp8 tune        [--out table.json] [--dry-run]         every FP8 decision timed on this GPU -> table auto follows

`--model`: `tiny` (the shipped trained model, default), a family name (flux,
qwen-image, wan, z-image, sd3: random weights, no download) or a local diffusers
folder (pipeline folder or transformer folder). Config, the same rule for every
command: `--config YAML`, else the model folder's own `fx_fp8.yaml` (the shipped
tiny model has one), else the library default (`--library-default` skips the
model's own); the flags override it. `--device` / `--dtype`: where the model is
loaded and run, CPU float32 by default (`--device cuda --dtype bfloat16` on a
GPU). Every command prints the device, dtype and config it used. Bad input (a model that cannot be loaded, a size the
pipeline cannot make, an output path that cannot be written) is found before the
work starts and exits with status 2 and one line on stderr.

`--format json` and the JSON files are strict JSON (RFC 8259): numbers that are
not finite, such as the PSNR of identical images, are written as the strings
"inf", "-inf" and "nan" (as in sensitivity.json).

This module is the parser and the entry point; each command lives in its own
module (cli_inspect: inspect and dump; cli_compare; cli_sensitivity; cli_tune), and what
they share (UsageError, input checks, strict JSON) in cli_common.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional

from fx_fp8.tools.cli_common import PROG, UsageError, _one_line
from fx_fp8.tools.cli_compare import cmd_compare
from fx_fp8.tools.cli_inspect import cmd_dump, cmd_inspect
from fx_fp8.tools.cli_sensitivity import SENSITIVITY_HELP, cmd_sensitivity
from fx_fp8.tools.cli_tune import TUNE_HELP, add_tune_flags, cmd_tune


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one short line instead of the usage block
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- config flags -------------------------------------------------------------------------------
def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from fx_fp8.tools import cli_flags

    cli_flags.add_fp8_flags(p)  # --config, --quantization, --ignored-layers, --diffusion-kv-cache-*, --backend, ...


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


# -- parser ----------------------------------------------------------------------------------------
JSON_HELP = (
    "table or json (strict JSON: infinite / NaN numbers, e.g. the PSNR of identical images, are "
    "written as the strings \"inf\", \"-inf\", \"nan\")"
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{inspect,dump,compare,sensitivity,tune}")
    sub.required = True

    def common(p):
        p.add_argument(
            "--model",
            default="tiny",
            help="'tiny' (shipped trained model, default), a family (flux, qwen-image, wan, z-image, sd3; "
            "random weights) or a local diffusers pipeline/transformer folder",
        )
        _add_config_flags(p)
        p.add_argument(
            "--library-default",
            action="store_true",
            help="start from the library's default config, not the model folder's own fx_fp8.yaml (the "
            "shipped tiny model has one, which the examples use too)",
        )
        from fx_fp8.tools import cli_flags

        cli_flags.add_device_flags(p)

    def run_flags(p, steps: int, prompts: int):
        p.add_argument("--steps", type=int, default=steps, help=f"denoising steps (default {steps})")
        p.add_argument(
            "--prompts",
            type=int,
            default=prompts,
            help=f"prompts (tiny, local folders) or samples (families) (default {prompts})",
        )
        p.add_argument("--height", type=int, default=32)
        p.add_argument("--width", type=int, default=32)
        p.add_argument("--seed", type=int, default=0)

    def run_length(p):  # inspect / dump compile on one call: the run it stands in is --steps long
        p.add_argument(
            "--steps",
            type=int,
            default=8,
            help="the run's number of denoising steps (default 8, as compare), which step selectors "
            "counting from the end (last:k) need: the example call is step 0 of such a run",
        )

    kw = dict(allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p = sub.add_parser(
        "inspect",
        help="one row per attention / linear node: FP8 or native, and why",
        **kw,
        description="Compile the transformer on example inputs (backend fp8, fullgraph) and print "
        "what fx_fp8 did with every attention and linear node, then a summary.",
    )
    common(p)
    run_length(p)
    p.add_argument("--format", choices=("table", "json"), default="table", help=JSON_HELP)
    p.add_argument(
        "--summary",
        action="store_true",
        help="one compact row instead of one per node (fx_fp8.summary): FP8 attention and W8A8 "
        "linears n/m, weight-only, native with the top reasons, weight bytes, kernels",
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "dump",
        help="graph code before/after each pass and per step variant, plus report.json",
        **kw,
        description="Write the FX graph as readable Python before and after each fx_fp8 pass, for "
        "each step variant, plus the report (JSON and table). The same graphs reach "
        "PyTorch logging with TORCH_LOGS=\"+fx_fp8\".",
    )
    common(p)
    run_length(p)
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_dump)

    p = sub.add_parser(
        "compare",
        help="native vs FP8 pipeline: latency, PSNR, SSIM, max abs error, side-by-side PNG",
        **kw,
        description="Run the pipeline natively and with fx_fp8.compile_pipeline, same seeds; "
        "print latency, image PSNR/SSIM and the final latents' max abs error.",
    )
    common(p)
    run_flags(p, steps=8, prompts=2)
    from fx_fp8.tools import cli_flags as _flags

    _flags.add_pipeline_flags(p)
    p.add_argument("--out", default=None, help="side-by-side PNG (native | FP8 | difference)")
    p.add_argument("--format", choices=("table", "json"), default="table", help=JSON_HELP)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "sensitivity",
        help="per-block / per-step FP8 sensitivity and a recommended config",
        **kw,
        description=SENSITIVITY_HELP,
    )
    common(p)
    run_flags(p, steps=8, prompts=2)
    p.add_argument(
        "--target-psnr",
        type=float,
        default=30.0,
        help="PSNR (dB) of the final latents vs native that the recommendation must reach (default 30)",
    )
    p.add_argument("--out", default="fx_fp8_sensitivity", help="output folder (default fx_fp8_sensitivity/)")
    p.add_argument("--yaml", default=None, help="recommended config path (default OUT/recommended.yaml)")
    p.add_argument("--chart", default=None, help="chart path (default OUT/sensitivity.png)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the final re-measurement through compile_pipeline (the in-process one still runs)",
    )
    p.add_argument(
        "--step-policy",
        nargs="?",
        const="1,2",
        default=None,
        metavar="K[,K...]",
        help="also propose a step policy: the first and last K steps in higher precision (attention "
        "native, linears weight-only or native, or both), chosen before the layers and written "
        "into the YAML (K values default 1,2)",
    )
    p.set_defaults(func=cmd_sensitivity)

    p = sub.add_parser(
        "tune", help="every FP8 decision timed on this GPU: the table auto follows", **kw, description=TUNE_HELP
    )
    common(p)
    add_tune_flags(p)
    p.set_defaults(func=cmd_tune)
    return parser


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
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)  # a model that fails to load
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `fx-fp8 inspect | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
