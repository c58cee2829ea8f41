"""Cold start with fx_fp8 against plain Inductor: regional or whole-model compiles, cold and warm.

Each measurement runs in a fresh process (so "warm" is a real restart that finds only the
on-disk caches of the matching cold run) on a full-depth, small-width model: Flux with
FLUX.1's 19 double + 38 single blocks, Wan with Wan2.1-14B's 40 blocks. Three backends, side
by side in one run:
  inductor   torch.compile(..., backend="inductor")
  fp8-off    backend="fp8" with both features off, Inductor downstream
  fp8-on     backend="fp8" with its defaults (FP8 attention + FP8 linears), Inductor downstream
and prints, per model and mode, CPU seconds of the compiling call, wall seconds, the number
of Inductor compiles (FX graph cache hits + misses + bypasses), the AOTAutograd cache
outcome and the peak RSS above the built model. The same script runs on a GPU unchanged
(--device cuda).

    python benchmarks/compile_time.py [--models flux wan] [--mode regional full] [--device cpu] [--no-results]
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

    from fx_fp8.tools.families import build_tiny_transformer, example_inputs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        if model == "flux":  # the tiny family's width, FLUX.1's depth
            m = FluxTransformer2DModel(patch_size=1, in_channels=32, num_layers=19, num_single_layers=38,
                                       attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                                       pooled_projection_dim=64, axes_dims_rope=(8, 12, 12))
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
    compiled = _compile(m, backend, mode)
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    with torch.no_grad():
        compiled(**kw)
    if device == "cuda":
        torch.cuda.synchronize()
    cpu, wall = _cpu_seconds() - cpu0, time.perf_counter() - wall0
    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "cpu_s": cpu, "wall_s": wall,
        "inductor_compiles": ind["fxgraph_cache_miss"] + ind["fxgraph_cache_hit"] + ind["fxgraph_cache_bypass"],
        "fx_hit": ind["fxgraph_cache_hit"], "fx_bypass": ind["fxgraph_cache_bypass"],
        "aot_hit": aot["autograd_cache_hit"], "aot_miss": aot["autograd_cache_miss"],
        "aot_bypass": aot["autograd_cache_bypass"], "dynamo_graphs": counters["stats"]["unique_graphs"],
        "peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
    }


def _run_worker(model, backend, mode, device, cache_dir) -> dict:
    # compile in-process (no worker pool) so the CPU seconds include Inductor's own work
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model, backend, mode, device]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["flux", "wan"], choices=["flux", "wan"])
    ap.add_argument("--mode", nargs="+", default=["regional"], choices=["regional", "full"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-results", action="store_true", help="print only; do not append to benchmarks/RESULTS.md")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "BACKEND", "MODE", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return

    from tabulate import tabulate

    rows = []
    for model in args.models:
        for mode in args.mode:
            base = {}
            for backend in BACKENDS:
                with tempfile.TemporaryDirectory(prefix="fx_fp8_cache_") as cache:
                    for start in ("cold", "warm"):
                        print(f"... {model} {mode} {backend} {start}", file=sys.stderr, flush=True)
                        r = _run_worker(model, backend, mode, args.device, cache)
                        base.setdefault(start, r) if backend == "inductor" else None
                        ref = base[start]
                        rows.append([model, mode, backend, start, f"{r['cpu_s']:.1f}",
                                     f"{r['cpu_s'] / ref['cpu_s']:.2f}x", f"{r['wall_s']:.1f}", r["inductor_compiles"],
                                     f"{r['fx_hit']}/{r['fx_bypass']}",
                                     f"{r['aot_hit']}/{r['aot_miss']}/{r['aot_bypass']}", r["dynamo_graphs"],
                                     f"{r['peak_rss_mb']:.0f}"])
    headers = ["model", "mode", "backend", "start", "CPU s", "vs inductor", "wall s", "Inductor compiles",
               "FX cache hit/bypass", "AOT cache hit/miss/bypass", "Dynamo graphs", "peak RSS MB"]
    table = tabulate(rows, headers=headers, tablefmt="github")
    print(table)
    if not args.no_results:
        import torch

        with open(RESULTS, "a") as f:
            f.write(f"\n## Compile time: regional and whole-model, cold and warm ({datetime.date.today()})\n\n"
                    f"`python benchmarks/compile_time.py --models {' '.join(args.models)} --mode {' '.join(args.mode)}`"
                    f" on {platform.machine()} ({os.cpu_count()} CPUs), device {args.device}, torch "
                    f"{torch.__version__}. One process per row; warm = a new process with the cold row's "
                    "Inductor cache directory. CPU s = the compiling first call.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
