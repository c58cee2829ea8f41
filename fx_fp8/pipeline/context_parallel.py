"""diffusers' context parallelism (Ulysses, ring) on a prepared transformer.

The transformer is prepared (FP8 weights) first, then parallelised, then compiled, so diffusers'
split/gather hooks sit on the final modules; the attention backend is chosen so the FP8 pass can
rewrite each rank's attention (attention_backend.py).
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.pipeline.attention_backend import choose_attention_backend
from fx_fp8.pipeline.launch import check_accelerator, init_distributed
from fx_fp8.pipeline.options import ParallelOptions


def check_parallel_target(model: nn.Module, opts: ParallelOptions) -> None:
    """What diffusers' enable_parallelism would refuse, or do wrong, on this transformer: a
    ValueError naming it, before anything is changed."""
    model = unwrap_compiled(model)
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(
            f"{type(model).__name__} already has parallelism enabled (enable_parallelism was called) "
            "and parallel_config was given: pass one of them"
        )
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if isinstance(heads, int) and heads % opts.ulysses_degree:
        raise ValueError(
            f"ulysses_degree {opts.ulysses_degree} does not divide {type(model).__name__}'s "
            f"{heads} attention heads (Ulysses gives each rank heads / ulysses_degree heads)"
        )


def enable_context_parallel(model: nn.Module, opts, *, warn=None) -> Optional[dict]:
    """Apply diffusers' context parallelism to a transformer (after prepare_model, before
    torch.compile). Returns {"attention_backend", "mesh", "config"}, or None when opts ask for none."""
    opts = ParallelOptions.from_value(opts)
    if not opts.enabled:
        return None
    from diffusers import ContextParallelConfig

    model = unwrap_compiled(model)
    check_parallel_target(model, opts)
    init_distributed(opts)
    check_accelerator()
    backend = choose_attention_backend(model, opts, warn)
    cp = ContextParallelConfig(ulysses_degree=opts.ulysses_degree, ring_degree=opts.ring_degree)
    try:
        model.enable_parallelism(config=cp)
    except (ValueError, RuntimeError) as e:
        raise ValueError(
            f"diffusers' enable_parallelism refused ulysses_degree {opts.ulysses_degree}, ring_degree "
            f"{opts.ring_degree} for {type(model).__name__}: {e}"
        ) from None
    return {"attention_backend": backend, "config": cp, "mesh": cp._flattened_mesh}
