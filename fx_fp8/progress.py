"""Progress over long per-layer work (prepare_model on a large model), shown as diffusers shows it.

A tqdm bar on stderr when stderr is a terminal and tqdm is installed (it comes with diffusers);
nothing where stderr is a file, a pipe or a test's capture. `disable_progress_bar()` /
`enable_progress_bar()` override the terminal check, as diffusers' functions of the same names do.
A summary of the work goes to `logging.getLogger("fx_fp8")` at INFO (no handler is added: silent
unless the application configures logging).
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable, Optional

log = logging.getLogger("fx_fp8")

#: None: a bar when stderr is a terminal; True / False: always / never
_ENABLED: Optional[bool] = None


def enable_progress_bar() -> None:
    """Show fx_fp8's progress bars even where stderr is not a terminal."""
    global _ENABLED
    _ENABLED = True


def disable_progress_bar() -> None:
    """Never show fx_fp8's progress bars."""
    global _ENABLED
    _ENABLED = False


def reset_progress_bar() -> None:
    """Back to the default: a bar when stderr is a terminal."""
    global _ENABLED
    _ENABLED = None


def bars_shown() -> bool:
    if _ENABLED is not None:
        return _ENABLED
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def bar(items: Iterable, *, total: Optional[int] = None, desc: str, unit: str = "layer") -> Iterable:
    """`items` itself, wrapped in a tqdm bar on stderr when bars are shown and tqdm is importable."""
    if not bars_shown():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)


def log_prepared(result: dict, seconds: float) -> None:
    """The INFO record closing prepare_model: what it quantized, kept, and saved, and how long it took."""
    if not log.isEnabledFor(logging.INFO):
        return
    mib = 1 << 20
    log.info(
        "fx_fp8: prepare_model quantized %d linear(s) (%d weight-only), kept %d native, left %d with hooks, "
        "in %.2f s: their weights %.1f MiB -> %.1f MiB (%s)",
        len(result["quantized"]),
        len(result["weight_only"]),
        len(result["native"]),
        len(result["hooked"]),
        seconds,
        result["bytes_before"] / mib,
        result["bytes_after"] / mib,
        result["method"],
    )
