#!/usr/bin/env python
"""FP8 vs native transformer latency under context parallelism (degree 1, Ulysses 2, ring 2).

    python benchmarks/parallel_bench.py                  # degree 1 here, degree 2 in two processes it starts
    python benchmarks/parallel_bench.py --size medium --iters 20 --out benchmarks/RESULTS.md
    torchrun --nproc-per-node 2 benchmarks/parallel_bench.py --modes ulysses,ring   # under your own launcher

One Flux transformer (random weights; `--size tiny`: the test model, `medium`: 8 heads x 128,
2 double + 4 single blocks, 4096 image + 512 text tokens) is timed per forward (median of
`--iters` after warm-up), natively and with `torch.compile(backend="fp8")`, in one process and
with diffusers' context parallelism over 2 processes (Ulysses, ring). With accelerators each
process takes its own device (cuda:LOCAL_RANK / npu:LOCAL_RANK) and the native model runs under
Inductor; degree 2 needs 2 devices.

On a machine without accelerators it runs anyway, as a CORRECTNESS / OVERHEAD check and says so:
the FP8 ops run the CPU reference lowering (slower than native by design), the ranks share the
CPU cores, and diffusers' context parallelism is started with the CPU shims of
tests/helpers/cp_helpers.py (device count, a CPU kernel for aten._scaled_dot_product_flash_attention).
The table's error column (FP8 vs native output of the same model and degree) is meaningful on
every device; its latency columns only on accelerators.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
MODES = {"single": (1, 1), "ulysses": (2, 1), "ring": (1, 2)}


_ACCEL: list = []


def _accelerator() -> str | None:
    """The accelerator type, or None; decided once, before any CPU shim changes the device count."""
    if not _ACCEL:
        _ACCEL.append(torch._C._get_accelerator().type if torch.accelerator.device_count() > 0 else None)
    return _ACCEL[0]


def _install_cpu_shims() -> None:
    """Only where no accelerator is present: the test shims (see tests/helpers/cp_helpers.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    import cp_helpers

    cp_helpers.install_cpu_shims()


def build(size: str, dtype):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    if size == "tiny":
        from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

        model = build_tiny_transformer("flux", layers=2, seed=0).to(dtype)
        return model, dict(example_inputs("flux", model, dtype=dtype), return_dict=False)
    heads, head_dim, side, txt = 8, 128, 64, 512
    model = (
        FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=1024,
            pooled_projection_dim=768,
            axes_dims_rope=(16, 56, 56),
        )
        .to(dtype)
        .eval()
    )
    g = torch.Generator().manual_seed(0)
    img = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij"), -1
    ).reshape(-1, 3)
    kwargs = dict(
        hidden_states=torch.randn(1, side * side, 64, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, txt, 1024, generator=g).to(dtype),
        pooled_projections=torch.randn(1, 768, generator=g).to(dtype),
        timestep=torch.full((1,), 0.5, dtype=dtype),
        img_ids=img,
        txt_ids=torch.zeros(txt, 3),
        return_dict=False,
    )
    return model, kwargs


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("npu"):
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _time(fn, device: str, warmup: int, iters: int) -> tuple[float, torch.Tensor]:
    import torch.distributed as dist

    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    ms = 1000 * times[len(times) // 2]
    if dist.is_initialized():  # the slowest rank sets the pace
        t = torch.tensor([ms], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t)
    return ms, out


def measure(mode: str, args) -> dict:
    """One row: this process's share of `mode` (all ranks call it)."""
    import fx_fp8
    from fx_fp8.pipeline.context_parallel import enable_context_parallel
    from fx_fp8.pipeline.options import ParallelOptions

    warnings.simplefilter("ignore")
    accel = _accelerator()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"{accel}:{rank}" if accel else "cpu"
    dtype = torch.bfloat16 if accel else torch.float32
    model, kwargs = build(args.size, dtype)
    model = model.to(device)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ulysses, ring = MODES[mode]
    backend = None
    if ulysses * ring > 1:
        info = enable_context_parallel(model, ParallelOptions(ulysses_degree=ulysses, ring_degree=ring))
        backend = info["attention_backend"]
    native_model = (
        torch.compile(model) if (accel == "cuda" and args.native == "auto") or args.native == "inductor" else model
    )
    row = {
        "mode": mode,
        "degree": ulysses * ring,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "attention_backend": backend or "native",
    }
    with torch.no_grad():
        row["native_ms"], native = _time(lambda: native_model(**kwargs)[0], device, args.warmup, args.iters)
        torch._dynamo.reset()
        fp8 = torch.compile(model, backend="fp8")
        t0 = time.perf_counter()
        fp8(**kwargs)
        row["fp8_first_call_s"] = time.perf_counter() - t0
        row["fp8_ms"], out = _time(lambda: fp8(**kwargs)[0], device, args.warmup, args.iters)
    reports = fx_fp8.get_reports(fp8)
    row["attention_fp8"] = sum(r.count("attention", "fp8") for r in reports)
    row["attention_total"] = sum(r.count("attention") for r in reports)
    row["linear_fp8"] = sum(r.count("linear", "quantized") for r in reports)
    row["lowering"] = reports[0].lowering if reports else "?"
    row["rel_error"] = float((out.float() - native.float()).norm() / native.float().norm())
    return row


# -- launching ---------------------------------------------------------------------------------------
def _launch_two(modes: list[str], args, timeout: float) -> list[dict]:
    """This script on 2 processes (127.0.0.1, a free port), as torchrun would; rank 0's rows."""
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    import cp_helpers

    port = cp_helpers.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rows{r}.json" for r in range(2)]
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--modes",
            ",".join(modes),
            "--size",
            args.size,
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
            "--native",
            args.native,
            "--no-append",
        ]
        procs = [
            subprocess.Popen(
                cmd + ["--rows-json", str(outs[r])],
                env=cp_helpers.worker_env(r, 2, port),
                stdout=subprocess.DEVNULL if r else None,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for r in range(2)
        ]
        try:
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(f"degree-2 run failed or timed out (exit codes {[p.poll() for p in procs]})")
                time.sleep(0.2)
            if any(p.returncode != 0 for p in procs):
                raise RuntimeError(f"degree-2 run failed (exit codes {[p.returncode for p in procs]})")
            return json.loads(outs[0].read_text())
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                p.wait()


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = [
        (
            r["mode"],
            r["degree"],
            r["device"],
            r["dtype"],
            r["attention_backend"],
            f"{r['native_ms']:.2f}",
            f"{r['fp8_ms']:.2f}",
            f"{r['native_ms'] / r['fp8_ms']:.2f}x",
            f"{r['rel_error']:.2e}",
            f"{r['attention_fp8']}/{r['attention_total']}",
            r["linear_fp8"],
            f"{r['fp8_first_call_s']:.1f}",
        )
        for r in rows
    ]
    return tabulate(
        body,
        headers=[
            "mode",
            "degree",
            "device",
            "dtype",
            "attention backend",
            "native ms",
            "FP8 ms",
            "speed-up",
            "rel. error",
            "FP8 attention",
            "FP8 linears",
            "FP8 first call s",
        ],
        tablefmt="github",
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="single,ulysses,ring", help="comma-separated: single, ulysses, ring")
    p.add_argument(
        "--size", choices=("tiny", "medium"), default=None, help="default: medium on accelerators, tiny on CPU"
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--native",
        choices=("auto", "eager", "inductor"),
        default="auto",
        help="how the native model runs (auto: Inductor on CUDA, eager elsewhere)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed for the degree-2 processes")
    p.add_argument("--out", default=str(RESULTS), help="results file to append a dated section to")
    p.add_argument("--no-append", action="store_true")
    p.add_argument("--rows-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    accel = _accelerator()
    args.size = args.size or ("medium" if accel else "tiny")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}: expected {', '.join(MODES)}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, int(os.environ.get("WORLD_SIZE", "1")))))
    if accel is None:
        _install_cpu_shims()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # a rank of a degree-2 run (started by us or by torchrun)
        rows = [measure(m, args) for m in modes if MODES[m][0] * MODES[m][1] == world]
        if int(os.environ.get("RANK", "0")) == 0:
            if args.rows_json:
                Path(args.rows_json).write_text(json.dumps(rows))
            else:
                print(table(rows))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    rows = [measure(m, args) for m in modes if m == "single"]
    multi = [m for m in modes if m != "single"]
    notes = []
    if multi:
        if accel is not None and torch.accelerator.device_count() < 2:
            notes.append(f"degree 2 skipped: {torch.accelerator.device_count()} {accel} device(s)")
        else:
            rows += _launch_two(multi, args, args.timeout)
    if accel is None:
        notes.insert(
            0,
            "NO ACCELERATOR: a correctness / overhead check, not a speed measurement. FP8 runs the CPU "
            "reference lowering (slower than native by design); both ranks share the CPU cores; diffusers' "
            "context parallelism is started with the test shims of tests/helpers/cp_helpers.py (device count 1, "
            "CPU kernel for aten._scaled_dot_product_flash_attention).",
        )
    text = table(rows)
    print(text)
    for n in notes:
        print(f"note: {n}")
    if not args.no_append:
        import diffusers

        stamp = datetime.date.today().isoformat()
        machine = f"{platform.machine()} ({os.cpu_count()} CPUs), {platform.system()}"
        if accel:
            machine += f"; {torch.accelerator.device_count()} x {accel}"
        section = (
            f"\n## {stamp} parallel_bench.py\n\n"
            f"Machine: {machine}; torch {torch.__version__}, diffusers {diffusers.__version__}, python "
            f"{platform.python_version()}.\nCommand: `python benchmarks/parallel_bench.py "
            f"{' '.join(sys.argv[1:])}`; model size {args.size}, median of {args.iters} forwards after "
            f"{args.warmup} warm-up.\n\n" + text + "\n\n" + "".join(f"- {n}\n" for n in notes)
        )
        with open(args.out, "a") as f:
            f.write(section)
        print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
