"""Cold start with fx_fp8 against plain Inductor: regional or whole-model compiles, cold and warm.

Each measurement runs in a fresh process (so "warm" is a real restart that finds only the
on-disk caches of the matching cold run) on a full-depth, small-width model: Flux with
FLUX.1's 19 double + 38 single blocks, Wan with Wan2.1-14B's 40 blocks. Three backends, side
by side in one run:
  inductor   torch.compile(..., backend="inductor")
  fp8-off    backend="fp8" with both features off, Inductor downstream
  fp8-on     backend="fp8" with its defaults (FP8 attention + FP8 linears), Inductor downstream
and prints, per model and mode, CPU seconds from the torch.compile call through the compiling
first call (plain Inductor imports its compiler in torch.compile, fx_fp8 in the first call), of
the first call alone and of a second call (running, not compiling), wall seconds, the number
of Inductor compiles (FX graph cache hits + misses + bypasses), the AOTAutograd cache
outcome and the peak RSS above the built model. The same script runs on a GPU unchanged
(--device cuda).

    python benchmarks/compile_time.py [--models flux wan] [--mode regional full] [--device cpu] [--no-results]
    # warm rows only, three interleaved runs each, on caches an earlier cold run left in DIR:
    python benchmarks/compile_time.py --cache-dir DIR --starts cold ...   # once
    python benchmarks/compile_time.py --cache-dir DIR --starts warm --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings

BACKENDS = ("inductor", "fp8-off", "fp8-on")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _build(model: str, device: str):
    import torch
    from diffusers import FluxTransformer2DModel

    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        if model == "flux":  # the tiny family's width, FLUX.1's depth
            m = FluxTransformer2DModel(
                patch_size=1,
                in_channels=32,
                num_layers=19,
                num_single_layers=38,
                attention_head_dim=32,
                num_attention_heads=2,
                joint_attention_dim=64,
                pooled_projection_dim=64,
                axes_dims_rope=(8, 12, 12),
            )
        else:
            m = build_tiny_transformer("wan", layers=40)
    m = m.eval().to(device)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example_inputs(model, m).items()}
    return m, kw


def _compile(m, backend: str, mode: str):
    import torch

    if backend == "inductor":
        kwargs = {"backend": "inductor"}
    else:
        options = {"downstream": "inductor"}
        if backend == "fp8-off":
            options.update(quantization=None, diffusion_kv_cache_dtype=None)
        kwargs = {"backend": "fp8", "options": options}
    if mode == "regional":
        m.compile_repeated_blocks(**kwargs)
        return m
    return torch.compile(m, **kwargs)


def _cpu_seconds() -> float:
    """This process's CPU time plus its finished children's (Inductor runs the C++ compiler)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def worker(model: str, backend: str, mode: str, device: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    import fx_fp8  # noqa: F401  registers the backends

    m, kw = _build(model, device)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # timed from the torch.compile call: plain Inductor imports its compiler there (about 190
    # modules), fx_fp8 on its first call; a process pays that import either way
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    compiled = _compile(m, backend, mode)
    cpu_call0 = _cpu_seconds()
    with torch.no_grad():
        compiled(**kw)
    if device == "cuda":
        torch.cuda.synchronize()
    cpu, wall, call = _cpu_seconds() - cpu0, time.perf_counter() - wall0, _cpu_seconds() - cpu_call0
    # the first call also runs the model once: a second call says how much of it is running (FP8 on
    # CPU runs the reference kernels, slower than Inductor's fused code; on a GPU the FP8 kernels)
    steady0 = _cpu_seconds()
    with torch.no_grad():
        compiled(**kw)
    if device == "cuda":
        torch.cuda.synchronize()
    steady = _cpu_seconds() - steady0
    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "call_cpu_s": call,
        "steady_cpu_s": steady,
        "inductor_compiles": ind["fxgraph_cache_miss"] + ind["fxgraph_cache_hit"] + ind["fxgraph_cache_bypass"],
        "fx_hit": ind["fxgraph_cache_hit"],
        "fx_bypass": ind["fxgraph_cache_bypass"],
        "aot_hit": aot["autograd_cache_hit"],
        "aot_miss": aot["autograd_cache_miss"],
        "aot_bypass": aot["autograd_cache_bypass"],
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
    }


def _run_worker(model, backend, mode, device, cache_dir) -> dict:
    r = _run_worker_once(model, backend, mode, device, cache_dir)
    print(
        f"    CPU {r['cpu_s']:.2f} s, first call {r['call_cpu_s']:.2f} s, second call {r['steady_cpu_s']:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    return r


def _run_worker_once(model, backend, mode, device, cache_dir) -> dict:
    # compile in-process (no worker pool) so the CPU seconds include Inductor's own work
    env = dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONWARNINGS="ignore"
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model, backend, mode, device]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(model, mode, backend, start, r, ref, runs) -> list:
    ratio = f"{r['cpu_s'] / ref['cpu_s']:.2f}x" if ref else "n/a"
    call_ratio = f"{r['call_cpu_s'] / ref['call_cpu_s']:.2f}x" if ref else "n/a"
    return [
        model,
        mode,
        backend,
        start,
        f"{r['cpu_s']:.1f}",
        ratio,
        f"{r['call_cpu_s']:.1f}",
        call_ratio,
        f"{r['steady_cpu_s']:.2f}",
        f"{r['wall_s']:.1f}",
        r["inductor_compiles"],
        f"{r['fx_hit']}/{r['fx_bypass']}",
        f"{r['aot_hit']}/{r['aot_miss']}/{r['aot_bypass']}",
        r["dynamo_graphs"],
        f"{r['peak_rss_mb']:.0f}",
        runs,
    ]


def _median_run(results: list) -> dict:
    """The run with the median CPU seconds (other processes only ever add time)."""
    return sorted(results, key=lambda r: r["cpu_s"])[(len(results) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["flux", "wan"], choices=["flux", "wan"])
    ap.add_argument("--mode", nargs="+", default=["regional"], choices=["regional", "full"])
    ap.add_argument(
        "--backends",
        nargs="+",
        default=list(BACKENDS),
        choices=BACKENDS,
        help="ratios are against the inductor row, so keep it in",
    )
    ap.add_argument(
        "--starts",
        nargs="+",
        default=["cold", "warm"],
        choices=["cold", "warm"],
        help="warm alone needs --cache-dir holding an earlier cold run's caches",
    )
    ap.add_argument(
        "--cache-dir",
        help="keep the compile caches in DIR/<model>-<mode>-<backend> (default: a "
        "temporary directory per model, mode and backend, removed at the end)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="warm runs per row, backends interleaved; the row shows "
        "the run with the median CPU seconds (a cold run is cold once)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to benchmarks/RESULTS.md")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "BACKEND", "MODE", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if "cold" not in args.starts and not args.cache_dir:
        ap.error("--starts warm without cold needs --cache-dir (a directory an earlier cold run filled)")

    from tabulate import tabulate

    rows = []
    with tempfile.TemporaryDirectory(prefix="fx_fp8_cache_") as tmp:
        root = args.cache_dir or tmp
        for model in args.models:
            for mode in args.mode:
                caches = {b: os.path.join(root, f"{model}-{mode}-{b}") for b in args.backends}
                results: dict = {}
                if "cold" in args.starts:
                    for backend in args.backends:
                        if os.path.isdir(caches[backend]) and os.listdir(caches[backend]):
                            sys.exit(f"{caches[backend]} is not empty: a cold run needs an empty cache directory")
                        print(f"... {model} {mode} {backend} cold", file=sys.stderr, flush=True)
                        results[backend, "cold"] = [_run_worker(model, backend, mode, args.device, caches[backend])]
                if "warm" in args.starts:
                    for backend in args.backends:
                        if not (os.path.isdir(caches[backend]) and os.listdir(caches[backend])):
                            sys.exit(f"{caches[backend]} is empty: run the cold start first")
                    for i in range(args.repeat):  # interleaved: every backend sees the same machine load
                        for backend in args.backends:
                            print(
                                f"... {model} {mode} {backend} warm ({i + 1}/{args.repeat})",
                                file=sys.stderr,
                                flush=True,
                            )
                            results.setdefault((backend, "warm"), []).append(
                                _run_worker(model, backend, mode, args.device, caches[backend])
                            )
                for backend in args.backends:
                    for start in args.starts:
                        runs = results[backend, start]
                        ref = results.get(("inductor", start))
                        rows.append(
                            _row(
                                model,
                                mode,
                                backend,
                                start,
                                _median_run(runs),
                                _median_run(ref) if ref else None,
                                len(runs),
                            )
                        )
    headers = [
        "model",
        "mode",
        "backend",
        "start",
        "CPU s",
        "vs inductor",
        "first call CPU s",
        "vs inductor",
        "second call CPU s",
        "wall s",
        "Inductor compiles",
        "FX cache hit/bypass",
        "AOT cache hit/miss/bypass",
        "Dynamo graphs",
        "peak RSS MB",
        "runs",
    ]
    table = tabulate(rows, headers=headers, tablefmt="github")
    print(table)
    if not args.no_results:
        import torch

        with open(RESULTS, "a") as f:
            f.write(
                f"\n## Compile time: regional and whole-model, cold and warm ({datetime.date.today()})\n\n"
                f"`python benchmarks/compile_time.py --models {' '.join(args.models)} --mode {' '.join(args.mode)}`"
                f" on {platform.machine()} ({os.cpu_count()} CPUs), device {args.device}, torch "
                f"{torch.__version__}. One process per run; warm = a new process with the cold run's "
                "Inductor cache directory; with several runs the row is the median. CPU s = torch.compile "
                "(or compile_repeated_blocks) and the compiling first call; first call CPU s = the call "
                "alone; second call CPU s = a call that compiles nothing.\n\n" + table + "\n"
            )


if __name__ == "__main__":
    main()
