"""fx_fp8 never needs torch_npu: importing it does not touch torch_npu, and CPU compiles work
when torch_npu is absent or broken. Each case runs in a clean interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Runs in a fresh interpreter; MODE picks how torch_npu is unavailable.
SCRIPT = textwrap.dedent(r'''
    import importlib.abc, json, sys, warnings
    MODE = sys.argv[1]
    attempts = []

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Like a torch_npu wheel on a machine without CANN: importing it raises."""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch_npu", "mindiesd"):
                attempts.append(name)
                return importlib.util.spec_from_loader(name, self)
            return None
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            raise RuntimeError("libascendcl.so: cannot open shared object file")

    import importlib.util
    if MODE == "runtime-error":
        sys.meta_path.insert(0, Broken())
    else:  # "absent": the import system answers ImportError
        sys.modules["torch_npu"] = None
        sys.modules["mindiesd"] = None

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import fx_fp8, fx_fp8.compile.backend, fx_fp8.ops.npu, fx_fp8.ops.lowering
    from fx_fp8.ops.lowering import get_lowering, npu_available
    get_lowering("npu")
    import fx_fp8.ops.mindiesd, fx_fp8.ops.mx
    out = {"attempts_at_import": list(attempts), "npu_available": npu_available(),
           "mindiesd_problem": fx_fp8.ops.mindiesd.import_problem(),
           "in_sys_modules": sys.modules.get("torch_npu", "missing") is not None and "torch_npu" in sys.modules}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_qkv = nn.Linear(64, 192, bias=False)
        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.to_qkv(x).view(b, s, 3, 2, 32).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v)

    torch.manual_seed(0)
    m, x = M().to(torch.bfloat16).eval(), torch.randn(1, 40, 64).to(torch.bfloat16)
    with torch.no_grad():
        ref = torch.compile(m, backend="fp8")(x)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            npu_out = torch.compile(m, backend="fp8_npu")(x)
        out["fallback_warning"] = any("found no Ascend NPU" in str(i.message) for i in w)
        out["fallback_lowering"] = fx_fp8.get_reports()[-1].lowering
        out["fallback_equal"] = bool(torch.equal(ref, npu_out))
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            forced = torch.compile(m, backend="fp8_npu", options={"lowering": "npu", "downstream": "eager"})(x)
        report = fx_fp8.get_reports()[-1]
        out["forced_finite"] = bool(torch.isfinite(forced).all())
        out["forced_entries"] = [(e.op, e.action, e.reason) for e in report.entries]
        out["forced_warnings"] = [str(i.message) for i in w if "fx_fp8" in str(i.message)]
    print("RESULT " + json.dumps(out), flush=True)
    import os
    os._exit(0)  # skip interpreter teardown (seconds with torch loaded)
''')


MODES = ("absent", "runtime-error")


@pytest.fixture(scope="module")
def results() -> dict:
    """Both clean-interpreter cases, run concurrently (each spends seconds importing torch)."""
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, m], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for m in MODES
    }
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        out[mode] = json.loads(lines[-1][len("RESULT ") :]) if proc.returncode == 0 and lines else stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode, error", [("absent", "ModuleNotFoundError"), ("runtime-error", "RuntimeError")])
def test_fx_fp8_works_without_a_working_torch_npu(mode, error, results):
    out = results[mode]
    assert isinstance(out, dict), f"subprocess failed:\n{out}"
    # nothing imported torch_npu or mindiesd while fx_fp8 (and its npu / MindIE-SD modules) were imported
    assert out["attempts_at_import"] == []
    assert out["mindiesd_problem"].startswith("mindiesd not importable (")
    assert out["npu_available"] is False
    # fp8_npu falls back to the CPU reference, with a warning, and computes what fp8 does
    assert out["fallback_warning"] and out["fallback_lowering"] == "reference" and out["fallback_equal"]
    # forcing the npu lowering keeps attention native with the import error as reason,
    # and linears fall back to weight-only FP8 (no torch_npu call needed)
    entries = out["forced_entries"]
    attn = [e for e in entries if e[0] == "attention"]
    assert attn  # not vacuous: all() of nothing is True
    assert attn and all(a == "native" and f"torch_npu not importable ({error}:" in r for _, a, r in attn)
    linear = [e for e in entries if e[0] == "linear"]
    assert linear  # not vacuous: all() of nothing is True
    assert linear and all(a == "weight-only" and "weight-only" in r for _, a, r in linear)
    assert any("weight-only" in w and error in w for w in out["forced_warnings"])
    assert out["forced_finite"]
