"""CPU-only shims and a bounded two-process launcher for the context-parallel tests.

diffusers' context parallelism (diffusers 0.42.1, torch 2.13 CPU) cannot start on a machine
without an accelerator; the tests run it on CPU tensors over gloo on 127.0.0.1 with exactly
these shims, installed only inside the test worker processes (never by fx_fp8 itself):

1. `torch.accelerator.device_count()` answers 1 instead of 0. `ModelMixin._resolve_parallel_config`
   places each rank on `torch.device(accelerator_type, rank % torch.accelerator.device_count())`,
   a ZeroDivisionError with no accelerator; with 1 every rank gets `cpu:0` (the device index is
   not used for CPU tensors). fx_fp8.pipeline.launch refuses to start context parallelism when the count
   is 0 (a clear RuntimeError instead of the division): on a real machine nothing is shimmed.
2. A CPU kernel for `aten::_scaled_dot_product_flash_attention` (CUDA-only in torch), built on
   `aten::_scaled_dot_product_flash_attention_for_cpu`: same output and log-sum-exp (natural
   log, fp32, (B, H, Sq)), empty placeholders for the CUDA-only outputs (cum_seq_*, max_*,
   rng_state, unused, debug mask). diffusers' ring attention needs the log-sum-exp of each
   partial attention and gets it from this op (its `_native_flash` backend). Under fx_fp8 the
   FP8 pass rewrites every eligible call of it into fx_fp8::fp8_attention_lse, so the kernel
   only runs for attention kept native (native reference runs, skipped layers / steps, the
   short-key cross-attention of Wan).
3. Nothing in diffusers' backend selection needs shimming: `set_attention_backend` /
   fx_fp8.pipeline.attention_backend.choose_attention_backend accept `_native_flash` on CPU (diffusers checks
   dtypes and devices only with DIFFUSERS_ATTN_CHECKS=1, which the workers leave unset: the
   backend's bf16/fp16 constraint would refuse the fp32 tiny models).
   `set_attention_backend` also sets the process-wide active backend: workers build their
   single-process references with an explicit backend instead of relying on it.

The launcher (`launch`) starts N Python processes on 127.0.0.1 with a free port (gloo,
GLOO_SOCKET_IFNAME=lo where a loopback interface of that name exists), bounded by a timeout;
every process is killed and reaped however the test ends. Each process runs one function of a
test module (loaded by path) and writes its JSON-able result to a file the test reads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

_SHIM_LIB = None  # the torch.library registration (kept alive for the process)


def cpu_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on CPU tensors (see the module docstring, shim 2)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=None, scale=scale
    )
    empty = query.new_empty(0, dtype=torch.int32)
    rng = query.new_empty(0, dtype=torch.int64)
    return (out, lse.float(), empty, empty, query.shape[2], key.shape[2], rng, rng, query.new_empty(0))


def install_cpu_shims() -> None:
    """Shims 1 and 2 of the module docstring, for this process (idempotent)."""
    global _SHIM_LIB
    if torch.accelerator.device_count() == 0 and not getattr(torch.accelerator.device_count, "_cp_shim", False):

        def device_count() -> int:
            return 1

        device_count._cp_shim = True
        torch.accelerator.device_count = device_count
    if _SHIM_LIB is None and not torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_scaled_dot_product_flash_attention", "CPU"
    ):
        _SHIM_LIB = torch.library.Library("aten", "IMPL")
        _SHIM_LIB.impl("_scaled_dot_product_flash_attention", cpu_flash_attention, "CPU")


# -- launcher -------------------------------------------------------------------------------------
# Under pytest-xdist each worker (gw0, gw1, ...) takes its ports from its own slice below Linux's
# ephemeral range (32768-60999): a port from bind(0) is released before rank 0 binds it, so two
# workers launching at once could both be handed it and their ranks would join each other's store;
# disjoint slices rule that out, and outgoing connections never take a port below that range.
XDIST_PORT_BASE, XDIST_PORT_SLICE, XDIST_PORT_END = 20000, 500, 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None
    start = None if index is None else XDIST_PORT_BASE + index * XDIST_PORT_SLICE
    if start is not None and start + XDIST_PORT_SLICE <= XDIST_PORT_END:
        first = random.randrange(XDIST_PORT_SLICE)  # not the previous launch's port (TIME_WAIT)
        for k in range(XDIST_PORT_SLICE):
            port = start + (first + k) % XDIST_PORT_SLICE
            if _bindable(port):
                return port
        raise RuntimeError(f"no free port in {start}-{start + XDIST_PORT_SLICE - 1} for xdist worker {worker}")
    # one process (or more workers than slices): any free port, a clash is retried by launch()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_ifname() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return "lo" if "lo" in names else None


def worker_env(rank: int, world_size: int, port: int) -> dict:
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    ifname = _loopback_ifname()
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    env.pop("DIFFUSERS_ATTN_CHECKS", None)
    return env


class LaunchError(AssertionError):
    pass


def launch(module_path, function: str, *, nprocs: int = 2, timeout: float = 240, args=None, tmp_path=None) -> list:
    """Run `function(rank, world_size, **args)` of the module at `module_path` in `nprocs` processes
    joined by gloo on 127.0.0.1; return their results (one per rank). Raises LaunchError with the
    processes' output on failure or timeout. All processes are killed and reaped on every path.
    A port taken between choosing it and binding it is retried once with another."""
    try:
        return _launch(module_path, function, nprocs, timeout, args, tmp_path)
    except LaunchError as e:
        if "EADDRINUSE" not in str(e) and "Address already in use" not in str(e):
            raise
        return _launch(module_path, function, nprocs, timeout, args, tmp_path)


def _launch(module_path, function: str, nprocs: int, timeout: float, args, tmp_path) -> list:
    tmp = Path(tmp_path) if tmp_path is not None else Path(os.environ.get("TMPDIR", "/tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}_{time.monotonic_ns()}"
    outs = [tmp / f"cp_{function}_{stamp}_{r}.json" for r in range(nprocs)]
    logs = [tmp / f"cp_{function}_{stamp}_{r}.log" for r in range(nprocs)]
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nprocs):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "run",
                os.fspath(module_path),
                function,
                json.dumps(args or {}),
                os.fspath(outs[r]),
            ]
            with open(logs[r], "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=worker_env(r, nprocs, port),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=os.getcwd(),
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        codes: list = [None] * nprocs
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break  # one failed: the others would wait for it in a collective
            if time.monotonic() > deadline:
                raise LaunchError(f"{function}: timed out after {timeout:.0f} s\n" + _tails(logs))
            time.sleep(0.1)
        if any(c != 0 for c in codes):
            raise LaunchError(f"{function}: exit codes {codes}\n" + _tails(logs))
        return [json.loads(o.read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
        for p in procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=30)
        for f in outs + logs:
            with contextlib.suppress(OSError):
                f.unlink()


def _tails(logs, n: int = 6000) -> str:
    out = []
    for i, log in enumerate(logs):
        try:
            text = Path(log).read_text(errors="replace")
        except OSError:
            text = "(no output)"
        out.append(f"--- rank {i} ---\n{text[-n:]}")
    return "\n".join(out)


def _run(module_path: str, function: str, args_json: str, out_path: str) -> None:
    import torch.distributed as dist

    install_cpu_shims()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = importlib.util.spec_from_file_location(f"cp_worker_{Path(module_path).stem}", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(module_path).parent))
    spec.loader.exec_module(module)
    try:
        result = getattr(module, function)(rank, world, **json.loads(args_json))
        Path(out_path).write_text(json.dumps(result))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "run":
    import warnings

    warnings.simplefilter("ignore")
    _run(*sys.argv[2:])
