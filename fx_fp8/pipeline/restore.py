"""restore_pipeline: undo compile_pipeline (the original transformers, scheduler.step and __call__)."""

from __future__ import annotations

import torch.nn as nn

from fx_fp8.passes.attention_remedies import LINEARS_ONLY_ATTR
from fx_fp8.pipeline.apply_options import undo_pipeline_options
from fx_fp8.pipeline.offload import reapply_group_offload
from fx_fp8.pipeline.state import STATE_ATTR, pipeline_state
from fx_fp8.pipeline.step_publishing import remove_scheduler_hook
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.weight_state import release_quantized_copies

#: restore_pipeline(pipe, linears=...): what the prepared linears become
RESTORE_LINEARS = ("original", "quantized")


def restore_pipeline(pipe, *, linears: str = "original"):
    """Undo compile_pipeline: the original transformer objects, scheduler.step and __call__.

    linears: what the linears that compile_pipeline prepared become.
      "original" (the default): the original nn.Linear modules, in the transformer's current
        dtype and device (a pipe.to(...) after compile_pipeline is followed). They exist when
        compile_pipeline ran with keep_weights=True or prepare=False, or before the first call
        (nothing was prepared yet). After prepare=True without keep_weights=True their weights
        were freed: a ValueError says so and changes nothing; pass linears="quantized" then.
      "quantized": the QuantizedLinear modules stay (they run eagerly, in FP8); kept originals
        are dropped.
    The quantized copies the backend made for the transformers' weights (prepare=False) are
    released: a restored pipeline holds only its own weights. Group offloading enabled on a
    transformer is re-applied over the linears put back.
    """
    if linears not in RESTORE_LINEARS:
        raise ValueError(f"invalid linears {linears!r}: expected one of {', '.join(map(repr, RESTORE_LINEARS))}")
    state = pipeline_state(pipe)
    if state.running:
        raise RuntimeError("restore_pipeline called while the pipeline is running")
    put_back = {}  # attr -> [(name, kept nn.Linear, QuantizedLinear in the model)]
    for attr, original in state.originals.items():
        quantized = (state.prepared.get(attr) or {}).get("quantized", [])
        kept = state.kept_linears.get(attr)
        if linears == "original" and quantized and kept is None:
            raise ValueError(
                f"restore_pipeline(pipe): the original weights of the {len(quantized)} linears compile_pipeline "
                f"prepared in pipe.{attr} (first: {quantized[:3]}) were freed (prepare=True without "
                "keep_weights=True), so they cannot be put back. Pass restore_pipeline(pipe, linears='quantized') "
                "to keep them as QuantizedLinear modules (FP8, run eagerly), or compile with keep_weights=True "
                "(or prepare=False) to get the original weights back"
            )
        if linears == "original" and kept:
            put_back[attr] = []
            for name, linear in kept.items():
                current = original.get_submodule(name)
                if not isinstance(current, QuantizedLinear):
                    raise ValueError(
                        f"pipe.{attr}.{name} is a {type(current).__name__}, not the QuantizedLinear "
                        "compile_pipeline put there: it was replaced since, so restore_pipeline will "
                        "not put the original linear over it"
                    )
                put_back[attr].append((name, linear, current))
    # everything is checked: only now change the pipeline
    for handle in state.hook_handles:
        handle.remove()
    for attr, original in state.originals.items():
        undo_pipeline_options(original, state.extras.get(attr))
    for attr, original in state.originals.items():
        for name, linear, current in put_back.get(attr, []):
            # the transformer may have moved since (pipe.to(dtype / device)): the original follows it
            linear = linear.to(device=current.weight.device, dtype=current.orig_dtype)
            parent, _, child = name.rpartition(".")
            setattr(original.get_submodule(parent) if parent else original, child, linear)
        if put_back.get(attr):
            reapply_group_offload(original)
        release_quantized_copies(original)
        original.__dict__.pop(LINEARS_ONLY_ATTR, None)  # set on a component compiled for its linears only
        _uncompile_blocks(original)  # regional=True compiled its blocks in place
        setattr(pipe, attr, original)
    remove_scheduler_hook(state)
    pipe.__class__ = state.base_class
    object.__delattr__(pipe, STATE_ATTR)
    state.kept_linears.clear()
    return pipe


def _uncompile_blocks(module: nn.Module) -> None:
    """Undo nn.Module.compile on every submodule (regional compilation)."""
    for m in module.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
