"""Memory measured by torch, not by fx_fp8: the CPU allocator's peak (AllocatorPeak) and the bytes of
the storages behind a model's state (state_storage_bytes), oracles independent of fx_fp8's tracker.

On CUDA a test reads torch.cuda.max_memory_allocated. The CPU allocator keeps no such counter, but
it reports every allocation and free to torch's profiler when `profile_memory=True` (the "[memory]"
events, with their byte counts and times): the running sum of those, in time order, is the live
bytes the block allocated, and its maximum the peak.

A memory-mapped file (safetensors opens a checkpoint with torch.UntypedStorage.from_file) is
reported too, as one allocation of the file's size, though it is the page cache's, not the
process's heap: `mapped` names such files, and one allocation and one free of each one's exact size
are left out (`mem.mapped` says how many were).

    with AllocatorPeak(mapped=checkpoint_files) as mem:
        model = load(...)
    mem.peak, mem.net   # bytes
"""

from __future__ import annotations

import collections
import os

from torch.profiler import ProfilerActivity, profile


class AllocatorPeak:
    def __init__(self, mapped=()):
        self.peak = self.net = 0
        self.events = self.mapped = 0
        self._mapped_sizes = collections.Counter(os.path.getsize(f) for f in mapped)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> "AllocatorPeak":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        memory = sorted(
            (e.start_ns(), e.nbytes())
            for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type().name == "CPU"
        )
        live = 0
        maps, unmaps = collections.Counter(self._mapped_sizes), collections.Counter()
        for _, nbytes in memory:
            if maps[nbytes] > 0:  # a mapped file's allocation (its bytes are the file's, in the page cache)
                maps[nbytes] -= 1
                unmaps[nbytes] += 1
                self.mapped += 1
                continue
            if nbytes < 0 and unmaps[-nbytes] > 0:  # and its unmapping
                unmaps[-nbytes] -= 1
                continue
            live += nbytes
            self.peak = max(self.peak, live)
        self.net, self.events = live, len(memory)


def state_storage_bytes(model) -> int:
    """Bytes of the distinct storages behind a model's parameters, buffers and state_dict (quantized
    layers' codes and scales included), each storage counted once."""
    import torch

    storages = {}
    for t in list(model.state_dict(keep_vars=True).values()) + list(model.parameters()) + list(model.buffers()):
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
