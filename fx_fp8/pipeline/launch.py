"""Processes for context parallelism: joining the torchrun job, and what runs on rank 0 only.

Context parallelism runs one process per rank (ulysses_degree x ring_degree of them), launched by
torchrun; a process started alone gets the torchrun line that relaunches it.
"""

from __future__ import annotations

import contextlib
import os

import torch

from fx_fp8.pipeline.options import ParallelOptions


def torchrun_command(nprocs: int, argv=None) -> str:
    """The torchrun line that relaunches this command (sys.argv) on `nprocs` processes."""
    import shlex
    import sys

    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0] or argv[0] == "-c":
        return f"torchrun --nproc-per-node {nprocs} your_script.py"
    head = argv[0]
    if os.path.basename(head) in ("fx-fp8", "__main__.py"):
        head = "-m fx_fp8"
    return f"torchrun --nproc-per-node {nprocs} {head} " + " ".join(shlex.quote(a) for a in argv[1:])


def init_distributed(opts: ParallelOptions) -> None:
    """Join the torch.distributed job this process was launched in (torchrun sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK), or check the one already initialised: its world size
    must equal ulysses_degree x ring_degree."""
    import torch.distributed as dist

    need = opts.world_size
    if not dist.is_available():
        raise RuntimeError("context parallelism needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != need:
            raise ValueError(
                f"ulysses_degree {opts.ulysses_degree} x ring_degree {opts.ring_degree} needs {need} processes, but "
                f"this process was started as {world} (WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')}): launch "
                f"with `{torchrun_command(need)}`"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        if torch.accelerator.is_available():
            torch.accelerator.set_device_index(local_rank % max(torch.accelerator.device_count(), 1))
        dist.init_process_group()  # the default backends: gloo for CPU tensors, nccl / hccl for devices
        return
    world = dist.get_world_size()
    if world != need:
        raise ValueError(
            f"ulysses_degree {opts.ulysses_degree} x ring_degree {opts.ring_degree} = {need} does not "
            f"match the torch.distributed world size {world}"
        )


def check_accelerator() -> None:
    """diffusers' enable_parallelism places each rank on `rank % torch.accelerator.device_count()`,
    which divides by zero where no accelerator is present (diffusers <= 0.42.1)."""
    if torch.accelerator.device_count() == 0:
        raise RuntimeError(
            "diffusers' context parallelism needs an accelerator (CUDA GPU, Ascend NPU, ...): "
            "enable_parallelism computes rank % torch.accelerator.device_count(), and this machine "
            "has no accelerator (device count 0)"
        )


@contextlib.contextmanager
def rank_zero_first():
    """Rank 0 runs the body first (e.g. writing a file), the others after it."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    if on and dist.get_rank() != 0:
        dist.barrier()
    yield
    if on and dist.get_rank() == 0:
        dist.barrier()


def is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
