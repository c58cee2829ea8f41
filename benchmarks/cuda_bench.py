"""FP8 vs BF16 on one CUDA GPU (written for an H200; sm90): linears, attention, a Flux-sized transformer.

    python benchmarks/cuda_bench.py                                   # GPU: all tables, < 8 min on an H200
    python benchmarks/cuda_bench.py --out benchmarks/RESULTS.md       # ... and append a dated section
    python benchmarks/cuda_bench.py --dry-run                         # CPU: every row at tiny shapes

Tables, each row a shape, each column a contender, then ratios and errors:
(a) linear [M, K] x [K, N] + bias at M in {4096, 4608, 8192} and Flux's 3072->3072,
    3072->12288, 12288->3072: BF16 (cuBLAS via F.linear, and Inductor), torchao's
    float8 row-wise (if torchao imports), fx_fp8 W8A8 FP8 with fast accumulation on
    and off, fx_fp8 W8A8 INT8. The fx_fp8 columns run what the linear pass emits:
    per-token activation quantization as torch ops compiled by Inductor, then
    fx_fp8::scaled_mm (torch._scaled_mm / torch._int_mm + fused rescale).
(b) attention B1 H24 D128 bf16 at S in {4608, 16384, 32760}: cuDNN and flash BF16
    SDPA, fx_fp8's Triton FP8 kernel (quantization pre-pass included, and alone),
    fx_fp8's cuDNN FP8 path (nvidia-cudnn-frontend, per-tensor scales; if usable).
(c) a Flux-dev-sized FluxTransformer2DModel, 2 double + 2 single blocks, random
    weights, 4096 image + 512 text tokens: BF16 under Inductor vs backend "fp8"
    (Inductor downstream). Needs diffusers; skipped with a message otherwise.
(d) weight-only (W8A16) linears: BF16 F.linear vs fx_fp8's fused Triton dequant + GEMM
    (FP8 / INT8 per-channel, INT8 per 32-column group) vs the unfused fallback, at
    Flux's conditioning shapes (M 1-2: weight-streaming GEMVs) and M 4096.
Times: triton.testing.do_bench (median ms; L2 flushed before every run, one
synchronize per measurement). Relative errors against fp32 math (linear) or
BF16 flash SDPA (attention) or the BF16 model (Flux).

--dry-run runs every row on CPU at tiny shapes (reference lowering for the
linears, the Triton kernels in Triton's interpreter, torch.compile with the
eager backend) to check the script end to end, and lists the cells a GPU fills.
Any row that fails is reported in its table and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Bench:
    """Timing, error recording and the list of cells a GPU run fills, for one run."""

    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.lowering = "reference" if self.dry else "cuda"
        self.errors: list[str] = []
        self.gpu_cells: list[str] = []

    def ms(self, fn) -> float:
        """Median milliseconds of fn()."""
        if self.dry:
            fn()
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median")

    def compile(self, fn):
        """Inductor on the GPU; the eager backend in a dry run (Dynamo and the custom ops, no codegen)."""
        return torch.compile(fn, backend="eager" if self.dry else "inductor", dynamic=False)

    def cell(self, label: str, run):
        """run() -> value; an exception becomes an 'error: ...' cell (and a failing exit status)."""
        try:
            return run()
        except Exception as e:  # report and keep benchmarking the other cells
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            self.errors.append(f"{label}: {msg}\n{traceback.format_exc(limit=4)}")
            return f"error: {msg}"

    def on_gpu(self, what: str) -> None:
        if self.dry:
            self.gpu_cells.append(what)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def table(title: str, header: list[str], rows: list[list], notes: list[str] = ()) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def ratio(a, b):
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"


def best(*vals):
    nums = [v for v in vals if isinstance(v, float) and v == v]
    return min(nums) if nums else float("nan")


# -- (a) linear ---------------------------------------------------------------------------------
def _torchao_linear(w, bias):
    """torchao's float8 dynamic activation x float8 weight, row-wise scales (its default FP8 inference recipe)."""
    from torchao.quantization import PerRow, quantize_

    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig as Config
        config = Config(granularity=PerRow())
    except ImportError:  # torchao < 0.10
        from torchao.quantization import float8_dynamic_activation_float8_weight

        config = float8_dynamic_activation_float8_weight(granularity=PerRow())
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=True, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(bias)
    quantize_(lin, config)
    return lin


def _fx_fp8_linear(bench, w, bias, method: str, fast_accum: bool):
    """What fx_fp8's linear pass emits for a dynamic per-token W8A8 linear: activation quantization as
    torch ops (Inductor fuses them), then fx_fp8::scaled_mm with the prepared weight."""
    import fx_fp8  # noqa: F401  registers torch.ops.fx_fp8
    from fx_fp8.ops import quant

    wq, ws = quant.quantize_weight(w, "channel", method=method)
    lowering = bench.lowering

    def linear(x):
        xq, xs = quant.quantize_per_row(x, method)
        return torch.ops.fx_fp8.scaled_mm(xq, xs, wq, ws, bias, method=method, weight_granularity="channel",
                                          weight_block=[], out_dtype=x.dtype, fast_accum=fast_accum,
                                          lowering=lowering)

    return bench.compile(linear)


def bench_linear(bench: Bench) -> str:
    dev, dt = bench.device, torch.bfloat16
    ms_list = [64] if bench.dry else [4096, 4608, 8192]
    shapes = [(128, 128), (128, 256), (256, 128)] if bench.dry else [(3072, 3072), (3072, 12288), (12288, 3072)]
    try:
        import torchao
        torchao_state = f"torchao {torchao.__version__}"
    except Exception as e:
        torchao, torchao_state = None, f"not installed ({type(e).__name__})"
    rows = []
    for m in ms_list:
        for k, n in shapes:
            torch._dynamo.reset()  # a fresh cache per shape: no recompile limit, no stale guards
            x, w, bias, exact, label = _linear_case(m, k, n, dev, dt)
            flop = 2.0 * m * k * n
            outs = {}

            def timed(name, make):
                def run():
                    fn = make()
                    with torch.no_grad():
                        outs[name] = fn()
                        return bench.ms(fn)
                return bench.cell(f"linear {label} {name}", run)

            t_mm = timed("bf16", lambda: (lambda: F.linear(x, w, bias)))
            bench.on_gpu(f"(a) {label} BF16 Inductor (dry run: eager backend)")
            t_ind = timed("bf16_inductor", lambda: (lambda f=bench.compile(lambda t: F.linear(t, w, bias)): f(x)))
            if torchao is None:
                t_ao = torchao_state
            else:
                t_ao = timed("torchao", lambda: (lambda f=bench.compile(_torchao_linear(w, bias)): f(x)))
            bench.on_gpu(f"(a) {label} fx_fp8 FP8 / INT8 (dry run: reference lowering, eager backend)")
            t_fast = timed("fp8_fast", lambda: (lambda f=_fx_fp8_linear(bench, w, bias, "fp8", True): f(x)))
            t_exact = timed("fp8_exact", lambda: (lambda f=_fx_fp8_linear(bench, w, bias, "fp8", False): f(x)))
            t_int8 = timed("int8", lambda: (lambda f=_fx_fp8_linear(bench, w, bias, "int8", False): f(x)))
            t_bf16 = best(t_mm, t_ind)
            err = {name: rel(o, exact) for name, o in outs.items()}
            rows.append([label, t_mm, t_ind, t_ao, t_fast, t_exact, t_int8,
                         flop / t_fast / 1e9 if isinstance(t_fast, float) else "-",
                         ratio(t_bf16, t_ao), ratio(t_bf16, t_fast), ratio(t_bf16, t_exact), ratio(t_bf16, t_int8),
                         err.get("bf16", "-"), err.get("torchao", "-"), err.get("fp8_fast", "-"),
                         err.get("int8", "-")])
    header = ["M x K -> N", "BF16 mm ms", "BF16 Inductor ms", "torchao FP8 row ms", "fx_fp8 FP8 fast ms",
              "fx_fp8 FP8 exact-acc ms", "fx_fp8 INT8 ms", "fx_fp8 FP8 fast TFLOP/s", "x torchao",
              "x FP8 fast", "x FP8 exact", "x INT8", "err BF16", "err torchao", "err FP8", "err INT8"]
    notes = ["x = best BF16 ms / ms (speedup); err = ||out - fp32 math|| / ||fp32 math||; activation quantization "
             "included in every quantized column; per-channel weight scales, per-token activations."]
    if torchao is None:
        notes.append(f"torchao: {torchao_state}")
    return table("(a) linear + bias, bf16 activations", header, rows, notes)


# -- (d) weight-only (W8A16) linear ----------------------------------------------------------------
#: (M, K, N): Flux's conditioning linears (one token per image; M 2 = a CFG batch) read 3072 x 18432
#: (double-block adaLN), 3072 x 9216 (single-block adaLN) weights; M 4096 = a skipped step's linears
WEIGHT_ONLY_SHAPES = [(1, 3072, 18432), (2, 3072, 9216), (4096, 3072, 3072), (4096, 3072, 12288)]


def bench_weight_only(bench: Bench) -> str:
    from fx_fp8.ops import quant
    from fx_fp8.ops.cuda import CudaLowering, unfused_weight_only_linear

    dev, dt = bench.device, torch.bfloat16
    shapes = [(1, 96, 160), (70, 128, 96)] if bench.dry else WEIGHT_ONLY_SHAPES
    storages = [("fp8", "channel", None), ("int8", "channel", None), ("int8", "block", (1, 32))]
    low = CudaLowering()  # the fused Triton kernel: on the GPU, or in the interpreter in a dry run
    rows = []
    for m, k, n in shapes:
        x, w, bias, exact, label = _linear_case(m, k, n, dev, dt)
        outs = {}
        timed = _timer(bench, outs, f"weight-only {label}")

        t_bf16 = timed("bf16", lambda: F.linear(x, w, bias))
        row = [label, t_bf16]
        fused_times = []
        for method, gran, block in storages:
            wq, ws = quant.quantize_weight(w, gran, block, method)
            tag = f"{method}-{'g' + str(block[1]) if block else 'ch'}"
            bench.on_gpu(f"(d) {label} fused W8A16 {tag} (dry run: Triton interpreter)")
            t_fused = timed(f"fused {tag}", lambda: low.weight_only_linear(
                x, wq, ws, bias, method=method, weight_granularity=gran, weight_block=block))
            t_unfused = timed(f"unfused {tag}", lambda: unfused_weight_only_linear(x, wq, ws, bias, gran, block))
            fused_times.append(t_fused)
            out = outs.get(f"fused {tag}")
            row += [t_fused, t_unfused, ratio(t_unfused, t_fused), rel(out, exact) if out is not None else "-"]
        # weight bytes streamed per ms by the fastest fused storage: what the small-M rows are bound by
        row += [n * k / best(*fused_times) / 1e6 if m <= 16 else "-", ratio(t_bf16, fused_times[0])]
        rows.append(row)
    header = ["M x K -> N", "BF16 F.linear ms"]
    for tag in ("fp8-ch", "int8-ch", "int8-g32"):
        header += [f"fused {tag} ms", f"unfused {tag} ms", f"x fused {tag}", f"err {tag}"]
    header += ["fused weight GB/s (M <= 16)", "x fused fp8-ch vs BF16"]
    notes = ["fused = fx_fp8's Triton W8A16 kernel (fx_fp8.ops.triton_w8a16: weight codes widened in the tile loop); "
             "unfused = dequantize the whole weight to bf16, then F.linear (the fallback); x fused = unfused ms / "
             "fused ms; err = ||out - fp32 math of the bf16 weight|| / ||fp32 math|| (includes the weight "
             "quantization). Tile sizes are untuned (triton_w8a16.tile_config)."]
    return table("(d) weight-only (W8A16) linear + bias, bf16 activations", header, rows, notes)


def _linear_case(m: int, k: int, n: int, dev, dt):
    """(x, w, bias, the fp32 result, label) of one seeded M x K -> N linear."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = (torch.randn(n, k, device=dev) / math.sqrt(k)).to(dt)
    bias = (torch.randn(n, device=dev) / 10).to(dt)
    return x, w, bias, x.float() @ w.float().t() + bias.float(), f"{m}x{k}->{n}"


def _timer(bench: "Bench", outs: dict, prefix: str):
    """timed(name, fn): one benchmark cell `prefix name` that keeps fn's output in outs[name]."""
    def timed(name, fn):
        def run():
            with torch.no_grad():
                outs[name] = fn()
                return bench.ms(fn)
        return bench.cell(f"{prefix} {name}", run)
    return timed


# -- (b) attention --------------------------------------------------------------------------------
def _sdpa(backend_name: str, dry: bool):
    def run(q, k, v):
        if dry:  # CPU: the math backend stands in
            return F.scaled_dot_product_attention(q, k, v)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def bench_attention(bench: Bench) -> str:
    from fx_fp8.config import FP8Config
    from fx_fp8.ops import cudnn_attention, triton_quant
    from fx_fp8.ops.lowering import get_lowering
    from fx_fp8.ops.triton_fp8_attention import fp8_flash_attention

    dev, dt = bench.device, torch.bfloat16
    heads, d = (2, 64) if bench.dry else (24, 128)
    seqs = [200, 300] if bench.dry else [4608, 16384, 32760]
    cfg = FP8Config().attention
    kw = dict(attn_mask=None, softmax_scale=1 / math.sqrt(d), granularity=cfg.granularity, q_block=cfg.q_block,
              kv_block=cfg.kv_block, hadamard=cfg.hadamard, smooth_k=cfg.smooth_k, quantize_p=cfg.quantize_p,
              p_scale=cfg.p_scale, return_lse=False)
    low = get_lowering("cuda")  # Triton kernels: on the GPU, or in the interpreter in a dry run
    cudnn_cfg = FP8Config.load(None, attention={"kernel": "cudnn", "granularity": "tensor"}).attention
    rows, notes = [], []
    for s in seqs:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, s, d, device=dev, dtype=dt) for _ in range(3))
        v = v + 0.5  # zero-mean V under near-flat attention averages to ~0 and inflates relative errors
        flop = 4.0 * heads * s * s * d
        outs = {}
        timed = _timer(bench, outs, f"attention S={s}")

        bench.on_gpu(f"(b) S={s} cuDNN / flash BF16 SDPA (dry run: CPU math SDPA)")
        t_cudnn16 = timed("cudnn_bf16", lambda: _sdpa("CUDNN_ATTENTION", bench.dry)(q, k, v))
        t_flash = timed("flash_bf16", lambda: _sdpa("FLASH_ATTENTION", bench.dry)(q, k, v))
        bench.on_gpu(f"(b) S={s} fx_fp8 Triton FP8 (dry run: Triton interpreter)")
        t_fp8 = timed("triton_fp8", lambda: low.attention(q, k, v, kernel="triton", **kw))

        def kernel_alone():
            pre = triton_quant.prepare_qkv(q, k, v, granularity=kw["granularity"], q_block=kw["q_block"],
                                           kv_block=kw["kv_block"], hadamard=kw["hadamard"], smooth_k=kw["smooth_k"])
            return lambda: fp8_flash_attention(*pre[:6], s_q=s, s_k=s, softmax_scale=kw["softmax_scale"],
                                               q_block=kw["q_block"], kv_block=kw["kv_block"],
                                               quantize_p=kw["quantize_p"], p_scale=kw["p_scale"], out_dtype=dt)
        t_kernel = bench.cell(f"attention S={s} triton kernel alone", lambda: bench.ms(kernel_alone()))
        reason = None if bench.dry else cudnn_attention.attention_reason(q, k, v, cudnn_cfg)
        if bench.dry:
            t_cudnn8 = "GPU only"
            bench.on_gpu(f"(b) S={s} fx_fp8 cuDNN FP8 (needs a GPU and nvidia-cudnn-frontend)")
        elif reason:
            t_cudnn8 = "not available"
            if reason not in notes:
                notes.append(f"fx_fp8 cuDNN FP8: {reason}")
        else:
            ckw = dict(kw, granularity="tensor")
            t_cudnn8 = timed("cudnn_fp8", lambda: low.attention(q, k, v, kernel="cudnn", **ckw))
        ref = outs.get("flash_bf16")
        err = {n: rel(o, ref) if ref is not None else "-" for n, o in outs.items() if n in ("triton_fp8", "cudnn_fp8")}
        t_bf16 = best(t_cudnn16, t_flash)
        tflops = lambda t: flop / t / 1e9 if isinstance(t, float) else "-"  # noqa: E731
        rows.append([s, t_cudnn16, t_flash, t_fp8, t_kernel, t_cudnn8, tflops(t_bf16), tflops(t_fp8),
                     tflops(t_cudnn8), ratio(t_bf16, t_fp8), ratio(t_bf16, t_kernel), ratio(t_bf16, t_cudnn8),
                     err.get("triton_fp8", "-"), err.get("cudnn_fp8", "-")])
    header = ["S", "cuDNN BF16 ms", "flash BF16 ms", "Triton FP8 ms", "Triton kernel alone ms", "cuDNN FP8 ms",
              "BF16 TFLOP/s", "Triton FP8 TFLOP/s", "cuDNN FP8 TFLOP/s", "x Triton FP8", "x kernel alone",
              "x cuDNN FP8", "err Triton FP8", "err cuDNN FP8"]
    notes.insert(0, f"B=1, H={heads}, D={d}, bf16; Q, K ~ N(0, 1), V ~ N(0.5, 1). Triton FP8: {cfg.granularity} "
                    f"scales q{cfg.q_block}/kv{cfg.kv_block}, Hadamard={cfg.hadamard}, smooth K={cfg.smooth_k}, "
                    f"P quantized={cfg.quantize_p}, quantization pre-pass included (kernel alone: without it). "
                    "cuDNN FP8: per-tensor scales + Hadamard + smooth K, FP8 output. x = best BF16 ms / ms; "
                    "err = ||out - flash BF16|| / ||flash BF16||.")
    return table("(b) attention (SDPA, non-causal)", header, rows, notes)


# -- (c) Flux-sized transformer ---------------------------------------------------------------------
def bench_flux(bench: Bench) -> str:
    title = "(c) Flux-sized transformer forward"
    try:
        import diffusers
    except Exception as e:
        return f"### {title}\n\nskipped: diffusers not importable ({type(e).__name__}: {e})\n"
    import copy

    import fx_fp8

    dev, dt = bench.device, torch.bfloat16
    if bench.dry:
        dims = dict(attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=64,
                    in_channels=16, axes_dims_rope=(8, 12, 12))
        img_side, txt = 8, 16
    else:  # Flux-dev dims
        dims = dict(attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                    pooled_projection_dim=768, in_channels=64, axes_dims_rope=(16, 56, 56))
        img_side, txt = 64, 512
    double, single = bench.args.flux_double, bench.args.flux_single
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = diffusers.FluxTransformer2DModel(patch_size=1, num_layers=double, num_single_layers=single,
                                                 guidance_embeds=True, **dims).to(dev, dt).eval()
    img = img_side * img_side
    g = torch.Generator(device=dev).manual_seed(0)
    kwargs = dict(
        hidden_states=torch.randn(1, img, dims["in_channels"], device=dev, dtype=dt, generator=g),
        encoder_hidden_states=torch.randn(1, txt, dims["joint_attention_dim"], device=dev, dtype=dt, generator=g),
        pooled_projections=torch.randn(1, dims["pooled_projection_dim"], device=dev, dtype=dt, generator=g),
        timestep=torch.full((1,), 0.5, device=dev, dtype=dt), guidance=torch.full((1,), 3.5, device=dev, dtype=dt),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(img_side)), torch.arange(float(img_side)),
                                           indexing="ij"), -1).reshape(-1, 3).to(dev),
        txt_ids=torch.zeros(txt, 3, device=dev), return_dict=False)
    fp8_model = copy.deepcopy(model)
    prepared = bench.cell("flux prepare_model", lambda: fx_fp8.prepare_model(fp8_model))
    options = {"lowering": "reference", "downstream": "eager"} if bench.dry else {}
    bench.on_gpu("(c) Flux BF16 / fx_fp8 under Inductor (dry run: eager backend, reference lowering)")
    rows, results = [], {}
    with torch.no_grad():
        eager = model(**kwargs)[0]
        for name, m, backend, opts in (("BF16", model, "eager" if bench.dry else "inductor", None),
                                       ("fx_fp8", fp8_model, "fp8", options)):
            def run(m=m, backend=backend, opts=opts, name=name):
                compiled = torch.compile(m, backend=backend, **({"options": opts} if opts else {}))
                t0 = time.perf_counter()
                results[name] = compiled(**kwargs)[0]
                first = time.perf_counter() - t0
                return bench.ms(lambda: compiled(**kwargs)), first, compiled
            res = bench.cell(f"flux {name}", run)
            results[name + "_timing"] = res
    base, fp8 = results.get("BF16_timing"), results.get("fx_fp8_timing")
    t_base = base[0] if isinstance(base, tuple) else base
    for name, res in (("BF16 torch.compile" + (" (eager backend)" if bench.dry else " (Inductor)"), base),
                      ("fx_fp8 backend 'fp8'", fp8)):
        if isinstance(res, tuple):
            key = "BF16" if name.startswith("BF16") else "fx_fp8"
            rows.append([name, res[0], ratio(t_base, res[0]), res[1], rel(results[key], eager)])
        else:
            rows.append([name, res, "-", "-", "-"])
    extra = ""
    if isinstance(fp8, tuple):
        try:
            report = fx_fp8.get_reports(fp8[2])[-1]
            extra = (f"; lowering {report.lowering}, downstream {report.downstream}, attention FP8 "
                     f"{report.count(op='attention', action='fp8')}/{report.count(op='attention')}")
        except Exception as e:  # the report API is the lead's: say what went wrong, keep the timings
            extra = f"; report unavailable ({type(e).__name__}: {e})"
    linears = (f"{len(prepared['quantized'])} linears quantized, {len(prepared['native'])} native"
               if isinstance(prepared, dict) else f"prepare_model: {prepared}")
    head = (f"{double} double + {single} single blocks (Flux-dev: 19 + 38), hidden "
            f"{dims['num_attention_heads'] * dims['attention_head_dim']}, {img} image + {txt} text tokens, batch 1, "
            f"random weights; {linears}{extra}")
    return table(f"{title}: {head}", ["variant", "ms / forward", "x vs BF16", "first call (compile) s",
                                      "rel err vs eager BF16"], rows)


# -- environment and main ---------------------------------------------------------------------------
def environment(bench: Bench) -> list[str]:
    lines = [f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
             f"torch: {torch.__version__}"]
    for mod in ("triton", "torchao", "diffusers", "cudnn"):
        try:
            m = __import__(mod)
            lines.append(f"{mod if mod != 'cudnn' else 'nvidia-cudnn-frontend'}: {getattr(m, '__version__', '?')}")
        except Exception:
            lines.append(f"{mod if mod != 'cudnn' else 'nvidia-cudnn-frontend'}: not installed")
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        lines.append(f"fx_fp8 git: {rev or '?'}")
    except Exception:
        pass
    if bench.dry:
        lines.append("device: CPU dry run (tiny shapes; timings meaningless)")
    else:
        p = torch.cuda.get_device_properties(0)
        lines += [f"GPU: {p.name} (sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)",
                  f"CUDA: {torch.version.cuda}", f"cuDNN: {torch.backends.cudnn.version()}"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: run every row, list what a GPU fills")
    ap.add_argument("--out", help="append a dated markdown section with the tables to this file")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: linear,attention,flux,weight_only")
    ap.add_argument("--flux-double", type=int, default=2, help="double-stream blocks of the Flux-sized model")
    ap.add_argument("--flux-single", type=int, default=2, help="single-stream blocks of the Flux-sized model")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    sections = {"linear", "attention", "flux", "weight_only"}
    if skip - sections:
        ap.error(f"--skip: unknown sections {sorted(skip - sections)}")
    if args.dry_run:
        # the Triton kernels read TRITON_INTERPRET when they are decorated: before fx_fp8's kernels are imported
        if "fx_fp8.ops.triton_quant" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("cuda_bench.py --dry-run: run it in a fresh process (Triton kernels already loaded)", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("cuda_bench.py needs a CUDA GPU (sm89+ for FP8); use --dry-run to check the script on CPU",
              file=sys.stderr)
        return 2
    import fx_fp8  # noqa: F401  registers torch.ops.fx_fp8 (after TRITON_INTERPRET is settled)

    bench = Bench(args)
    env = environment(bench)
    print("\n".join(f"- {x}" for x in env) + "\n", flush=True)
    parts = []
    t_start = time.perf_counter()
    for name, fn in (("linear", bench_linear), ("attention", bench_attention), ("flux", bench_flux),
                     ("weight_only", bench_weight_only)):
        if name in skip:
            continue
        t0 = time.perf_counter()
        text = bench.cell(f"section {name}", lambda fn=fn: fn(bench))
        text = text if text.startswith("#") else f"### {name}\n\n{text}\n"
        text += f"\n({name}: {time.perf_counter() - t0:.0f} s wall)\n"
        print(text, flush=True)
        parts.append(text)
    total = time.perf_counter() - t_start
    print(f"total: {total:.0f} s")
    if bench.dry:
        print("\nA GPU run fills these cells (the dry run ran a CPU stand-in):")
        for c in dict.fromkeys(bench.gpu_cells):
            print(f"  - {c}")
    if bench.errors:
        print(f"\n{len(bench.errors)} cell(s) failed:", file=sys.stderr)
        for e in bench.errors:
            print(e, file=sys.stderr)
    if args.out:
        command = "python benchmarks/cuda_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        head = f"## cuda_bench.py — {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n"
        body = "".join(f"- {x}\n" for x in env) + f"- command: `{command.strip()}`\n- wall: {total:.0f} s\n\n"
        with open(args.out, "a") as f:
            f.write("\n" + head + body + "\n".join(parts))
        print(f"appended to {args.out}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
