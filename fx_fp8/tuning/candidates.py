"""Every candidate fx_fp8 could emit for one shape, compiled as the backend compiles it, timed.

A candidate is a config: one nn.Linear (or one SDPA call) of the shape is compiled by the `fp8`
backend with it (the config's lowering and downstream: Inductor on CUDA, so the activation
quantization is fused as in the model) and called on random inputs of the shape. Its time comes
from `timer(fn) -> ms`; its error is the relative Frobenius error against native on the same inputs
(linears: eager F.linear in the model's dtype; attention: float64 attention, next to the reference
lowering's error, the bar the attention table picks by), over the first ERR_ROWS rows (and
ERR_HEADS heads). A candidate the backend does not emit at this shape
(the report row says native, with why) or that fails is kept with that reason and no time.

Linear candidates (fx_fp8.ops.tune_table.LINEAR_CANDIDATES): native, FP8 W8A8 row-wise (fast
accumulation as configured), FP8 block-scaled, INT8 W8A8 (on GPUs without FP8 matrix units, and
in CPU dry runs), weight-only with INT8 and FP8 codes (the W8A16 kernel, whose autotuner picks its
own tile form for the shape). A weight-only-role (sensitive) linear gets native and the
weight-only forms. Attention: native (BF16 SDPA), every kernel the lowering can run (CUDA: triton,
cudnn), and the reference lowering for the error bar.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fx_fp8.report import clear_reports, get_reports
from fx_fp8.tuning.shapes import AttentionShape, LinearShape

#: linear candidate -> (quantization_config overrides, module name). "proj_out" is a sensitive-layer
#: name: with sensitive weight_only it runs W8A16; the W8A8 ones quantize everything (sensitive fp8)
LINEAR_CONFIGS = {
    "native": (None, "lin"),
    "fp8_rowwise": ({"method": "fp8", "weight_granularity": "channel", "sensitive": "fp8"}, "lin"),
    "fp8_block": ({"method": "fp8", "weight_block_size": [128, 128], "sensitive": "fp8"}, "lin"),
    "int8_rowwise": ({"method": "int8", "weight_granularity": "channel", "sensitive": "fp8"}, "lin"),
    "weight_only_int8": ({"method": "fp8", "sensitive": "weight_only", "weight_only_method": "int8"}, "proj_out"),
    "weight_only_fp8": ({"method": "fp8", "sensitive": "weight_only", "weight_only_method": "fp8"}, "proj_out"),
}
#: attention candidate -> attention config overrides (None: attention native)
ATTENTION_CONFIGS = {
    "native": None,
    "triton": {"kernel": "triton"},
    "cudnn": {"kernel": "cudnn", "granularity": "tensor"},
}


def linear_candidates(shape: LinearShape, device: torch.device) -> list[str]:
    if shape.role == "weight_only":
        return ["native", "weight_only_int8", "weight_only_fp8"]
    names = ["native", "fp8_rowwise", "fp8_block", "weight_only_int8", "weight_only_fp8"]
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        names.insert(3, "int8_rowwise")  # INT8 W8A8 where FP8 matrix units are missing (every candidate on CPU)
    return names


def attention_candidates(device: torch.device) -> list[str]:
    return ["native", "triton", "cudnn"] if device.type == "cuda" else ["native", "reference"]


class _Linear(nn.Module):
    def __init__(self, name: str, lin: nn.Linear):
        super().__init__()
        self.name = name
        setattr(self, name, lin)

    def forward(self, x):
        return getattr(self, self.name)(x)


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def _compiled(module: nn.Module, config) -> Callable:
    """The module compiled by the fp8 backend with `config` (a fresh Dynamo cache: every candidate
    compiles, none hits another's cache entry or its recompile limit)."""
    torch._dynamo.reset()
    clear_reports()
    return torch.compile(module, backend="fp8", options={"config": config}, dynamic=False)


def _native_reason(op: str) -> Optional[str]:
    rows = [e for r in get_reports() for e in r.entries if e.op == op]
    return rows[0].reason if rows and rows[0].action == "native" else None


#: errors are taken on the first rows (linears) / heads and queries (attention): a float64 reference of
#: Wan-14B's 75600-token attention in full would need terabytes (as benchmarks/attention_kernels.py does)
ERR_ROWS, ERR_HEADS = 1024, 2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of y against ref (ref may cover only y's leading rows / heads)."""
    if y.dim() == 4:
        y = y[:, : ref.shape[1], : ref.shape[2]]
    else:
        y = y[: ref.shape[0]]
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _run(name, build, timer, ref, op, expect_native: bool) -> dict:
    """One candidate's cell: {"ms", "err"} or {"error": why}."""
    try:
        fn, config = build()
        compiled = _compiled(fn.module, config)
        with torch.no_grad():
            out = compiled(*fn.inputs)
        why = _native_reason(op)
        if why is not None and not expect_native:
            return {"ms": None, "err": None, "error": f"not emitted here: {why}"}
        with torch.no_grad():
            ms = timer(lambda: compiled(*fn.inputs))
        return {"ms": round(float(ms), 5), "err": round(rel_err(out, ref), 6) if ref is not None else None}
    except Exception as e:  # a candidate the device cannot run is a measurement, not a crash of the tune
        return {"ms": None, "err": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


class _Fn:
    def __init__(self, module, inputs):
        self.module, self.inputs = module, inputs


def candidate_base(config):
    """The user's config as every candidate starts from it: its lowering, downstream, fast_accum,
    weight-only storage and attention recipe kept; what names layers or steps of the model (step
    and layer selectors, calibrated static scales and smoothing, ignored_layers) dropped: a one-op
    model has none of those layers, and a static scale is per layer (runs measure dynamic ones)."""
    return config.replace(
        diffusion_kv_cache_skip_steps=None,
        diffusion_kv_cache_skip_layers=None,
        quantization_config={
            "skip_steps": None,
            "activation_scheme": "dynamic",
            "activation_scales": None,
            "smoothing_alpha": None,
            "ignored_layers": [],
            "kernel": "rules",
            "tune_table": None,
        },
    )


def measure_linear(shape: LinearShape, base_config, device, timer, seed: int = 0) -> dict:
    """{candidate: {"ms", "err"} or {"error"}} for one linear shape."""
    base_config = candidate_base(base_config)
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lin = nn.Linear(shape.k, shape.n, bias=shape.bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(shape.n, shape.k, generator=gen) / shape.k**0.5)
        if shape.bias:
            lin.bias.copy_(torch.randn(shape.n, generator=gen) * 0.1)
    lin = lin.to(device=device, dtype=dtype)
    x = torch.randn(shape.m, shape.k, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref = F.linear(x[:ERR_ROWS], lin.weight, lin.bias)
    cells = {}
    for name in linear_candidates(shape, device):
        qc, attr = LINEAR_CONFIGS[name]

        def build(qc=qc, attr=attr):
            module = _Linear(attr, lin)
            if qc is None:
                return _Fn(module, (x,)), base_config.replace(quantization=None, diffusion_kv_cache_dtype=None)
            over = dict(qc, min_features=0)
            return _Fn(module, (x,)), base_config.replace(quantization=qc["method"], quantization_config=over)

        cells[name] = _run(name, build, timer, ref, "linear", expect_native=qc is None)
    return cells


def measure_attention(shape: AttentionShape, base_config, device, timer, seed: int = 0) -> tuple[dict, Optional[float]]:
    """({candidate: cell}, the reference lowering's error) for one attention shape; errors against
    float64 attention."""
    base_config = candidate_base(base_config)
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (
        torch.randn(1, shape.bh, s, shape.d, generator=gen).to(device=device, dtype=dtype)
        for s in (shape.s_q, shape.s_k, shape.s_k)
    )
    h, n = ERR_HEADS, ERR_ROWS
    ref = F.scaled_dot_product_attention(q[:, :h, :n].double(), k[:, :h].double(), v[:, :h].double())
    reference = base_config.replace(quantization=None, lowering="reference", downstream="eager")
    cells = {}
    for name in attention_candidates(device):
        over = ATTENTION_CONFIGS.get(name)

        def build(name=name, over=over):
            if name == "reference":
                return _Fn(_Attention(), (q, k, v)), reference
            if over is None:
                return _Fn(_Attention(), (q, k, v)), base_config.replace(
                    quantization=None, diffusion_kv_cache_dtype=None
                )
            return _Fn(_Attention(), (q, k, v)), base_config.replace(quantization=None, attention=over)

        cells[name] = _run(name, build, timer, ref, "attention", expect_native=over is None and name != "reference")
    if "reference" in cells:
        return cells, cells["reference"].get("err")
    # on a GPU the reference lowering is only the error bar an FP8 kernel is held to (attention_table.BAR)
    bar = _run(
        "reference",
        lambda: (_Fn(_Attention(), (q, k, v)), reference),
        lambda fn: 0.0,
        ref,
        "attention",
        expect_native=False,
    )
    return cells, bar.get("err")
