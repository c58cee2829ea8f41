"""The optional cuDNN FP8 attention: the measurement that decides `attention.kernel: auto`, its reasons,
its scale arguments and its graph building (against a recording stand-in for nvidia-cudnn-frontend), and
its run-time path end to end on CPU (Triton interpreter + a stand-in that computes cuDNN's documented
FP8 SDPA). On a GPU with the frontend installed, the real thing (marked cuda)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.install_hint import install_hint
from fx_fp8.ops import cuda, cudnn_attention, quant
from fx_fp8.ops.lowering import get_lowering

B, H, S, D = 1, 8, 1024, 128  # tests/ops/test_attention_numerics.py's inputs and bar
OUTLIER_CHANNELS = [3, 17, 64, 100]


def sqnr_db(ref, x) -> float:
    ref = ref.double()
    return 10 * math.log10(float((ref**2).sum() / ((ref - x.double()) ** 2).sum()))


def exact_attention(q, k, v):
    return torch.softmax((q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1]), -1) @ v.double()


def att(**kw):
    return FP8Config.load(None, attention=kw).attention


@pytest.fixture(scope="module")
def sqnrs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    q5, k5 = q.clone(), k.clone()
    q5[..., OUTLIER_CHANNELS] *= 5
    k5[..., OUTLIER_CHANNELS] *= 5
    ref = get_lowering("reference")
    out = {}
    for name, (qi, ki) in {"gaussian": (q, k), "x5": (q5, k5)}.items():
        exact = exact_attention(qi, ki, v)
        block = ref.attention(
            qi,
            ki,
            v,
            attn_mask=None,
            softmax_scale=D**-0.5,
            granularity="block",
            q_block=128,
            kv_block=256,
            hadamard=True,
            smooth_k=True,
            quantize_p=True,
            p_scale=448.0,
            kernel="auto",
            return_lse=False,
        )
        tensor_fp8_o = cudnn_attention.emulate(qi, ki, v, softmax_scale=D**-0.5)
        out[name] = {"block": sqnr_db(exact, block), "cudnn": sqnr_db(exact, tensor_fp8_o)}
    print("\nSQNR dB (block recipe / cuDNN FP8 recipe):", json.dumps(out))
    return out


def test_auto_kernel_follows_the_measured_sqnr(sqnrs):
    for name, r in sqnrs.items():
        assert r["block"] >= cudnn_attention.SQNR_BAR_DB, (name, r)  # the bar itself holds for the block recipe
    cudnn_meets_bar = all(r["cudnn"] >= cudnn_attention.SQNR_BAR_DB for r in sqnrs.values())
    assert cuda.AUTO_KERNEL == ("cudnn" if cudnn_meets_bar else "triton"), sqnrs
    # the table in cudnn_attention's docstring (24.59 / 24.71 dB on this machine's torch)
    assert 24.0 < sqnrs["gaussian"]["cudnn"] < 25.0 and 24.0 < sqnrs["x5"]["cudnn"] < 25.0, sqnrs


def test_emulation_is_the_reference_plus_fp8_output():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=g) for _ in range(3))
    ref_out, ref_lse = get_lowering("reference").attention(
        q,
        k,
        v,
        attn_mask=None,
        softmax_scale=0.125,
        granularity="tensor",
        q_block=1,
        kv_block=1,
        hadamard=True,
        smooth_k=True,
        quantize_p=True,
        p_scale=448.0,
        kernel="auto",
        return_lse=True,
    )
    out, lse = cudnn_attention.emulate(q, k, v, softmax_scale=0.125, return_lse=True)
    assert torch.equal(lse, ref_lse)
    sv = quant.quantize_rows_in_blocks(v, "tensor", 1)[1].reshape(())
    assert torch.equal(out, quant.cast_fp8(ref_out, sv).float() * sv)


# -- reasons ------------------------------------------------------------------------------
@pytest.fixture
def cudnn_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cudnn_attention, "import_cudnn", lambda: types.SimpleNamespace())
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)


def fake_cuda(*shapes, dtype=torch.bfloat16):
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=dtype) for s in shapes]


def test_reasons(cudnn_present, monkeypatch):
    q, q80 = fake_cuda((1, 2, 64, 128), (1, 2, 64, 80))
    (mask,) = fake_cuda((1, 1, 1, 64), dtype=torch.bool)
    ok = att(kernel="cudnn", granularity="tensor")
    low = get_lowering("cuda")
    assert low.attention_reason(q, q, q, ok) is None
    assert low.attention_reason(q, q, q, ok, need_lse=True) is None  # cuDNN's Stats
    assert "per-tensor scales" in low.attention_reason(q, q, q, att(kernel="cudnn"))  # default: block scales
    assert "quantize_p" in low.attention_reason(q, q, q, att(kernel="cudnn", granularity="tensor", quantize_p=False))
    assert "head dim 80" in low.attention_reason(q80, q80, q80, ok)
    assert "masks are not supported" in low.attention_reason(q, q, q, ok, mask)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8907)
    assert "cuDNN backend 8907" in low.attention_reason(q, q, q, ok)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "sm89: cuDNN's FP8 SDPA needs sm90" in low.attention_reason(q, q, q, ok)
    # "auto" never asks about cuDNN
    assert low.attention_reason(q, q, q, att(granularity="tensor")) is None


def test_missing_package_is_a_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    (q,) = fake_cuda((1, 2, 64, 128))
    reason = get_lowering("cuda").attention_reason(q, q, q, att(kernel="cudnn", granularity="tensor"))
    assert "nvidia-cudnn-frontend not importable" in reason and install_hint("cuda") in reason


# -- arguments and graph ----------------------------------------------------------------
def test_scale_tensors():
    sq, sk, sv = torch.tensor([[[0.5]]]), torch.tensor([[[0.25]]]), torch.tensor([[[0.125]]])
    t = cudnn_attention.scale_tensors(sq, sk, sv, 448.0)
    assert set(t) == set(cudnn_attention.SCALAR_INPUTS)
    assert all(x.shape == (1, 1, 1, 1) and x.dtype == torch.float32 and x.is_contiguous() for x in t.values())
    assert t["descale_q"].item() == 0.5 and t["descale_k"].item() == 0.25 and t["descale_v"].item() == 0.125
    assert t["scale_s"].item() == 448.0 and t["descale_s"].item() == pytest.approx(1 / 448.0)
    assert t["scale_o"].item() == 8.0  # O in e4m3 with V's scale


FAKE_FRONTEND = r'''
import types, torch
from fx_fp8.ops import quant

data_type = types.SimpleNamespace(FP8_E4M3="FP8_E4M3", FLOAT="FLOAT", BFLOAT16="BFLOAT16")
heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
calls = []


class T:
    def __init__(self, name, dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type, self.output = name, dim, stride, data_type, False
    def set_output(self, v): self.output = v; return self
    def set_dim(self, v): self.dim = list(v); return self
    def set_stride(self, v): self.stride = list(v); return self
    def set_data_type(self, v): self.data_type = v; return self


class pygraph:
    def __init__(self, **kw):
        calls.append(("pygraph", kw))
        self.sdpa_kw = None
    def tensor(self, name, dim, stride, data_type):
        return T(name, list(dim), list(stride), data_type)
    def sdpa_fp8(self, **kw):
        if OLD_FRONTEND and "generate_stats" in kw:
            raise TypeError("sdpa_fp8() got an unexpected keyword argument 'generate_stats'")
        self.sdpa_kw = kw
        calls.append(("sdpa_fp8", {k: (v.name if isinstance(v, T) else v) for k, v in kw.items()}))
        stats = T("stats") if kw.get("generate_stats", not kw.get("is_inference", True)) else None
        return T("o"), stats, T("amax_s"), T("amax_o")
    def validate(self): calls.append(("validate",))
    def build_operation_graph(self): calls.append(("build_operation_graph",))
    def create_execution_plans(self, modes): calls.append(("create_execution_plans", modes))
    def check_support(self): calls.append(("check_support",))
    def build_plans(self): calls.append(("build_plans",))
    def get_workspace_size(self): return 16

    def execute(self, pack, workspace, handle=None):
        """cuDNN's FP8 SDPA forward as documented: S = Q K^T * dq * dk * attn_scale, P = softmax(S) with
        e4m3(P * scale_s) in the second GEMM, O = e4m3(P V * descale_s * dv * scale_o), Stats = max + ln(sum)."""
        by = {t.name: x for t, x in pack.items()}
        f8 = lambda x: x.view(quant.FP8_DTYPE).float()
        kw = self.sdpa_kw
        s = (f8(by["q"]) @ f8(by["k"]).transpose(-1, -2)) * by["descale_q"] * by["descale_k"] * kw["attn_scale"]
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        pq = (p * by["scale_s"]).to(quant.FP8_DTYPE).float()
        o = (pq @ f8(by["v"])) * by["descale_s"] * by["descale_v"] / l
        by["o"].copy_(quant.cast_fp8(o, 1.0 / by["scale_o"]).view(torch.uint8))
        if "stats" in by:
            by["stats"].copy_(m + torch.log(l))
        by["amax_s"].fill_(1.0)
        by["amax_o"].copy_(o.abs().amax().reshape(1, 1, 1, 1))
        calls.append(("execute", sorted(by)))


def create_handle():
    calls.append(("create_handle",))
    return "handle"


def set_stream(handle, stream):
    calls.append(("set_stream", handle, stream))

OLD_FRONTEND = False
'''


def _fake_frontend(old=False):
    mod = types.ModuleType("cudnn")
    exec(FAKE_FRONTEND, mod.__dict__)
    mod.OLD_FRONTEND = old
    return mod


@pytest.mark.parametrize("need_lse", [False, True])
@pytest.mark.parametrize("old", [False, True])
def test_graph_building(need_lse, old):
    fe = _fake_frontend(old)
    graph, t = cudnn_attention.build_graph(
        fe,
        shape_q=(2, 3, 100, 64),
        stride_q=(19200, 6400, 64, 1),
        shape_k=(2, 3, 77, 64),
        stride_k=(14784, 4928, 64, 1),
        stride_v=(14784, 4928, 64, 1),
        stride_o=(19200, 6400, 64, 1),
        softmax_scale=0.125,
        need_lse=need_lse,
        handle="h",
    )
    names = [c[0] for c in fe.calls]
    assert names == [
        "pygraph",
        "sdpa_fp8",
        "validate",
        "build_operation_graph",
        "create_execution_plans",
        "check_support",
        "build_plans",
    ]
    assert fe.calls[0][1] == dict(
        io_data_type="FP8_E4M3", intermediate_data_type="FLOAT", compute_data_type="FLOAT", handle="h"
    )
    op = fe.calls[1][1]
    assert op["attn_scale"] == 0.125 and op["use_causal_mask"] is False
    assert (op["is_inference"] is (not need_lse)) if old else (op["generate_stats"] is need_lse)
    assert all(op[n] == n for n in cudnn_attention.SCALAR_INPUTS) and (op["q"], op["k"], op["v"]) == ("q", "k", "v")
    assert t["q"].dim == [2, 3, 100, 64] and t["k"].dim == t["v"].dim == [2, 3, 77, 64]
    assert all(t[n].data_type == "FP8_E4M3" for n in ("q", "k", "v", "o"))  # O in FP8 (Hopper's FP8 SDPA)
    assert t["o"].output and t["o"].dim == [2, 3, 100, 64] and t["o"].stride == [19200, 6400, 64, 1]
    assert ("stats" in t) is need_lse
    if need_lse:
        assert t["stats"].output and t["stats"].dim == [2, 3, 100, 1] and t["stats"].data_type == "FLOAT"
    assert all(t[n].output and t[n].dim == [1, 1, 1, 1] for n in ("amax_s", "amax_o"))
    assert all(t[n].dim == [1, 1, 1, 1] and t[n].data_type == "FLOAT" for n in cudnn_attention.SCALAR_INPUTS)


def test_variant_pack_sends_fp8_as_bytes():
    fe = _fake_frontend()
    t = {"q": fe.T("q"), "descale_q": fe.T("descale_q")}
    x = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)
    pack = cudnn_attention.variant_pack(t, {"q": x, "descale_q": torch.ones(1, 1, 1, 1)})
    assert pack[t["q"]].dtype == torch.uint8 and pack[t["q"]].data_ptr() == x.data_ptr()
    assert pack[t["descale_q"]].dtype == torch.float32


RUNTIME_SCRIPT = r"""
import contextlib, json, math, sys, types
import torch
sys.modules["cudnn"] = FAKE
torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=7)
torch.cuda.current_device = lambda: 0
torch.cuda.device = lambda index: contextlib.nullcontext()
from fx_fp8.ops import cudnn_attention
from fx_fp8.ops.cuda import LOWERING as C

torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 150, 64).bfloat16() for _ in range(3))
kw = dict(attn_mask=None, softmax_scale=0.125, granularity="tensor", q_block=128, kv_block=256, hadamard=True,
          smooth_k=True, quantize_p=True, p_scale=448.0, kernel="cudnn")
out, lse = C.attention(q, k, v, return_lse=True, **kw)
out2 = C.attention(q, k, v, return_lse=False, **kw)
emu, emu_lse = cudnn_attention.emulate(q, k, v, softmax_scale=0.125, return_lse=True)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
names = [c[0] for c in FAKE.calls]
print("RESULT" + json.dumps({
    "rel": rel(out, emu), "rel_no_lse": rel(out2, emu), "lse_maxabs": (lse - emu_lse).abs().max().item(),
    "dtype": str(out.dtype), "shape": list(out.shape), "lse_shape": list(lse.shape),
    "graphs_built": names.count("pygraph"), "handles": names.count("create_handle"),
    "executes": names.count("execute"), "streams": [c[2] for c in FAKE.calls if c[0] == "set_stream"]}))
"""


@pytest.mark.slow
def test_runtime_path_end_to_end_on_cpu():
    """CudnnFP8Attention with the Triton pre-pass in the interpreter and the stand-in frontend: the
    graph's inputs carry the scales the emulation assumes, and the output / LSE come back right."""
    prelude = "import types\nFAKE = types.ModuleType('cudnn')\nexec(" + repr(FAKE_FRONTEND) + ", FAKE.__dict__)\n"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", prelude + RUNTIME_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT") :])
    assert r["shape"] == [1, 2, 150, 64] and r["dtype"] == "torch.bfloat16" and r["lse_shape"] == [1, 2, 150]
    # the stand-in quantizes P against the final row max, as the emulation: equal up to bf16 / fp32 order
    assert r["rel"] < 1e-2 and r["rel_no_lse"] < 1e-2, r
    assert r["lse_maxabs"] < 1e-3, r  # including the smoothing term added back
    assert r["graphs_built"] == 2 and r["handles"] == 1 and r["executes"] == 2, r  # one graph per LSE flag
    assert r["streams"] == [7, 7], r


# -- GPU -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudnn_fp8_attention_on_gpu():
    (q,) = [torch.empty(1, 1, 1, 64, device="cuda")]
    cfg = att(kernel="cudnn", granularity="tensor")
    reason = cudnn_attention.attention_reason(q, q, q, cfg)
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v = v + 0.5
    kw = dict(
        attn_mask=None,
        softmax_scale=128**-0.5,
        granularity="tensor",
        q_block=128,
        kv_block=256,
        hadamard=True,
        smooth_k=True,
        quantize_p=True,
        p_scale=448.0,
        kernel="cudnn",
        return_lse=True,
    )
    out, lse = get_lowering("cuda").attention(q, k, v, **kw)
    emu, emu_lse = cudnn_attention.emulate(q.cpu(), k.cpu(), v.cpu(), softmax_scale=128**-0.5, return_lse=True)
    sdpa = F.scaled_dot_product_attention(q, k, v)
    # the emulation is the reference plus FP8 output rounding; cuDNN's own P @ V accumulation is not modelled
    # (an H200 measured 3.20 % here on 2026-12-04, and 4-20 % against float64 attention at 4.6k-33k keys in
    # benchmarks/attention_kernels.py: outside the 1.5x accuracy bar, so attention.kernel auto never picks it)
    assert ((out.float().cpu() - emu.float()).norm() / emu.float().norm()).item() < 4e-2
    assert ((out - sdpa).float().norm() / sdpa.float().norm()).item() < 4e-2
    assert (lse.cpu() - emu_lse).abs().max().item() < 1e-2
