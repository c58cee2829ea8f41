"""Runs of a tiny pipeline under a cache (diffusers' hooks or cache-dit), with each block's runs
counted, so that the cache tests compare FP8 with the cache-only native run the same way."""

from __future__ import annotations

import torch

#: denoising steps of every cached run
STEPS = 8


def block_counters(transformer) -> list:
    """A run counter on each block's self-attention query projection (called iff the block computes).
    The counter lives in the hook, not on the module: prepare_model may replace the module (its
    hooks move to the replacement)."""
    model = getattr(transformer, "_orig_mod", transformer)
    counts = []
    for name, m in model.named_modules():
        if name.endswith((".attn.to_q", ".attn1.to_q")):
            count = torch.zeros((), dtype=torch.long)

            def hook(module, args, count=count):
                count.add_(1)  # (a pre-hook's return value would replace the arguments)

            m.register_forward_pre_hook(hook)
            counts.append(count)
    return counts


def run_steps(pipe, kwargs, counts):
    """(latents as float, [block runs]) of one STEPS-step run; `counts` are zeroed first."""
    for c in counts:
        c.zero_()
    out = pipe(**kwargs, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="latent")
    out = out.images if hasattr(out, "images") else out.frames
    return out.float(), [int(c) for c in counts]
