"""torch_npu, the chip and the CANN release, looked up lazily: what the npu lowering's choices
depend on (fx_fp8.ops.npu).

torch_npu is imported inside these functions, never when fx_fp8 is imported: installing
torch_npu breaks plain torch on machines without CANN.
"""

from __future__ import annotations

import importlib
import re
from typing import Optional

#: SoC version of Ascend 950 as torch_npu.npu.get_soc_version() reports it (MindIE-SD's A5 check)
ASCEND_950_SOC = 260

#: CANN releases (see parse_cann_version): mode 7 refused from 9.0.0-rc.1; non-paged (TND) MXFP8 attention
#: from 9.1.0.pre (9.1.0-beta.3 had it for paged KV only, head dim 128, 64-aligned lengths)
MODE7_REFUSED_FROM = "9.0.0-rc.1"
MXFP8_ATTENTION_FROM = "9.1.0.pre"


def import_torch_npu():
    import torch_npu  # noqa: F401  lazy on purpose (see module doc)

    return torch_npu


def import_problem() -> Optional[str]:
    """None when torch_npu imports, else why not (ImportError, or CANN libraries missing)."""
    try:
        import_torch_npu()
    except Exception as e:  # a broken CANN install raises RuntimeError/OSError, not only ImportError
        return f"torch_npu not importable ({type(e).__name__}: {e})"
    return None


def device_name() -> str:
    return str(import_torch_npu().npu.get_device_name())


def soc_version() -> Optional[int]:
    try:
        return int(import_torch_npu().npu.get_soc_version())
    except Exception:
        return None


def is_fp8_chip(name: str, soc: Optional[int] = None) -> bool:
    """FP8 attention / matmul kernels exist on Ascend 950 (950PR / 950DT) only."""
    return "950" in name or soc == ASCEND_950_SOC


def chip_problem() -> Optional[str]:
    """None on an Ascend 950, else why this machine has no FP8 kernels."""
    problem = import_problem()
    if problem is not None:
        return problem
    try:
        name = device_name()
    except Exception as e:
        return f"cannot read the NPU name ({type(e).__name__}: {e})"
    if not is_fp8_chip(name, soc_version()):
        return f"{name} has no FP8 kernels (FP8 attention/matmul are Ascend 950 only; Atlas A2/A3 are INT8 only)"
    return None


def cann_version() -> str:
    """torch_npu.utils.get_cann_version() ("" when unavailable: CANN < 8.1.RC1 or no torch_npu)."""
    try:
        torch_npu = import_torch_npu()
        utils = getattr(torch_npu, "utils", None) or importlib.import_module("torch_npu.utils")
        return str(utils.get_cann_version(module="CANN") or "")
    except Exception:
        return ""


#: pre-release stages in release order ("9.1.0.pre" is the snapshot before 9.1.0, after its betas)
_STAGES = {"alpha": 0, "beta": 1, "rc": 2, "pre": 3}


def parse_cann_version(text: str) -> Optional[tuple]:
    """Comparable key of a CANN version: "8.3.RC1", "9.0.0", "9.0.0-beta.2", "9.1.0.pre" ... None if unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.\-]?([A-Za-z]+)\.?(\d*))?", text or "")
    if m is None:
        return None
    major, minor, patch, stage, num = m.groups()
    stage = (stage or "").lower()
    rank = _STAGES.get(stage, 4 if stage == "" else None)
    if rank is None:
        return None
    return int(major), int(minor), int(patch or 0), rank, int(num or 0)


def cann_accepts_mode7(version: str) -> bool:
    """Only a CANN release known to be older than 9.0.0-rc.1 gets the per-block case (mode 7)."""
    key = parse_cann_version(version)
    return key is not None and key < parse_cann_version(MODE7_REFUSED_FROM)


def cann_has_mxfp8_attention(version: str) -> bool:
    """Non-paged MXFP8 attention (modes 6/6/8, TND): CANN >= 9.1.0.pre, or a version that cannot
    be read (assumed current)."""
    key = parse_cann_version(version)
    return key is None or key >= parse_cann_version(MXFP8_ATTENTION_FROM)
