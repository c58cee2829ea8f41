"""What every `fx-fp8` command shares: bad input as UsageError (exit status 2, one line on
stderr), checked before the work starts (config, model source, sizes, output paths), and strict
JSON output."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass

PROG = "fx-fp8"


class UsageError(Exception):
    """Bad command-line input: exit status 2, one line on stderr."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- config, model source, sizes ---------------------------------------------------------------
def _config(args):
    """FP8Config from --config and the flags (flags win)."""
    from fx_fp8.tools import cli_flags

    try:
        return cli_flags.config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


@dataclass(frozen=True)
class Placement:
    """Where a command loads and runs the model (--device, --dtype)."""

    device: str
    dtype: object  # torch.dtype (torch is imported only when a command runs)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"device {self.device}, dtype {self.dtype_name}"


def _placement(args) -> Placement:
    """--device / --dtype, checked before the work starts (a device this torch cannot use is a UsageError)."""
    from fx_fp8.tools import cli_flags

    try:
        device = cli_flags.resolve_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return Placement(device, cli_flags.resolve_dtype(args.dtype, device))


def _choose_config(args, source) -> str:
    """Which config a command starts from, as the examples choose it (one rule for every command):
    --config; else the model folder's own fx_fp8.yaml (the shipped tiny model has one), unless
    --library-default; else the library's default. Sets args.config to it; returns how the output
    names it."""
    if args.library_default and args.config is not None:
        raise UsageError(
            f"--library-default and --config {args.config!r} both say which config to start from: give one of them"
        )
    if args.config is not None:
        return f"--config {args.config}"
    own = None if args.library_default else source.own_config()
    if own is None:
        return "the library default" + (" (--library-default)" if args.library_default else "")
    args.config = str(own)
    return f"{own} (the model's own; --library-default for the library's default)"


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


def _check_sizes(args) -> None:
    for name in ("steps", "prompts", "height", "width"):
        v = getattr(args, name)
        if v < 1:
            raise UsageError(f"invalid --{name} {v}: expected a positive integer")


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
