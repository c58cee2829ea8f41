"""The common writers of weights through the `.data` alias, followed: diffusers' EMAModel.copy_to /
restore (EMA weights swapped in and back) and PEFT's LoRA Linear.merge / unmerge (fuse_lora,
merge_adapter, merge_and_unload, unfuse_lora).

They write a model's weights in place through `.data`, which bumps no version counter the per-call
fingerprint reads (fx_fp8/quant/weight_state.py), and reading every weight's bytes per call costs
too much (docs/lifecycle.md has the numbers). So each of these methods is wrapped to count its
writes in WRITES, one process-wide integer; every compiled graph's per-call step compares it with
the count it last saw (one integer comparison) and, when it moved, checks its own weights' bytes
once (fx_fp8/quant/weight_feeds.py): a compile-time copy is re-quantized, a prepared layer's
written weight raises naming the layer. Any other write through `.data` (`w.data.add_(d)`) stays
unseen until `fx_fp8.refresh_weights(model)`, the next compile or the next compile_pipeline call.

The wrappers are installed by `follow_writers()` (the backend calls it when it compiles a graph,
prepare_model when it prepares): on the classes already imported, and, through an import hook, on
those imported later. They call the original method and count; nothing else changes.
"""

from __future__ import annotations

import functools
import threading

from fx_fp8.after_import import call_after_import

#: module -> (class name, method names) of the writers followed
WRITERS = {
    "diffusers.training_utils": ("EMAModel", ("copy_to", "restore")),
    "peft.tuners.lora.layer": ("Linear", ("merge", "unmerge")),
}
_WRAPPED = "_fx_fp8_counts_writes"


class _Writes:
    """How many followed writes ran in this process (compared per call; never reset)."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def bump(self) -> None:
        with self._lock:
            self.count += 1


WRITES = _Writes()


def note_weights_written() -> None:
    """Tell fx_fp8 that weights were written through `.data` (as the followed writers do): every
    compiled graph checks its weights' bytes on its next call."""
    WRITES.bump()


def _counting(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:  # a writer that failed part-way may have written some weights
            WRITES.bump()

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _wrap(module) -> None:
    cls_name, methods = WRITERS[module.__name__]
    cls = getattr(module, cls_name, None)
    for name in methods:
        method = cls.__dict__.get(name) if isinstance(cls, type) else None
        if callable(method) and not getattr(method, _WRAPPED, False):
            setattr(cls, name, _counting(method))


def follow_writers() -> None:
    """Wrap the writers whose modules are imported, and those imported from now on (idempotent)."""
    call_after_import(WRITERS, _wrap, once=False)
