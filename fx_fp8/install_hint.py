"""The command that installs one of fx-fp8's extras, as it works where this copy was installed from.

fx-fp8 is installed from a checkout (`pip install -e ".[test]"`): `pip install 'fx-fp8[cuda]'` would
look for a published package. From a checkout the hint names the checkout's folder; from an
installed copy without one, the extra's own requirements (read from the installed metadata).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import shlex
from pathlib import Path
from typing import Optional

DIST = "fx-fp8"


def checkout_root() -> Optional[Path]:
    """The source checkout fx_fp8 is imported from (an editable install, or the source tree on the
    path), or None for a copy installed into site-packages."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    try:
        return root if re.search(r'^name\s*=\s*"fx-fp8"', pyproject.read_text(), re.M) else None
    except OSError:
        return None


def extra_requirements(extra: str) -> list[str]:
    """The requirements of `extra` in the installed metadata, without their markers."""
    try:
        requires = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    out = []
    for req in requires:
        spec, _, marker = req.partition(";")
        if re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            out.append(spec.strip())
    return out


@functools.lru_cache(maxsize=None)
def install_hint(extra: str) -> str:
    """'pip install -e "/path/to/checkout[cuda]"', or 'pip install "nvidia-cudnn-frontend>=1.5"'."""
    root = checkout_root()
    if root is not None:
        return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
    reqs = extra_requirements(extra)
    if reqs:
        return "pip install " + " ".join(shlex.quote(r) for r in reqs)
    return f"install fx-fp8's [{extra}] extra (pip install -e \".[{extra}]\" in its checkout)"
