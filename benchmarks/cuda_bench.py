"""FP8 against BF16 on one CUDA GPU (an H200, sm90), side by side in one run, through the public API only.

    python benchmarks/cuda_bench.py --quick                      # linears, conditioning linears, attention: <= 5 min
    python benchmarks/cuda_bench.py --flux                       # full-depth Flux-dev, <= 5 min more
    python benchmarks/cuda_bench.py --wan                        # Wan2.1 14B and 1.3B shapes at 480p, <= 5 min
    python benchmarks/cuda_bench.py --quick --out benchmarks/RESULTS.md   # ... and append a dated section
    python benchmarks/cuda_bench.py --dry-run                    # CPU, tiny shapes: every row of both modes
    benchmarks/gpu_run.sh quick flux                             # the same on the GPU machine, with its logs

--quick, one table (printed last), a row per (case, contender):
  linear + bias, bf16 activations [1, 4608, K] on Flux-dev's shapes 3072->3072, 3072->9216,
  3072->12288, 12288->3072, 15360->3072, each held by an nn.Module: BF16 F.linear (cuBLAS), BF16
  Inductor, torchao float8 row-wise (quantize_ with Float8DynamicActivationFloat8WeightConfig(PerRow()), then Inductor),
  fx_fp8 (torch.compile(module, backend="fp8")), fx_fp8 prepared (fx_fp8.prepare_model first), fx_fp8
  prepared with Inductor's multi-kernel reductions (every shape: K > 1024, see FX_FP8_MULTI_KERNEL).
  conditioning linears, M = 1 (one image), bf16: Flux-dev's adaLN modulation linears 3072->18432 (a double
  block's norm1.linear) and 3072->9216 (a single block's norm.linear), each inside a module that makes it
  one by the graph's structure (silu(temb [1, K]) -> linear -> shift / scale / gate chunks modulating a
  16-token x [1, 16, K]); fx_fp8's structural analysis must find it ("adaLN modulation"; the row says
  so). BF16 Inductor, torchao float8 row-wise, and prepare_model + backend "fp8" three ways: the default
  (sensitive layers weight-only, INT8 weights with scales per channel and 32 columns: the W8A16 Triton
  kernel), sensitive "weight_only" with weight_only_method "fp8", and sensitive "fp8" (W8A8, as torchao).
  Each fx_fp8 row says what its report says ran: "linear weight-only 1/1" / "linear fp8 1/1", else NOT.
  attention B1 H24 D128 bf16 at S 4608 / 16384 / 32760 (Q, K ~ N(0, 1), V ~ N(0.5, 1)): cuDNN and
  flash BF16 SDPA, fx_fp8 (torch.compile(module calling F.scaled_dot_product_attention, backend="fp8")).
  Kernel-level attention comparisons are benchmarks/attention_kernels.py's; this is the public-API view.
--flux, two tables (printed last): FluxTransformer2DModel with Flux-dev's config (19 double + 38
  single blocks, width 3072, 24 heads; built on the meta device, materialised on the GPU with seeded
  random bf16 weights, never downloaded), 4096 image + 512 text tokens, batch 1, every block compiled
  on its own (diffusers' compile_repeated_blocks: each block class compiled once, reused by every
  instance): BF16 eager (the error reference), BF16 Inductor, fx_fp8 prepared (prepare_model, then
  backend "fp8"), torchao float8 row-wise, fx_fp8 prepared with quantization_config sensitive "fp8"
  (the 86 sensitive linears W8A8 as torchao runs them, instead of weight-only: the speed / accuracy
  trade-off of the default), fx_fp8 prepared with mode="reduce-overhead" (CUDA graphs), fx_fp8
  prepared with Inductor's multi-kernel reductions (inductor_options {"triton.multi_kernel": 1}: the
  activation quantizations' row amax also as a persistent reduction, the faster picked at the first call).
  First-call seconds (compile included), ms per forward, peak GPU memory, GPU kernel time per forward;
  then a second table, GPU kernel time per forward kernel by kernel for every variant, the kernels
  with the largest |fx_fp8 prepared - torchao| first (where fx_fp8's kernel time goes that torchao's
  does not), then all others and the total.

--wan, two tables per model (printed last): WanTransformer3DModel shaped as Wan2.1-14B (40 blocks, width
  5120, 40 heads x 128, FFN 13824) and Wan2.1-1.3B (30 blocks, width 1536, 12 heads, FFN 8960), random
  bf16 weights built on the GPU, 480x832 x 81 frames (32760 tokens; --wan-resolutions 720p: 75600), every
  block compiled once: BF16 eager (the error reference), BF16 Inductor (the row names the SDPA backend
  torch's default dispatch picks), fx_fp8 prepared (attention.kernel auto), fx_fp8 prepared with FP8
  attention forced (attention.kernel triton), torchao float8 row-wise, and the same plus torchao's
  low-precision attention (torchao.prototype.attention.apply_low_precision_attention, where the installed
  torchao has it; the row says why not otherwise). The --flux columns and the kernel-by-kernel table.
  Not yet run on a GPU. Expected on an H200 (estimates, from the FLOP count, not measured): a 14B forward
  at 32760 tokens ~2-4 s, so ~30-60 s a variant with its compile; --wan-depth N (fewer blocks) or
  --wan-variants keep a run inside --budget, which skips the variants that would not finish.

Every row: ms = triton.testing.do_bench median with L2 flushed; wall / launch / kernel ms per call and
the kernels with their share of GPU time (torch.profiler): see benchmarks/gpu_timing.py. Ratios are
measured in the same process: "x BF16" = BF16 Inductor ms / row ms (attention: cuDNN BF16 ms / row ms),
"x torchao" = torchao ms / row ms. err = relative L2 error against fp64 math (linear; conditioning:
of the linear's output), fp64 attention (attention) or the BF16 eager model (Flux). fx_fp8 rows say
what its report says (how many nodes ran FP8, lowering / downstream): a row whose node did not run
FP8 (weight-only, for the conditioning rows that expect it) says so.

Measured on an H200 (benchmarks/RESULTS.md, 2026-12-04, before the conditioning rows and the
sensitive-fp8 variant): --quick 38 s, --flux 60-87 s (five variants, 13-20 s of first call each;
regional compilation makes 3 Dynamo graphs and 3 Inductor compiles a variant: the double block, the
first single block, whose input strides differ, the other single blocks; the "graphs" column shows
it). The conditioning rows add 8 small compiles and the sensitive-fp8 variant one Flux variant:
expected about 1 min and 2 min (those runs may have found compile caches warm). Should the compiles be slower, --budget (default 280 s a mode) skips
the variants that would not finish (the last are sensitive fp8, reduce-overhead and multi_kernel; rerun
them with `--flux --flux-variants inductor,torchao,fx_fp8_sens_fp8,fx_fp8_ro,fx_fp8_mk`) and still prints
the tables;
SIGTERM (timeout) prints and saves what was measured, exit status 124.

--dry-run runs every row on CPU at tiny shapes: the reference lowering and eager downstream for
fx_fp8, the eager backend in place of Inductor, CPU SDPA in place of cuDNN / flash, a 2 + 2 block
Flux of width 64, torchao with its GPU check bypassed (it then runs its CPU fallback), the
profiler's outermost aten ops in place of kernels. Any failing cell makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import contextlib
import copy
import gc
import math
import os
import re
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import Timer, Timing, append_section, environment, markdown_table  # noqa: E402

#: (K, N) of Flux-dev's linears: attention projections, fused QKV of a single block, the MLP up and
#: down projections, the single block's output projection (attention + MLP concatenated)
FLUX_LINEAR_SHAPES = [(3072, 3072), (3072, 9216), (3072, 12288), (12288, 3072), (15360, 3072)]
TINY_LINEAR_SHAPES = [(128, 128), (128, 384), (128, 512), (512, 128), (640, 128)]
FLUX_DEV_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
TINY_FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=64,
    pooled_projection_dim=64,
    guidance_embeds=True,
    axes_dims_rope=(8, 12, 12),
)

BF16_EAGER, BF16_INDUCTOR, TORCHAO = "BF16 F.linear (cuBLAS)", "BF16 Inductor", "torchao float8 row-wise"
FX_FP8, FX_FP8_PREPARED = "fx_fp8", "fx_fp8 prepared"
FX_FP8_SENSITIVE_FP8 = "fx_fp8 prepared, sensitive fp8"  # the sensitive linears W8A8 too, as torchao runs them
#: fx_fp8 prepared with Inductor's multi-kernel reductions (inductor_options {"triton.multi_kernel": 1}): the
#: activation quantization's row amax as a persistent reduction too (one read of the row; Inductor makes rows of
#: more than 1024 values looped, two reads: torch/_inductor/choices.py should_use_persistent_reduction, whose
#: threshold multi-kernel raises 16-fold), timed against the looped one at the first call. Every Flux shape has
#: K > 1024 (the H200 measured the quantization at 11-32 % of kernel time, 32 % at K 3072); the dry run takes
#: the tiny shapes with K >= 512 so that the condition is exercised
FX_FP8_MULTI_KERNEL = "fx_fp8 prepared, multi_kernel"
MULTI_KERNEL_MIN_K, DRY_MULTI_KERNEL_MIN_K = 1025, 512
MULTI_KERNEL_OPTIONS = {"triton.multi_kernel": 1}
CUDNN_BF16, FLASH_BF16 = "cuDNN BF16 SDPA", "flash BF16 SDPA"


class Terminated(BaseException):
    """SIGTERM (a `timeout`): stop measuring, print and save what was measured. A BaseException so
    that a cell's `except Exception` does not swallow it."""


@dataclass
class Row:
    section: str  # "linear" | "attention" | "flux"
    case: str
    contender: str
    timing: object = None  # Timing, or a message (error / skipped / not installed)
    first_s: Optional[float] = None
    err: Optional[float] = None
    flop: Optional[float] = None
    note: str = ""  # fx_fp8's report summary, torchao's state
    extra: dict = field(default_factory=dict)  # flux: peak / weights GiB, graphs compiled

    @property
    def ms(self) -> Optional[float]:
        return self.timing.ms if isinstance(self.timing, Timing) else None


class Bench:
    """One run: device, timer, time budget, rows and failed cells."""

    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.timer = Timer(self.device, args.warmup, args.rep)
        self.bf16_backend = "eager" if self.dry else "inductor"
        # fx_fp8 picks the cuda lowering and Inductor from the tensors; on CPU: the reference and eager
        self.fx_options = {"lowering": "reference", "downstream": "eager"} if self.dry else None
        if getattr(args, "fx_options", None):  # --fx-options: fx_fp8 options for every fx_fp8 row
            self.fx_options = {**(self.fx_options or {}), **args.fx_options}
        self.rows: list[Row] = []
        self.errors: list[str] = []
        self.deadline = None
        self.started = time.perf_counter()

    # -- time budget ----------------------------------------------------------------------------
    def start_mode(self, budget_s: Optional[float]) -> None:
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s if budget_s else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def fits(self, needed_s: float) -> bool:
        return self.deadline is None or time.perf_counter() + needed_s <= self.deadline

    # -- cells ----------------------------------------------------------------------------------
    def cell(self, label: str, run: Callable):
        """run() -> value; an exception becomes an 'error: ...' value (and a failing exit status)."""
        try:
            return run()
        except Exception as e:  # report and go on with the other cells
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            self.errors.append(f"{label}: {msg}\n{traceback.format_exc(limit=6)}")
            return f"error: {msg}"

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(progress_line(self, row), flush=True)
        return row

    def measured(
        self, section: str, case: str, contender: str, make: Callable, *, exact=None, flop=None, note: Callable = None
    ) -> Row:
        """One row: make() -> a no-argument callable; its first call (the compile) is timed apart,
        its output compared with `exact`, then Timer.measure; note(fn) describes what ran."""
        row = Row(section, case, contender, flop=flop)

        def run():
            fn = make()
            t0 = time.perf_counter()
            out = fn()
            self.timer.sync()
            row.first_s = time.perf_counter() - t0
            if exact is not None:
                row.err = rel(out, exact)
            if note is not None:
                row.note = note(fn)
            return self.timer.measure(fn, host=is_fx_fp8(contender))

        row.timing = self.cell(f"{section} {case} {contender}", run)
        return self.add(row)


def is_fx_fp8(contender: str) -> bool:
    """The rows whose CPU time host_table attributes."""
    return contender.startswith("fx_fp8")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def progress_line(bench: Bench, row: Row) -> str:
    t = row.timing
    head = f"[{bench.elapsed():5.0f} s] {row.section} {row.case} | {row.contender}"
    if not isinstance(t, Timing):
        return f"{head} | {t}"
    first = f", first call {row.first_s:.1f} s" if row.first_s is not None else ""
    err = f", err {row.err:.2%}" if row.err is not None else ""
    return (
        f"{head} | {t.ms:.3f} ms (wall {t.wall_ms:.3f}, launch {t.launch_ms:.3f}, kernels {t.kernel_ms:.3f})"
        f"{first}{err} | {t.top_kernels()}" + (f" | {row.note}" if row.note else "")
    )


def fx_fp8_summary(compiled, op: str, action: str = "fp8") -> str:
    """What fx_fp8's reports say ran: modules whose `op` ran `action` ("fp8", or "weight-only" for
    W8A16) out of all (a module compiled in several graphs, a recompiled block, counts once),
    lowering / downstream."""
    import fx_fp8

    reports = fx_fp8.get_reports(compiled)
    if not reports:
        return "no fx_fp8 report (did the backend run?)"
    actions = {e.module: e.action for r in reports for e in r.entries if e.op == op}
    hits = sum(a == action for a in actions.values())
    where = ", ".join(sorted({f"{r.lowering}/{r.downstream}" for r in reports}))
    text = f"{op} {action} {hits}/{len(actions)} ({where})"
    if not hits:
        reasons = "; ".join(sorted({e.reason for r in reports for e in r.entries if e.op == op}))
        text += f": NOT {action.upper()} ({reasons[:200]})"
    return text


def fx_fp8_reasons(compiled, op: str) -> str:
    """The reasons fx_fp8's reports give for `op`'s entries (how a linear ran: storage, scales)."""
    import fx_fp8

    return "; ".join(sorted({e.reason for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == op}))


# -- torchao --------------------------------------------------------------------------------------
def torchao_state() -> tuple[Optional[object], str]:
    try:
        import torchao
    except Exception as e:
        return None, f"torchao not installed ({type(e).__name__})"
    return torchao, f"torchao {torchao.__version__}"


def torchao_float8_rowwise(module: nn.Module, dry: bool) -> nn.Module:
    """torchao's float8 dynamic-activation, float8-weight inference recipe with row-wise scales,
    applied to every nn.Linear of `module` in place. set_inductor_config=False: torchao would otherwise
    switch on coordinate-descent tuning in Inductor's global config, for every later compile of the run."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    if dry:  # torchao refuses to quantize without an sm89+ GPU; on CPU its tensors run a fallback
        import torchao.quantization.quant_api as quant_api

        quant_api._check_hardware_support = lambda granularity: None
    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))
    return module


# -- linears ----------------------------------------------------------------------------------------
class OneLinear(nn.Module):
    """An nn.Linear held by a module, as a model holds it: what torch.compile and prepare_model see."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x)


def measure_torchao(bench: Bench, section: str, case: str, torchao, ao_state: str, make: Callable, **common) -> None:
    """torchao's row, or why there is none (not installed)."""
    if torchao is None:
        bench.add(Row(section, case, TORCHAO, ao_state))
    else:
        bench.measured(section, case, TORCHAO, make, note=lambda fn: ao_state, **common)


def seeded_linear(k: int, n: int, device: str) -> nn.Linear:
    """A bf16 K -> N linear with unit-variance outputs and a small bias, from the current RNG state."""
    lin = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device=device) / math.sqrt(k))
        lin.bias.copy_(torch.randn(n, device=device) / 10)
    return lin


def linear_case(m: int, k: int, n: int, device: str):
    """(x, linear, fp64 result) of one seeded M x K -> N linear with bias; x is [1, M, K], as a
    transformer block's activations are."""
    torch.manual_seed(0)
    x = torch.randn(1, m, k, device=device, dtype=torch.bfloat16)
    lin = seeded_linear(k, n, device)
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    return x, lin, exact


def bench_linears(bench: Bench) -> None:
    m = 64 if bench.dry else 4608
    shapes = TINY_LINEAR_SHAPES if bench.dry else FLUX_LINEAR_SHAPES
    torchao, ao_state = torchao_state()
    min_k_multi = DRY_MULTI_KERNEL_MIN_K if bench.dry else MULTI_KERNEL_MIN_K
    longest = 0.0
    for k, n in shapes:
        case = f"{m}x{k}->{n}"
        if not bench.fits(longest):
            for name in (BF16_EAGER, BF16_INDUCTOR, TORCHAO, FX_FP8, FX_FP8_PREPARED) + (
                (FX_FP8_MULTI_KERNEL,) if k >= min_k_multi else ()
            ):
                bench.add(Row("linear", case, name, "skipped: time budget"))
            continue
        t0 = time.perf_counter()
        torch._dynamo.reset()  # a fresh cache per shape: no recompile limit, no stale guards
        x, lin, exact = linear_case(m, k, n, bench.device)
        flop = 2.0 * m * k * n
        fresh = lambda: OneLinear(copy.deepcopy(lin))  # noqa: E731  each contender owns its weights

        def compiled(module, backend, options=None):
            c = torch.compile(module, backend=backend, **({"options": options} if options else {}))
            return lambda: c(x)

        def fx_fp8(prepare: bool, inductor_options=None):
            import fx_fp8 as fx

            module = fresh()
            if prepare:
                fx.prepare_model(module)
            options = with_inductor_options(bench.fx_options, inductor_options)
            c = torch.compile(module, backend="fp8", **({"options": options} if options else {}))
            run = lambda: c(x)  # noqa: E731
            run.compiled = c
            return run

        report = lambda fn: fx_fp8_summary(fn.compiled, "linear")  # noqa: E731
        common = dict(exact=exact, flop=flop)
        bench.measured("linear", case, BF16_EAGER, lambda: lambda: F.linear(x, lin.weight, lin.bias), **common)
        bench.measured("linear", case, BF16_INDUCTOR, lambda: compiled(fresh(), bench.bf16_backend), **common)
        measure_torchao(
            bench,
            "linear",
            case,
            torchao,
            ao_state,
            lambda: compiled(torchao_float8_rowwise(fresh(), bench.dry), bench.bf16_backend),
            **common,
        )
        bench.measured("linear", case, FX_FP8, lambda: fx_fp8(False), note=report, **common)
        bench.measured("linear", case, FX_FP8_PREPARED, lambda: fx_fp8(True), note=report, **common)
        if k >= min_k_multi:
            bench.measured(
                "linear", case, FX_FP8_MULTI_KERNEL, lambda: fx_fp8(True, MULTI_KERNEL_OPTIONS), note=report, **common
            )
        longest = max(longest, time.perf_counter() - t0)


# -- conditioning linears ------------------------------------------------------------------------------
class Modulation(nn.Module):
    """adaLN modulation as a DiT block runs it: a linear on silu(conditioning) (one vector per image,
    no sequence dimension) whose output, cut in (shift, scale, gate) chunks, modulates the token
    stream x [B, S, width]. fx_fp8 finds such a linear by the graph's structure ("adaLN modulation",
    fx_fp8/graph/sensitive.py): its name, `linear`, matches none of fx_fp8's name patterns. The
    linear's output is returned too, so the error is measured on it, not diluted by x."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x, temb):
        emb = self.linear(F.silu(temb))
        chunks = emb.chunk(emb.shape[-1] // x.shape[-1], dim=-1)
        out = x
        for i in range(0, len(chunks), 3):
            shift, scale, gate = chunks[i : i + 3]
            out = out + gate[:, None] * (x * (1 + scale[:, None]) + shift[:, None])
        return out, emb


#: (K, N) of Flux-dev's adaLN modulation linears: a double block's norm1.linear (6 chunks of 3072),
#: a single block's norm.linear (3 chunks)
FLUX_CONDITIONING_SHAPES = [(3072, 18432), (3072, 9216)]
TINY_CONDITIONING_SHAPES = [(128, 768), (128, 384)]
#: contender -> (quantization_config for prepare_model and the backend, the report's expected linear action)
FX_FP8_CONDITIONING = {
    FX_FP8_PREPARED: ({}, "weight-only"),  # the default: sensitive "weight_only", INT8 weights, group 32
    "fx_fp8 prepared, weight-only fp8": ({"sensitive": "weight_only", "weight_only_method": "fp8"}, "weight-only"),
    FX_FP8_SENSITIVE_FP8: ({"sensitive": "fp8"}, "fp8"),
}


def with_inductor_options(options: Optional[dict], inductor_options: Optional[dict]) -> Optional[dict]:
    """fx_fp8 options with Inductor config patches added (on top of --fx-options' own), through the
    Inductor downstream even in the dry run (whose default is eager): inductor_options need it."""
    if not inductor_options:
        return options
    return {**(options or {}), "inductor_options": inductor_options, "downstream": "inductor"}


def with_quantization(options: Optional[dict], quantization: dict) -> Optional[dict]:
    """fx_fp8 options with quantization_config keys added (on top of --fx-options' own). Attention
    stays as it was: a quantization_config alone would be a linear-only opt-in (FP8Config.from_kwargs),
    so the default FP8 attention is named unless the options already say."""
    if not quantization:
        return options
    base = dict(options or {})
    base["quantization_config"] = {**(base.get("quantization_config") or {}), **quantization}
    if "diffusion_kv_cache_dtype" not in base and "kv_cache_dtype" not in base:
        base["diffusion_kv_cache_dtype"] = "fp8"
    return base


def conditioning_case(k: int, n: int, tokens: int, device: str):
    """(x [1, tokens, K], temb [1, K], the linear, fp64 linear output) of one seeded modulation."""
    torch.manual_seed(0)
    x = torch.randn(1, tokens, k, device=device, dtype=torch.bfloat16)
    temb = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    lin = seeded_linear(k, n, device)
    exact = F.silu(temb.double()) @ lin.weight.double().t() + lin.bias.double()
    return x, temb, lin, exact


def bench_conditioning(bench: Bench) -> None:
    """M = 1 (one image): Flux's adaLN modulation linears, which fx_fp8 runs weight-only by default
    and torchao as FP8 W8A8. x is a short token stream (16 tokens): the modulation around the linear
    is there for fx_fp8 to recognise the linear, not to be timed."""
    shapes = TINY_CONDITIONING_SHAPES if bench.dry else FLUX_CONDITIONING_SHAPES
    torchao, ao_state = torchao_state()
    contenders = (BF16_INDUCTOR, TORCHAO, *FX_FP8_CONDITIONING)
    longest = 0.0
    for k, n in shapes:
        case = f"1x{k}->{n} (adaLN)"
        if not bench.fits(longest):
            for name in contenders:
                bench.add(Row("conditioning", case, name, "skipped: time budget"))
            continue
        t0 = time.perf_counter()
        torch._dynamo.reset()
        x, temb, lin, exact = conditioning_case(k, n, 16, bench.device)
        flop = 2.0 * k * n
        fresh = lambda: Modulation(copy.deepcopy(lin))  # noqa: E731
        found = bench.cell(f"conditioning {case} sensitive", lambda: sensitive_by_structure(fresh(), (x, temb)))

        def compiled(module, backend):
            c = torch.compile(module, backend=backend)
            return lambda: c(x, temb)[1]

        def fx_fp8(quantization):
            import fx_fp8 as fx

            if not isinstance(found, dict):
                raise RuntimeError(f"fx_fp8's structural analysis failed: {found}")
            module = fresh()
            options = with_quantization(bench.fx_options, quantization)
            config = (options or {}).get("quantization_config")  # prepare_model and the backend agree
            prepared = fx.prepare_model(module, sensitive=found, **({"quantization_config": config} if config else {}))
            c = torch.compile(module, backend="fp8", **({"options": options} if options else {}))
            run = lambda: c(x, temb)[1]  # noqa: E731
            run.compiled, run.prepared = c, prepared
            return run

        def note(expected):
            def describe(fn):
                kind = "weight-only" if fn.prepared["weight_only"] else "W8A8" if fn.prepared["quantized"] else "native"
                summary = fx_fp8_summary(fn.compiled, "linear", expected)  # names the reasons itself when NOT
                return (
                    f"sensitive by structure: {', '.join(sorted(found.values())) or 'none'}; "
                    f"prepare_model: {kind}, weights {fn.prepared['bytes_after'] / 1e6:.3g} MB; {summary}"
                    + ("" if ": NOT " in summary else f": {fx_fp8_reasons(fn.compiled, 'linear')}")
                )

            return describe

        common = dict(exact=exact, flop=flop)
        bench.measured(
            "conditioning",
            case,
            BF16_INDUCTOR,
            lambda: compiled(fresh(), bench.bf16_backend),
            note=lambda fn: f"weights {lin.weight.nbytes / 1e6:.3g} MB",
            **common,
        )
        measure_torchao(
            bench,
            "conditioning",
            case,
            torchao,
            ao_state,
            lambda: compiled(torchao_float8_rowwise(fresh(), bench.dry), bench.bf16_backend),
            **common,
        )
        for name, (quantization, expected) in FX_FP8_CONDITIONING.items():
            bench.measured("conditioning", case, name, lambda q=quantization: fx_fp8(q), note=note(expected), **common)
        longest = max(longest, time.perf_counter() - t0)


def sensitive_by_structure(module: nn.Module, args: tuple) -> dict:
    """{linear name: reason} fx_fp8's structural analysis finds (the one prepare_model runs with
    example_inputs), so every fx_fp8 row is prepared from one trace and says what was found."""
    from fx_fp8.graph.sensitive import sensitive_linear_names

    return sensitive_linear_names(module, args)


# -- attention --------------------------------------------------------------------------------------
class Attention(nn.Module):
    """A module that calls F.scaled_dot_product_attention, as diffusers' attention processors do."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def sdpa_with(backend_name: str, dry: bool, q, k, v):
    """BF16 SDPA pinned to one backend (CPU SDPA in a dry run)."""
    if dry:
        return lambda: F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def attention_fp64(q, k, v, chunk: int = 512) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D)) V in float64, a query chunk at a time (memory: H x chunk x S)."""
    scale = 1 / math.sqrt(q.shape[-1])
    kd, vd = k.double(), v.double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i in range(0, q.shape[-2], chunk):
        s = (q[..., i : i + chunk, :].double() @ kd.transpose(-1, -2)) * scale
        out[..., i : i + chunk, :] = torch.softmax(s, dim=-1) @ vd
    return out


def bench_attention(bench: Bench) -> None:
    heads, d = (2, 64) if bench.dry else (24, 128)
    seqs = [64, 128, 200] if bench.dry else [4608, 16384, 32760]
    longest = 0.0
    for s in seqs:
        case = f"B1 H{heads} S{s} D{d}"
        if not bench.fits(longest):
            for name in (CUDNN_BF16, FLASH_BF16, FX_FP8):
                bench.add(Row("attention", case, name, "skipped: time budget"))
            continue
        t0 = time.perf_counter()
        torch._dynamo.reset()
        g = torch.Generator(device=bench.device).manual_seed(0)
        q, k = (torch.randn(1, heads, s, d, device=bench.device, generator=g, dtype=torch.bfloat16) for _ in "qk")
        v = (torch.randn(1, heads, s, d, device=bench.device, generator=g) + 0.5).to(torch.bfloat16)
        exact = attention_fp64(q, k, v)
        common = dict(exact=exact, flop=4.0 * heads * s * s * d)

        def fx_fp8():
            c = torch.compile(Attention(), backend="fp8", **({"options": bench.fx_options} if bench.fx_options else {}))
            run = lambda: c(q, k, v)  # noqa: E731
            run.compiled = c
            return run

        bench.measured(
            "attention", case, CUDNN_BF16, lambda: sdpa_with("CUDNN_ATTENTION", bench.dry, q, k, v), **common
        )
        bench.measured(
            "attention", case, FLASH_BF16, lambda: sdpa_with("FLASH_ATTENTION", bench.dry, q, k, v), **common
        )
        bench.measured(
            "attention", case, FX_FP8, fx_fp8, note=lambda fn: fx_fp8_summary(fn.compiled, "attention"), **common
        )
        del exact
        longest = max(longest, time.perf_counter() - t0)


# -- the quick table ----------------------------------------------------------------------------------
def quick_table(rows: list[Row]) -> str:
    base = {}  # case -> the ms the ratios divide: BF16 Inductor (linear), cuDNN BF16 (attention)
    peer = {}
    for r in rows:
        if r.ms is not None and r.contender in (BF16_INDUCTOR, CUDNN_BF16):
            base[r.case] = r.ms
        if r.ms is not None and r.contender == TORCHAO:
            peer[r.case] = r.ms
    out = []
    for r in rows:
        t = r.timing
        if not isinstance(t, Timing):
            out.append([r.case, r.contender, t] + ["-"] * 11 + [r.note])
            continue
        x_base = base[r.case] / t.ms if r.case in base else None
        x_peer = peer[r.case] / t.ms if r.case in peer and r.contender not in (BF16_EAGER, BF16_INDUCTOR) else None
        out.append(
            [
                r.case,
                r.contender,
                t.ms,
                x_base,
                x_peer,
                r.flop / t.ms / 1e9 if r.flop else None,
                t.wall_ms,
                t.launch_ms,
                t.kernel_ms,
                t.busy,
                t.kernels_per_call,
                r.first_s,
                r.err,
                t.top_kernels(),
                r.note,
            ]
        )
    header = [
        "case",
        "contender",
        "ms",
        "x BF16",
        "x torchao",
        "TFLOP/s",
        "wall ms/call",
        "launch ms/call",
        "kernel ms/call",
        "GPU busy",
        "kernels/call",
        "first call s",
        "err",
        "kernels (share of kernel time)",
        "what ran",
    ]
    return markdown_table(header, out)


def host_table(rows: list[Row], n: int = 5) -> str:
    """Where each fx_fp8 row's CPU time per call goes: launch ms next to the Python functions (and
    builtins, e.g. a kernel launch) with the most own time, from Timing.host (cProfile)."""
    out = [
        [r.case, r.contender, r.timing.launch_ms, r.timing.wall_ms, r.timing.top_host(n)]
        for r in rows
        if isinstance(r.timing, Timing) and r.timing.host and is_fx_fp8(r.contender)
    ]
    if not out:
        return "(no fx_fp8 row has a host profile)\n"
    return markdown_table(
        [
            "case",
            "contender",
            "launch ms/call",
            "wall ms/call",
            f"top {n} functions by own ms per call (cProfile: inflated ~1.5-2x)",
        ],
        out,
    )


QUICK_NOTES = (
    "ms: do_bench median, L2 flushed. x BF16: BF16 Inductor ms (linear) or cuDNN BF16 ms (attention) / "
    "ms; x torchao: torchao ms / ms. wall: back-to-back calls, synchronised at the end; launch: the CPU's "
    "time to issue them; kernel: GPU kernel time per call (torch.profiler); GPU busy = kernel / wall. "
    "first call: compile included. err: relative L2 error against fp64 math (linear) or fp64 attention. "
    "Linear: [1, 4608, K] activations, bias, per-row (per-token) activation and per-channel weight scales; "
    "multi_kernel: inductor_options {'triton.multi_kernel': 1} (K > 1024: every shape); "
    "torchao with "
    "set_inductor_config=False (the same Inductor config for every row). Conditioning (adaLN): M = 1, the "
    "linear on silu(temb [1, K]) modulating a 16-token x, timed with that modulation; err of the linear's "
    "output; fx_fp8 prepared with the structural analysis' result, quantization_config as the contender "
    "says (default: sensitive weight-only, INT8 weights, scales per channel and 32 columns); weights: "
    "the bytes the linear reads (prepare_model's bytes_after), so MB / ms is its bandwidth in GB/s."
)


# -- Flux ---------------------------------------------------------------------------------------------
def build_flux(config: dict, device: str, seed: int = 0) -> nn.Module:
    """FluxTransformer2DModel from `config`, built on the meta device and materialised on `device` in
    bf16 with seeded random weights: nothing is downloaded."""
    import diffusers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = diffusers.FluxTransformer2DModel(**config)
        return materialise(model.to(torch.bfloat16), device, seed).eval()


def _norm_params(module: nn.Module) -> bool:
    names = {n for n, _ in module.named_parameters(recurse=False)}
    return "weight" in names and names <= {"weight", "bias"}


def materialise(model: nn.Module, device: str, seed: int = 0) -> nn.Module:
    """A meta-device model on `device` with seeded random weights: each module's own
    reset_parameters (nn.Linear, nn.LayerNorm: torch's default initialisation), norm scales
    (RMSNorm-like modules without one) 1. Anything else is an error naming it, never left undefined."""
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise ValueError(f"materialise cannot initialise buffers {buffers[:5]}: to_empty leaves them undefined")
    unknown = [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False))
        and not hasattr(m, "reset_parameters")
        and not (type(m).__name__.endswith("Norm") and _norm_params(m))
    ]
    if unknown:
        raise ValueError(f"materialise does not know how to initialise {unknown[:5]}")
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                own["weight"].fill_(1.0)
                if "bias" in own:
                    own["bias"].zero_()
    return model


def flux_inputs(config: dict, img_side: int, txt: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16
    ids = torch.zeros(img_side, img_side, 3, device=device)
    ids[..., 1] = torch.arange(img_side, device=device)[:, None]
    ids[..., 2] = torch.arange(img_side, device=device)[None, :]
    kw = dict(
        hidden_states=torch.randn(
            1, img_side * img_side, config["in_channels"], device=device, generator=g, dtype=bf16
        ),
        encoder_hidden_states=torch.randn(
            1, txt, config["joint_attention_dim"], device=device, generator=g, dtype=bf16
        ),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], device=device, generator=g, dtype=bf16),
        timestep=torch.full((1,), 0.5, device=device, dtype=bf16),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3, device=device),
        return_dict=False,
    )
    if config.get("guidance_embeds"):
        kw["guidance"] = torch.full((1,), 3.5, device=device, dtype=bf16)
    return kw


#: --flux-variants keys -> the variants' names, in the order they run: the most wanted first, should
#: the time budget run out
FLUX_VARIANTS = {
    "eager": "BF16 eager",
    "inductor": "BF16 Inductor",
    "fx_fp8": FX_FP8_PREPARED,
    "torchao": TORCHAO,
    "fx_fp8_sens_fp8": FX_FP8_SENSITIVE_FP8,
    "fx_fp8_ro": "fx_fp8 prepared, reduce-overhead",
    "fx_fp8_mk": FX_FP8_MULTI_KERNEL,
}


def regional_compile(model: nn.Module, **compile_kwargs) -> None:
    """Every repeated block compiled on its own, the block class once (diffusers' compile_repeated_blocks,
    or the same by hand where the installed diffusers lacks it)."""
    if hasattr(model, "compile_repeated_blocks"):
        model.compile_repeated_blocks(**compile_kwargs)
        return
    for module in model.modules():
        if type(module).__name__ in ("FluxTransformerBlock", "FluxSingleTransformerBlock", "WanTransformerBlock"):
            module.compile(**compile_kwargs)


def flux_variants(bench: Bench, ao_state: str) -> list[tuple[str, Callable, Callable, Callable]]:
    """(name, prepare(model) -> note, compile(model), note(model)) of the variants --flux-variants asks
    for, in FLUX_VARIANTS' order. Every variant builds its own model (same seed, same weights)."""
    import fx_fp8

    fx = {"options": bench.fx_options} if bench.fx_options else {}
    ro = (
        {"options": {**bench.fx_options, "mode": "reduce-overhead"}}
        if bench.fx_options
        else {"mode": "reduce-overhead"}
    )  # torch.compile takes mode or options, not both

    def report(model):
        return fx_fp8_summary(model, "linear") + "; " + fx_fp8_summary(model, "attention")

    mk = {"options": with_inductor_options(bench.fx_options, MULTI_KERNEL_OPTIONS)}
    sens_fp8 = {"sensitive": "fp8"}
    fx_sens_fp8 = {"options": with_quantization(bench.fx_options, sens_fp8)}

    def prepared(model, quantization=None):
        r = fx_fp8.prepare_model(model, **({"quantization_config": quantization} if quantization else {}))
        return (
            f"prepare_model: {len(r['quantized'])} linears quantized ({len(r['weight_only'])} of them "
            f"weight-only), {len(r['native'])} native"
        )

    def torchao_quantized(model):
        torchao_float8_rowwise(model, bench.dry)
        return f"{ao_state}: quantize_ on every nn.Linear"

    every = {
        "eager": (None, None, None),
        "inductor": (None, lambda m: regional_compile(m, backend=bench.bf16_backend), None),
        "fx_fp8": (prepared, lambda m: regional_compile(m, backend="fp8", **fx), report),
        "torchao": (torchao_quantized, lambda m: regional_compile(m, backend=bench.bf16_backend), None),
        "fx_fp8_sens_fp8": (
            lambda m: prepared(m, fx_sens_fp8["options"]["quantization_config"]),
            lambda m: regional_compile(m, backend="fp8", **fx_sens_fp8),
            report,
        ),
        "fx_fp8_ro": (prepared, lambda m: regional_compile(m, backend="fp8", **ro), report),
        "fx_fp8_mk": (prepared, lambda m: regional_compile(m, backend="fp8", **mk), report),
    }
    return [(FLUX_VARIANTS[key], *every[key]) for key in FLUX_VARIANTS if key in bench.args.flux_variants]


def bench_flux(bench: Bench) -> None:
    try:
        import diffusers  # noqa: F401
    except Exception as e:
        bench.add(Row("flux", "model", "all", f"skipped: diffusers not importable ({type(e).__name__}: {e})"))
        return
    config = dict(TINY_FLUX_CONFIG if bench.dry else FLUX_DEV_CONFIG)
    if bench.args.flux_depth:
        config["num_layers"], config["num_single_layers"] = bench.args.flux_depth
    img_side, txt = (8, 16) if bench.dry else (64, 512)
    case = (
        f"{config['num_layers']}+{config['num_single_layers']} blocks, width "
        f"{config['num_attention_heads'] * config['attention_head_dim']}, {img_side * img_side}+{txt} tokens"
    )
    kwargs = flux_inputs(config, img_side, txt, bench.device)
    torchao, ao_state = torchao_state()
    reference = None
    longest = 0.0
    for name, prepare, compile_, note in flux_variants(bench, ao_state):
        if name == TORCHAO and torchao is None:
            bench.add(Row("flux", case, name, ao_state))
            continue
        if not bench.fits(longest):
            bench.add(Row("flux", case, name, "skipped: time budget"))
            continue
        t0 = time.perf_counter()
        row = Row("flux", case, name)

        def run(prepare=prepare, compile_=compile_, note=note, row=row):
            model = build_flux(config, bench.device)
            notes = [prepare(model)] if prepare else []
            row.extra["build s"] = time.perf_counter() - t0
            if compile_ is not None:
                compile_(model)
            timing, out = measure_model(bench, row, lambda: model(**kwargs)[0], reference)
            row.note = "; ".join(notes + ([note(model)] if note else []))
            return timing, out

        result = bench.cell(f"flux {name}", run)
        if isinstance(result, tuple):
            row.timing, out = result
            if reference is None and name == "BF16 eager":
                reference = out
        else:
            row.timing = result
        bench.add(row)
        torch._dynamo.reset()  # the next variant compiles the same block classes afresh (recompile limit)
        gc.collect()
        if bench.device == "cuda":
            torch.cuda.empty_cache()
        longest = max(longest, time.perf_counter() - t0)


# -- Wan ----------------------------------------------------------------------------------------------
#: WanTransformer3DModel shapes: Wan2.1-1.3B (torchao's published case) and Wan2.1-14B (diffusers' defaults),
#: in the order --wan runs them: should --budget run out, the 14B variants are the ones skipped
WAN_COMMON = dict(
    patch_size=(1, 2, 2),
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
WAN_SHAPES = {
    "1.3b": dict(WAN_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30),  # first: cheaper
    "14b": dict(WAN_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40),
}
#: the model zoo's tiny Wan (the dry run)
TINY_WAN_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=4,
    out_channels=4,
    text_dim=64,
    freq_dim=64,
    ffn_dim=128,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
#: (height, width, frames) of a video -> latent (frames, height, width): Wan's VAE compresses 4x in time, 8x in
#: space; the (1, 2, 2) patches make 480x832 x 81 frames 21 x 30 x 52 = 32760 tokens, 720x1280 75600
WAN_RESOLUTIONS = {"480p": (480, 832, 81), "720p": (720, 1280, 81)}
WAN_TEXT_TOKENS = 512
FX_FP8_FORCED = "fx_fp8 prepared, FP8 attention forced"
TORCHAO_ATTENTION = "torchao float8 row-wise + FP8 attention"
#: --wan-variants keys -> the variants' names, in the order they run
WAN_VARIANTS = {
    "eager": "BF16 eager",
    "inductor": "BF16 Inductor",
    "fx_fp8": FX_FP8_PREPARED,
    "fx_fp8_fp8_attention": FX_FP8_FORCED,
    "torchao": TORCHAO,
    "torchao_attention": TORCHAO_ATTENTION,
}
#: timed forwards a Wan variant (a 14B forward at 32760 tokens takes seconds)
WAN_FORWARDS = 3


def wan_tokens(config: dict, height: int, width: int, frames: int) -> int:
    pt, ph, pw = config["patch_size"]
    return ((frames - 1) // 4 + 1) // pt * (height // 8 // ph) * (width // 8 // pw)


def build_wan(config: dict, device: str, seed: int = 0) -> nn.Module:
    """WanTransformer3DModel from `config`, built on `device` in bf16 with seeded random weights (each
    module's own initialisation; the rotary tables computed as diffusers does): nothing is downloaded."""
    import diffusers

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings(), torch.device(device):
            warnings.simplefilter("ignore")
            torch.set_default_dtype(torch.bfloat16)  # parameters made in bf16: no fp32 copy of 14B weights
            model = diffusers.WanTransformer3DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def wan_inputs(config: dict, height: int, width: int, frames: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    latent = (1, config["in_channels"], (frames - 1) // 4 + 1, height // 8, width // 8)
    return dict(
        hidden_states=torch.randn(latent, device=device, generator=g, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(
            1,
            WAN_TEXT_TOKENS if device == "cuda" else 16,
            config["text_dim"],
            device=device,
            generator=g,
            dtype=torch.bfloat16,
        ),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        return_dict=False,
    )


def default_sdpa_backend(heads: int, tokens: int, head_dim: int, device: str) -> str:
    """The backend torch's default SDPA dispatch picks for Wan's self-attention (bf16, no mask)."""
    if device != "cuda":
        return "CPU SDPA (dry run)"
    q = torch.empty(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16)
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, q, q)).name
    except Exception as e:  # a private API: say so rather than guess
        return f"unknown ({type(e).__name__}: {e})"


def wan_variants(bench: Bench, ao_state: str) -> list[tuple[str, Callable, Callable, Callable]]:
    """(name, prepare(model) -> note, compile(model), note(model)) of the --wan-variants, in WAN_VARIANTS'
    order. Each builds its own model (same seed, same weights); every block class compiled once."""
    import fx_fp8

    forced = {
        **(bench.fx_options or {}),
        "attention": {**(bench.fx_options or {}).get("attention", {}), "kernel": "triton"},
    }
    fx = {"options": bench.fx_options} if bench.fx_options else {}

    def report(model):
        return fx_fp8_summary(model, "linear") + "; " + fx_fp8_summary(model, "attention")

    def prepared(model):
        r = fx_fp8.prepare_model(model)
        return (
            f"prepare_model: {len(r['quantized'])} linears quantized ({len(r['weight_only'])} of them "
            f"weight-only), {len(r['native'])} native"
        )

    def torchao_quantized(model, attention=False):
        torchao_float8_rowwise(model, bench.dry)
        note = f"{ao_state}: quantize_ on every nn.Linear"
        if attention:
            from torchao.prototype.attention import apply_low_precision_attention

            apply_low_precision_attention(model)  # rewrites F.scaled_dot_product_attention calls (its default backend)
            note += "; torchao.prototype.attention.apply_low_precision_attention (default config)"
        return note

    every = {
        "eager": (None, None, None),
        "inductor": (None, lambda m: regional_compile(m, backend=bench.bf16_backend), None),
        "fx_fp8": (prepared, lambda m: regional_compile(m, backend="fp8", **fx), report),
        "fx_fp8_fp8_attention": (prepared, lambda m: regional_compile(m, backend="fp8", options=forced), report),
        "torchao": (torchao_quantized, lambda m: regional_compile(m, backend=bench.bf16_backend), None),
        "torchao_attention": (
            lambda m: torchao_quantized(m, attention=True),
            lambda m: regional_compile(m, backend=bench.bf16_backend),
            None,
        ),
    }
    return [(WAN_VARIANTS[key], *every[key]) for key in WAN_VARIANTS if key in bench.args.wan_variants]


def bench_wan(bench: Bench) -> None:
    try:
        import diffusers  # noqa: F401
    except Exception as e:
        bench.add(Row("wan", "model", "all", f"skipped: diffusers not importable ({type(e).__name__}: {e})"))
        return
    torchao, ao_state = torchao_state()
    cases = (
        [("tiny", "dry")] if bench.dry else [(m, r) for r in bench.args.wan_resolutions for m in bench.args.wan_models]
    )
    for model_key, res in cases:
        config = dict(TINY_WAN_CONFIG if bench.dry else WAN_SHAPES[model_key])
        if bench.args.wan_depth:
            config["num_layers"] = bench.args.wan_depth
        height, width, frames = (32, 32, 9) if bench.dry else WAN_RESOLUTIONS[res]
        tokens = wan_tokens(config, height, width, frames)
        heads = config["num_attention_heads"]
        case = (
            f"Wan {model_key} ({config['num_layers']} blocks, width {heads * config['attention_head_dim']}, "
            f"{heads} heads, FFN {config['ffn_dim']}), {height}x{width} x {frames} frames = {tokens} tokens"
        )
        sdpa = default_sdpa_backend(heads, tokens, config["attention_head_dim"], bench.device)
        kwargs = wan_inputs(config, height, width, frames, bench.device)
        reference, longest = None, 0.0
        for name, prepare, compile_, note in wan_variants(bench, ao_state):
            if name in (TORCHAO, TORCHAO_ATTENTION) and torchao is None:
                bench.add(Row("wan", case, name, ao_state))
                continue
            if name == TORCHAO_ATTENTION and bench.dry:
                bench.add(Row("wan", case, name, "not in a dry run: its FP8 attention is FlashAttention-3's (GPU)"))
                continue
            if not bench.fits(longest):
                bench.add(Row("wan", case, name, "skipped: time budget"))
                continue
            t0 = time.perf_counter()
            row = Row("wan", case, name)

            def run(prepare=prepare, compile_=compile_, note=note, row=row):
                model = build_wan(config, bench.device)
                notes = [prepare(model)] if prepare else []
                row.extra["build s"] = time.perf_counter() - t0
                if compile_ is not None:
                    compile_(model)
                timing, out = measure_model(
                    bench, row, lambda: model(**kwargs)[0], reference, forwards=2 if bench.dry else WAN_FORWARDS
                )
                if name in ("BF16 eager", "BF16 Inductor"):
                    notes.append(f"SDPA default dispatch: {sdpa}")
                row.note = "; ".join(notes + ([note(model)] if note else []))
                return timing, out

            result = bench.cell(f"wan {name}", run)
            if isinstance(result, tuple):
                row.timing, out = result
                if reference is None and name == "BF16 eager":
                    reference = out
            else:
                row.timing = result
            bench.add(row)
            torch._dynamo.reset()
            gc.collect()
            if bench.device == "cuda":
                torch.cuda.empty_cache()
            longest = max(longest, time.perf_counter() - t0)


def compile_counts() -> tuple[int, int, int]:
    """(graphs Dynamo traced, Inductor FX-graph compiles, FX-graph cache hits) so far in this process."""
    from torch._dynamo.utils import counters

    ind = counters["inductor"]
    return (
        counters["stats"]["unique_graphs"],
        ind["fxgraph_cache_miss"] + ind["fxgraph_cache_bypass"],
        ind["fxgraph_cache_hit"],
    )


def measure_model(
    bench: Bench, row: Row, forward: Callable, reference, forwards: Optional[int] = None
) -> tuple[Timing, torch.Tensor]:
    """First call (compile), two more (CUDA graphs: warm-up, recording), the output of the fourth
    (a replay) against `reference`, then `forwards` back-to-back forwards (default 5, 2 in a dry run)
    and one profiled forward."""
    before = compile_counts()
    if bench.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row.extra["weights GiB"] = torch.cuda.memory_allocated() / 2**30

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # one forward = one CUDA-graph step (a no-op without)
        return forward()

    t0 = time.perf_counter()
    step()
    bench.timer.sync()
    row.first_s = time.perf_counter() - t0
    after = compile_counts()
    row.extra["graphs"] = f"{after[0] - before[0]} / {after[1] - before[1]} (+{after[2] - before[2]} cached)"
    for _ in range(2):
        step()
    out = step().clone()  # a replay's output is overwritten by the next one
    if reference is not None:
        row.err = rel(out, reference)
    wall, launch = bench.timer.wall_and_launch(step, forwards or (2 if bench.dry else 5))
    kernel_ms, per_call, kernels = bench.timer.profile(step, 1)  # one forward: thousands of kernels
    host = bench.timer.host_profile(step, 1, top=12) if is_fx_fp8(row.contender) else []
    if bench.device == "cuda":
        row.extra["peak GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return Timing(wall, wall, launch, kernel_ms, per_call, kernels, host), out


def flux_table(rows: list[Row]) -> str:
    by = {r.contender: r.ms for r in rows if r.ms is not None}
    base, peer = by.get("BF16 Inductor"), by.get(TORCHAO)
    out = []
    for r in rows:
        t = r.timing
        if not isinstance(t, Timing):
            out.append([r.contender, t] + ["-"] * 12 + [r.note])
            continue
        e = r.extra
        out.append(
            [
                r.contender,
                t.ms,
                base / t.ms if base else None,
                peer / t.ms if peer and r.contender != "BF16 eager" else None,
                r.first_s,
                e.get("build s"),
                e.get("graphs"),
                e.get("peak GiB"),
                e.get("weights GiB"),
                t.launch_ms,
                t.kernel_ms if t.kernel_ms > 0 else None,
                t.busy if t.kernel_ms > 0 else None,
                r.err,
                t.top_kernels(),
                r.note,
            ]
        )
    header = [
        "variant",
        "ms / forward",
        "x BF16 Inductor",
        "x torchao",
        "first call s",
        "build s",
        "graphs: Dynamo / Inductor",
        "peak GiB",
        "weights GiB",
        "launch ms",
        "kernel ms",
        "GPU busy",
        "err vs BF16 eager",
        "kernels (share of kernel time)",
        "what ran",
    ]
    return markdown_table(header, out)


def _by_kernel_family(kernels) -> dict:
    """{name: ms} with Inductor's numbered kernels of one fused pattern (triton_red_fused_..._0, _1) summed
    under the name without the number: each variant numbers its kernels its own way."""
    out: dict = {}
    for name, ms, _ in kernels:
        key = re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name
        out[key] = out.get(key, 0.0) + ms
    return out


def kernel_attribution_table(rows: list[Row], top: int = 15) -> str:
    """GPU kernel time per forward, kernel by kernel, side by side: a row per kernel short name
    (Timing.kernels), a column per variant with kernels (ms per forward; blank where the variant ran
    no such kernel), and "fx_fp8 prepared - torchao" (a missing kernel counts 0) when both ran. The
    `top` kernels with the largest absolute difference come first (without both variants: the largest
    time in any variant), then "all others" (the rest, summed) and "total", each variant's kernel_ms."""
    measured = [r for r in rows if isinstance(r.timing, Timing) and r.timing.kernels]
    if not measured:
        return "(no variant has GPU kernel times to attribute)\n"
    columns = [(r.contender, _by_kernel_family(r.timing.kernels), r.timing.kernel_ms) for r in measured]
    by = {name: (kernels, total) for name, kernels, total in columns}
    diff = None
    if FX_FP8_PREPARED in by and TORCHAO in by:
        ours, theirs = by[FX_FP8_PREPARED][0], by[TORCHAO][0]
        diff = lambda k: ours.get(k, 0.0) - theirs.get(k, 0.0)  # noqa: E731
        order_key = lambda k: (-abs(diff(k)), k)  # noqa: E731
    else:
        order_key = lambda k: (-max(kernels.get(k, 0.0) for _, kernels, _ in columns), k)  # noqa: E731
    names = sorted(set().union(*(kernels for _, kernels, _ in columns)), key=order_key)
    shown, rest = names[:top], names[top:]
    out = [[k] + [kernels.get(k, "") for _, kernels, _ in columns] + ([diff(k)] if diff else []) for k in shown]
    if rest:
        out.append(
            [f"all others ({len(rest)} kernels)"]
            + [sum(kernels.get(k, 0.0) for k in rest) for _, kernels, _ in columns]
            + ([sum(diff(k) for k in rest)] if diff else [])
        )
    out.append(
        ["total"] + [total for _, _, total in columns] + ([by[FX_FP8_PREPARED][1] - by[TORCHAO][1]] if diff else [])
    )
    header = (
        ["kernel"] + [f"{name} ms" for name, _, _ in columns] + ([f"{FX_FP8_PREPARED} - {TORCHAO} ms"] if diff else [])
    )
    return markdown_table(header, out)


FLUX_NOTES = (
    "ms / forward: 5 back-to-back forwards after 4 (compile, warm-up, CUDA-graph recording, a replay: err), "
    "synchronised at the end. first call: compile of every block class included (regional: "
    "compile_repeated_blocks). build: meta-device model materialised with random weights, then "
    "torchao's quantize_ or fx_fp8's prepare_model. graphs: new Dynamo graphs / Inductor FX-graph "
    "compiles at the first call. peak: max allocated from the first call on; weights: allocated before it. "
    "kernel ms: GPU kernel time per forward (torch.profiler; '-' when the profiler saw none, as it may "
    "inside CUDA graphs). err: relative L2 error of the output against BF16 eager on the same weights."
)


WAN_NOTES = (
    f"As --flux, with {WAN_FORWARDS} timed forwards a variant. Random bf16 weights (each module's own "
    "initialisation), latent noise, 512 text tokens of width 4096, timestep 500. BF16 rows name the backend "
    "torch's default SDPA dispatch picks for the self-attention. FP8 attention forced: attention.kernel "
    "triton (auto keeps attention native where the measured table says BF16 is faster). torchao + FP8 "
    "attention: torchao.prototype.attention.apply_low_precision_attention on the float8 row-wise model."
)


ATTRIBUTION_NOTES = (
    "ms per forward of each kernel (torch.profiler, one profiled forward; kernels are named without "
    "templates or parameters, so Inductor's fused kernels are told apart by their generated names). "
    "Largest |fx_fp8 prepared - torchao| first; all others: the remaining kernels summed; total: "
    "the variant's kernel ms. Blank: the variant ran no such kernel (0 in the difference). "
    "A variant whose forward the profiler saw no kernels of (CUDA graphs) has no column."
)


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="linears, conditioning (adaLN, M 1) linears and attention (the default with no mode)",
    )
    ap.add_argument(
        "--flux",
        action="store_true",
        help="the full-depth Flux-dev model, and its GPU kernel time by kernel per variant",
    )
    ap.add_argument(
        "--wan",
        action="store_true",
        help="Wan2.1-shaped video transformers (14B, 1.3B) at 480p x 81 frames, kernel time by kernel",
    )
    ap.add_argument(
        "--wan-models",
        type=_choices(WAN_SHAPES),
        default=tuple(WAN_SHAPES),
        metavar="KEYS",
        help=f"comma list from {','.join(WAN_SHAPES)} (default: both)",
    )
    ap.add_argument(
        "--wan-resolutions",
        type=_choices(WAN_RESOLUTIONS),
        default=("480p",),
        metavar="KEYS",
        help=f"comma list from {','.join(WAN_RESOLUTIONS)} (default 480p: 32760 tokens; 720p: 75600)",
    )
    ap.add_argument(
        "--wan-depth",
        type=int,
        default=None,
        metavar="BLOCKS",
        help="blocks of every Wan model (default: the model's own, 40 / 30)",
    )
    ap.add_argument(
        "--wan-variants",
        type=_choices(WAN_VARIANTS),
        default=tuple(WAN_VARIANTS),
        metavar="KEYS",
        help=f"comma list of Wan variants from {','.join(WAN_VARIANTS)} (default: all)",
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: every row, to check the script")
    ap.add_argument("--out", help="append a dated markdown section with the tables to this file")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds per mode before remaining rows are skipped (default 280 on a GPU, none in a dry run)",
    )
    ap.add_argument(
        "--flux-depth",
        type=_depth,
        default=None,
        metavar="DOUBLE,SINGLE",
        help="blocks of the Flux model (default Flux-dev's 19,38; the dry run's 2,2)",
    )
    ap.add_argument(
        "--flux-variants",
        type=_variants,
        default=tuple(FLUX_VARIANTS),
        metavar="KEYS",
        help=f"comma list of Flux variants to run, from {','.join(FLUX_VARIANTS)} (default: all; "
        "the ratios need 'inductor' and 'torchao' in the same run)",
    )
    ap.add_argument(
        "--fx-options",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='fx_fp8 options for every fx_fp8 row, e.g. \'{"diffusion_kv_cache_dtype": null}\' (attention native)',
    )
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    args = ap.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        ap.error(f"--budget must be positive seconds, got {args.budget}")
    if args.wan_depth is not None and args.wan_depth < 1:
        ap.error(f"--wan-depth must be at least 1 block, got {args.wan_depth}")
    if not args.quick and not args.flux and not args.wan:
        args.quick = True
        args.flux = args.dry_run  # a dry run checks both modes; a GPU run without a mode is --quick
    if args.budget is None and not args.dry_run:
        args.budget = 280.0
    return args


def _depth(text: str) -> tuple[int, int]:
    try:
        double, single = (int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DOUBLE,SINGLE block counts like 19,38, got {text!r}") from None
    if double < 1 or single < 0:
        raise argparse.ArgumentTypeError(f"expected at least one double block and no negative count, got {text!r}")
    return double, single


def _variants(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in FLUX_VARIANTS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown Flux variants {unknown or text!r}: expected a comma list of {', '.join(FLUX_VARIANTS)}"
        )
    return keys


def _choices(table: dict) -> Callable:
    def parse(text: str) -> tuple[str, ...]:
        keys = tuple(k.strip() for k in text.split(",") if k.strip())
        unknown = [k for k in keys if k not in table]
        if unknown or not keys:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or text!r}: expected a comma list of {', '.join(table)}"
            )
        return keys

    return parse


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "cuda_bench.py needs a CUDA GPU (sm89+ for FP8); use --dry-run to check the script on CPU", file=sys.stderr
        )
        return 2
    bench = Bench(args)
    env = environment(bench.device)
    print("\n".join(f"- {x}" for x in env) + "\n", flush=True)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    modes = [m for m in ("quick", "flux", "wan") if getattr(args, m)]
    parts, status, t_start = [], 0, time.perf_counter()
    try:
        with torch.no_grad(), _quiet():
            for mode in modes:
                first = len(bench.rows)
                bench.start_mode(args.budget)
                try:
                    if mode == "quick":
                        bench_linears(bench)
                        bench_conditioning(bench)
                        bench_attention(bench)
                    elif mode == "wan":
                        bench_wan(bench)
                    else:
                        bench_flux(bench)
                finally:
                    parts.append(render(mode, bench.rows[first:], bench.elapsed()))
    except Terminated:
        status = 124
        parts = parts or [""]
        parts[-1] += "\n(stopped by SIGTERM: the rows above are what was measured)\n"
    finally:
        signal.signal(signal.SIGTERM, previous)
    total = time.perf_counter() - t_start
    for part in parts:
        print("\n" + part, flush=True)
    if bench.errors:
        status = status or 1
        print(f"\n{len(bench.errors)} cell(s) failed:", file=sys.stderr)
        for e in bench.errors:
            print(e, file=sys.stderr)
    if args.out:
        command = "python benchmarks/cuda_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        append_section(
            args.out, "cuda_bench.py " + " ".join(f"--{m}" for m in modes), env, command, total, "\n".join(parts)
        )
        print(f"appended to {args.out}")
    return status


def render(mode: str, rows: list[Row], seconds: float) -> str:
    if mode == "quick":
        return (
            f"### cuda_bench --quick: linears, conditioning linears and attention, bf16 ({seconds:.0f} s)\n\n"
            + quick_table(rows)
            + "\n"
            + QUICK_NOTES
            + "\n\n"
            + "#### CPU time per call of the fx_fp8 rows, by Python function\n\n"
            + host_table(rows)
        )
    if mode == "wan":
        cases = list(dict.fromkeys(r.case for r in rows))
        return (
            "".join(
                f"### cuda_bench --wan: {case}, regional compile ({seconds:.0f} s in all)\n\n"
                + flux_table([r for r in rows if r.case == case])
                + "\n"
                + WAN_NOTES
                + "\n\n"
                + "#### GPU kernel time per forward, by kernel\n\n"
                + kernel_attribution_table([r for r in rows if r.case == case])
                + "\n"
                + ATTRIBUTION_NOTES
                + "\n\n"
                for case in cases
            )
            or "### cuda_bench --wan: no rows\n"
        )
    return (
        f"### cuda_bench --flux: {rows[0].case if rows else 'Flux'}, regional compile ({seconds:.0f} s)\n\n"
        + flux_table(rows)
        + "\n"
        + FLUX_NOTES
        + "\n\n"
        + "#### GPU kernel time per forward, by kernel\n\n"
        + kernel_attribution_table(rows)
        + "\n"
        + ATTRIBUTION_NOTES
        + "\n\n"
        + "#### CPU time per forward of the fx_fp8 variants, by Python function\n\n"
        + host_table(rows, 10)
    )


@contextlib.contextmanager
def _quiet():
    """Library warnings once, not per row (diffusers' dtype notes, torchao's deprecations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("once")
        yield


if __name__ == "__main__":
    code = main()
    if code == 124:  # stopped mid-compile: skip the interpreter's shutdown, which may wait on what was cut short
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
