"""FP8 vs BF16 on one CUDA GPU (written for H100 / H200): linears, attention, a Flux-sized transformer.

    python benchmarks/cuda_bench.py --out benchmarks/RESULTS_cuda.md     # on the GPU machine, < 6 min on an H200
    python benchmarks/cuda_bench.py --dry-run                            # CPU: tiny shapes, reference lowering

Tables: (a) linear at DiT shapes, BF16 F.linear vs fx_fp8 FP8 linear (activation
quantization included; also torch._scaled_mm alone); (b) attention, BF16 SDPA
(flash backend) vs fx_fp8 FP8 attention (quantization included; also the kernel
alone) and cuDNN FP8 SDPA when the `cudnn` frontend is installed; (c) a
Flux-dev-sized FluxTransformer2DModel with random weights and fewer blocks,
torch.compile inductor (BF16) vs backend "fp8" after fx_fp8.prepare_model;
(d) relative errors against BF16. Times: CUDA events, warmup, median.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import fx_fp8
from fx_fp8.ops import quant
from fx_fp8.ops.lowering import get_lowering


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Timer:
    def __init__(self, device: str, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters

    def __call__(self, fn) -> float:
        """Median milliseconds of fn()."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def table(title: str, header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# -- (a) linear --------------------------------------------------------------------
def bench_linear(args, timer, lowering, errors):
    dev, dt = args.device, torch.bfloat16
    m = 64 if args.dry_run else 4608
    shapes = [(128, 128), (128, 512), (512, 128)] if args.dry_run else [(3072, 3072), (3072, 12288), (12288, 3072)]
    low = get_lowering(lowering)
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) / math.sqrt(k)
        b = torch.randn(n, device=dev, dtype=dt) / 10
        wq, ws = quant.quantize_weight(w, "channel")
        kw = dict(weight_granularity="channel", weight_block=None, act_granularity="token", weight_only=False)
        with torch.no_grad():
            ref = F.linear(x, w, b)
            out = low.linear(x, wq, ws, b, None, **kw)
            t_bf16 = timer(lambda: F.linear(x, w, b))
            t_fp8 = timer(lambda: low.linear(x, wq, ws, b, None, **kw))
            xq, xs = quant.quantize_per_row(x)
            if dev == "cuda":
                from fx_fp8.ops.cuda import scaled_mm

                t_mm = timer(lambda: scaled_mm(xq, xs, wq, ws, b, dt))
            else:
                t_mm = float("nan")
        flop = 2.0 * m * k * n
        err = rel(out, ref)
        errors.append(("linear", f"{m}x{k}->{n}", err))
        rows.append([f"{m}x{k}->{n}", t_bf16, flop / t_bf16 / 1e9, t_fp8, flop / t_fp8 / 1e9, t_mm,
                     t_bf16 / t_fp8, err])
    return table("(a) linear, per-token activations x per-channel weights (bias included)",
                 ["shape (tokens x in -> out)", "BF16 ms", "BF16 TFLOP/s", "FP8 ms (quant incl.)", "FP8 TFLOP/s",
                  "_scaled_mm alone ms", "speedup BF16/FP8", "rel err vs BF16"], rows)


# -- (b) attention -----------------------------------------------------------------
def _sdpa_flash(q, k, v):
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def cudnn_fp8_sdpa(q, k, v, softmax_scale):
    """(callable, output) for cuDNN's FP8 SDPA through the cudnn frontend, per-tensor scales,
    or raises with the reason it is not available."""
    import cudnn  # nvidia-cudnn-frontend

    b, h, s, d = q.shape
    qq, sq = quant.quantize_per_tensor(q)
    kq, sk = quant.quantize_per_tensor(k)
    vq, sv = quant.quantize_per_tensor(v)
    o = torch.empty(b, h, s, d, device=q.device, dtype=torch.bfloat16)
    one = torch.ones(1, 1, 1, 1, device=q.device, dtype=torch.float32)
    scalars = {name: t.reshape(1, 1, 1, 1).float().contiguous() for name, t in
               (("dq", sq), ("dk", sk), ("dv", sv), ("ds", one), ("ss", one), ("so", one))}
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    u8 = [t.view(torch.uint8) for t in (qq, kq, vq)]
    tq_, tk_, tv_ = (graph.tensor(dim=list(t.shape), stride=list(t.stride()), data_type=cudnn.data_type.FP8_E4M3)
                     for t in u8)
    ts = {n: graph.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT) for n in scalars}
    to, _, amax_s, amax_o = graph.sdpa_fp8(q=tq_, k=tk_, v=tv_, descale_q=ts["dq"], descale_k=ts["dk"],
                                           descale_v=ts["dv"], descale_s=ts["ds"], scale_s=ts["ss"],
                                           scale_o=ts["so"], is_inference=True, attn_scale=softmax_scale,
                                           use_causal_mask=False)
    to.set_output(True).set_dim([b, h, s, d]).set_stride(list(o.stride())).set_data_type(cudnn.data_type.BFLOAT16)
    amax = {n: torch.empty(1, 1, 1, 1, device=q.device, dtype=torch.float32) for n in ("s", "o")}
    amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
    pack = {tq_: u8[0], tk_: u8[1], tv_: u8[2], to: o, amax_s: amax["s"], amax_o: amax["o"]}
    pack.update({ts[n]: t for n, t in scalars.items()})

    def run():
        graph.execute(pack, workspace)

    run()
    torch.cuda.synchronize()
    return run, o


def bench_attention(args, timer, lowering, errors):
    dev, dt = args.device, torch.bfloat16
    heads, d = (2, 64) if args.dry_run else (24, 128)
    seqs = [256, 384] if args.dry_run else ([4608, 16384] if args.quick else [4608, 16384, 32760])
    cfg = fx_fp8.FP8Config().attention
    kw = dict(attn_mask=None, softmax_scale=1 / math.sqrt(d), granularity=cfg.granularity, q_block=cfg.q_block,
              kv_block=cfg.kv_block, hadamard=cfg.hadamard, smooth_k=cfg.smooth_k, quantize_p=cfg.quantize_p,
              p_scale=cfg.p_scale)
    low = get_lowering(lowering)
    rows, notes = [], []
    for s in seqs:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, s, d, device=dev, dtype=dt) for _ in range(3))
        v = v + 0.5  # zero-mean V under near-flat attention averages to ~0 and inflates relative errors
        flop = 4.0 * heads * s * s * d
        with torch.no_grad():
            ref = _sdpa_flash(q, k, v)
            out = low.attention(q, k, v, **kw)
            t_bf16 = timer(lambda: _sdpa_flash(q, k, v))
            t_fp8 = timer(lambda: low.attention(q, k, v, **kw))
            t_kernel = float("nan")
            if lowering == "cuda":
                from fx_fp8.ops.cuda import prepare_qkv_cuda
                from fx_fp8.ops.triton_fp8_attention import fp8_flash_attention

                prep = prepare_qkv_cuda(q, k, v, granularity=kw["granularity"], q_block=kw["q_block"],
                                        kv_block=kw["kv_block"], hadamard=kw["hadamard"], smooth_k=kw["smooth_k"])
                t_kernel = timer(lambda: fp8_flash_attention(
                    *prep, s_q=s, s_k=s, softmax_scale=kw["softmax_scale"], q_block=kw["q_block"],
                    kv_block=kw["kv_block"], quantize_p=kw["quantize_p"], p_scale=kw["p_scale"], out_dtype=dt))
            t_cudnn, e_cudnn = "not available", "-"
            if dev == "cuda":
                try:
                    run, o_cudnn = cudnn_fp8_sdpa(q, k, v, kw["softmax_scale"])
                    t_cudnn, e_cudnn = timer(run), rel(o_cudnn, ref)
                except Exception as e:  # report why, keep benchmarking
                    msg = f"cuDNN FP8 SDPA not available: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    if msg not in notes:
                        notes.append(msg)
        err = rel(out, ref)
        errors.append(("attention", f"S={s}", err))
        if isinstance(e_cudnn, float):
            errors.append(("attention cuDNN FP8 (per-tensor)", f"S={s}", e_cudnn))
        tf = lambda t: flop / t / 1e9 if isinstance(t, float) and t == t else "-"  # noqa: E731
        rows.append([s, t_bf16, tf(t_bf16), t_fp8, tf(t_fp8), t_kernel, tf(t_kernel), t_bf16 / t_fp8, err,
                     t_cudnn, tf(t_cudnn), e_cudnn])
    text = table(f"(b) attention, B=1, H={heads}, D={d}, {cfg.granularity} scales q{cfg.q_block}/kv{cfg.kv_block}, "
                 f"Hadamard={cfg.hadamard}, smooth K={cfg.smooth_k}; Q, K ~ N(0, 1), V ~ N(0.5, 1)",
                 ["S", "BF16 SDPA flash ms", "TFLOP/s", "FP8 ms (quant incl.)", "TFLOP/s", "FP8 kernel alone ms",
                  "TFLOP/s", "speedup BF16/FP8", "rel err vs BF16", "cuDNN FP8 ms", "TFLOP/s", "cuDNN rel err"], rows)
    return text + "".join(f"\n{n}\n" for n in notes)


# -- (c) Flux-sized transformer ----------------------------------------------------
def bench_flux(args, timer, errors):
    try:
        import diffusers
    except Exception as e:
        return f"### (c) Flux-sized transformer\n\nskipped: diffusers not importable ({type(e).__name__}: {e})\n"
    dev, dt = args.device, torch.bfloat16
    if args.dry_run:
        dims = dict(attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=64,
                    in_channels=16, axes_dims_rope=(8, 12, 12))
        img_side, txt, double, single = 8, 16, 1, 1
    else:  # Flux-dev dims, fewer blocks
        dims = dict(attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                    pooled_projection_dim=768, in_channels=64, axes_dims_rope=(16, 56, 56))
        img_side, txt, double, single = 64, 512, args.flux_double, args.flux_single
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
    prepared = fx_fp8.prepare_model(fp8_model)
    base_backend = "eager" if args.dry_run else "inductor"  # CPU dry run: plumbing only, no C++ compile
    rows = []
    with torch.no_grad():
        eager = model(**kwargs)[0]
        base = torch.compile(model, backend=base_backend)
        fp8 = torch.compile(fp8_model, backend="fp8")
        t0 = time.perf_counter()
        out_base = base(**kwargs)[0]
        compile_base = time.perf_counter() - t0
        t0 = time.perf_counter()
        out_fp8 = fp8(**kwargs)[0]
        compile_fp8 = time.perf_counter() - t0
        t_base = timer(lambda: base(**kwargs))
        t_fp8 = timer(lambda: fp8(**kwargs))
    report = fx_fp8.get_reports()[-1]
    err = rel(out_fp8, out_base)
    errors.append(("flux forward", f"{double}+{single} blocks", err))
    rows.append([f"BF16 torch.compile({base_backend})", t_base, 1.0, compile_base, rel(out_base, eager)])
    rows.append([f"FP8 torch.compile(backend='fp8'), lowering {report.lowering}, downstream {report.downstream}",
                 t_fp8, t_base / t_fp8, compile_fp8, err])
    head = (f"{double} double + {single} single blocks (Flux-dev has 19 + 38), hidden "
            f"{dims['num_attention_heads'] * dims['attention_head_dim']} = {dims['num_attention_heads']} heads x "
            f"{dims['attention_head_dim']}, {img} image + {txt} text tokens, batch 1, random weights; "
            f"{len(prepared['quantized'])} linears FP8, {len(prepared['native'])} native; "
            f"attention FP8 {report.count(op='attention', action='fp8')}/{report.count(op='attention')}")
    return table(f"(c) Flux-sized transformer forward: {head}",
                 ["variant", "ms / forward", "speedup vs BF16", "first call (compile) s", "rel err vs BF16"], rows)


def environment(args) -> str:
    lines = [f"date: {datetime.datetime.now().isoformat(timespec='seconds')}", f"torch: {torch.__version__}"]
    try:
        import triton

        lines.append(f"triton: {triton.__version__}")
    except Exception as e:
        lines.append(f"triton: not importable ({e})")
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        lines += [f"GPU: {p.name} (sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)", f"CUDA: {torch.version.cuda}",
                  f"cuDNN: {torch.backends.cudnn.version()}"]
    else:
        lines.append("device: CPU dry run (reference lowering, tiny shapes: plumbing only, no meaningful timings)")
    return "\n".join(f"- {x}" for x in lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference lowering: checks the script")
    ap.add_argument("--quick", action="store_true", help="GPU: fewer iterations, no S=32760, smaller Flux")
    ap.add_argument("--out", help="also write the tables as markdown to this file")
    ap.add_argument("--flux-double", type=int, default=4, help="double-stream blocks of the Flux-sized model")
    ap.add_argument("--flux-single", type=int, default=8, help="single-stream blocks of the Flux-sized model")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: linear,attention,flux")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, lowering = "cpu", "reference"
        timer = Timer("cpu", warmup=1, iters=2)
    else:
        if not torch.cuda.is_available():
            print("cuda_bench.py needs a CUDA GPU (sm89+ for FP8); use --dry-run to check the script on CPU",
                  file=sys.stderr)
            return 2
        args.device, lowering = "cuda", "cuda"
        reason = get_lowering("cuda").weight_only(torch.empty(16, 16, device="cuda"))
        if reason:
            print(f"cuda_bench.py: {reason}; FP8 benchmarks need sm89+", file=sys.stderr)
            return 2
        if args.quick:
            args.flux_double, args.flux_single = min(args.flux_double, 2), min(args.flux_single, 4)
        timer = Timer("cuda", warmup=3 if args.quick else 5, iters=5 if args.quick else 20)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"linear", "attention", "flux"}
    if unknown:
        ap.error(f"--skip: unknown sections {sorted(unknown)}")
    errors: list = []
    parts = [f"## fx_fp8 CUDA benchmark\n\n{environment(args)}"]
    sections = [("linear", lambda: bench_linear(args, timer, lowering, errors)),
                ("attention", lambda: bench_attention(args, timer, lowering, errors)),
                ("flux", lambda: bench_flux(args, timer, errors))]
    for name, fn in sections:
        if name in skip:
            continue
        t0 = time.perf_counter()
        text = fn()
        text += f"\n({name}: {time.perf_counter() - t0:.0f} s wall)\n"
        print(text, flush=True)
        parts.append(text)
    summary = table("(d) relative errors vs BF16 (||out - bf16|| / ||bf16||)", ["what", "shape", "rel err"],
                    [list(e) for e in errors])
    print(summary)
    parts.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
