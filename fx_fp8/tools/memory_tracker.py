"""Peak bytes of the tensors torch ops allocate while a block of code runs, on any device.

    with TensorMemoryTracker("cpu") as mem:
        model = Model.from_pretrained(path, quantization_config=...)
    mem.peak, mem.live          # bytes

CUDA has torch.cuda.max_memory_allocated; the CPU has no such counter, so this counts storages
itself: a TorchDispatchMode sees every aten op's outputs, adds each new storage's bytes when it is
created and subtracts them when the storage is freed (a finalizer on the storage object, which
torch keeps alive exactly as long as the storage). Outputs that share an input's storage (views,
in-place ops) add nothing. Storage made without a torch op (safetensors' memory-mapped files,
torch.frombuffer) is not counted: on the CPU a checkpoint is read through such a map, and what is
counted is what loading allocates on top of it.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemoryTracker(TorchDispatchMode):
    """live / peak bytes of storages created by torch ops on `device_type` while active."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set) -> None:
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in inputs:
            return
        with self._lock:
            if ptr in self._tracked:
                return
            self._tracked.add(ptr)
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, ptr, size)

    def _free(self, ptr: int, size: int) -> None:
        with self._lock:
            if ptr in self._tracked:
                self._tracked.discard(ptr)
                self.live -= size
