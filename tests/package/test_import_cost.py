"""`import fx_fp8` stays cheap: it imports none of diffusers, Triton, matplotlib (nor
Dynamo, sympy, tabulate, RE2, which cost a second together), every public name still resolves on
first use, and torch.compile still finds the "fp8" backend (a torch entry point). The time itself
is measured by benchmarks/import_time.py, not here: a timed test would be flaky on a shared box."""

from __future__ import annotations

import json
import subprocess
import sys

import fx_fp8

NOT_AT_IMPORT = ("diffusers", "triton", "matplotlib", "torch._dynamo", "sympy", "tabulate", "re2")


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_fx_fp8_imports_no_heavy_module():
    found = _fresh(f"import json, sys, fx_fp8; print(json.dumps([m for m in {NOT_AT_IMPORT!r} if m in sys.modules]))")
    assert found == [], f"`import fx_fp8` imported {found}: import them where they are used"


def test_every_public_name_resolves():
    for name in fx_fp8.__all__:
        assert getattr(fx_fp8, name) is not None, name
    assert set(fx_fp8.__all__) <= set(dir(fx_fp8))


def test_star_import_and_the_backend_entry_point():
    """torch finds "fp8" / "fp8_npu" through the entry point, without `import fx_fp8` first."""
    got = _fresh(
        "import json, torch._dynamo\n"
        "fp8 = torch._dynamo.lookup_backend('fp8')\n"
        "npu = torch._dynamo.lookup_backend('fp8_npu')\n"
        "from fx_fp8 import *\n"
        "print(json.dumps([fp8.__module__, npu.__module__, callable(prepare_model)]))"
    )
    assert got == ["fx_fp8.compile.backend", "fx_fp8.compile.backend", True]


def test_unknown_name_is_an_attribute_error():
    try:
        fx_fp8.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("fx_fp8.no_such_name resolved")
