"""Forward kwargs: the size tables of the 4 variants, random-tensor helpers, the input makers several
entries share, and the one input maker of each family (driven by a transformer config, so that
model_source can use it for checkpoints loaded from folders too)."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

VARIANTS = 4  # size variants 0..3 per entry

# Size tables: index = variant. Attention sees more tokens at each step.
SIDE_P2 = (8, 12, 16, 20)  # latent side for patch-2 image models: 16, 36, 64, 100 image tokens
SIDE_P1 = (4, 6, 8, 10)  # token-grid side for packed / patch-1 image models: 16, 36, 64, 100 tokens
TXT = (6, 8, 10, 12)  # text tokens
VID_P2 = ((1, 8), (2, 8), (2, 12), (3, 12))  # (latent frames, side) for (1, 2, 2) patches: 16, 32, 72, 108 tokens
VID_P1 = ((1, 4), (2, 4), (2, 6), (3, 6))  # (latent frames, side) for patch 1: 16, 32, 72, 108 tokens
AUDIO = (8, 16, 24, 32)  # audio latent frames


def pick(seq: Sequence, variant: int):
    if not isinstance(variant, int) or not 0 <= variant < VARIANTS:
        raise ValueError(f"variant must be an int in 0..{VARIANTS - 1}, got {variant!r}")
    return seq[variant]


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def rand_t(gen: torch.Generator, high: int = 1000) -> torch.Tensor:
    """A random integer timestep in [0, high), as a float tensor of shape (1,)."""
    return torch.randint(0, high, (1,), generator=gen).float()


def grid_ids(h: int, w: int) -> torch.Tensor:
    """Flux-style (h*w, 3) position ids: (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def image_sizes(text: Sequence[int] = TXT) -> tuple[dict, ...]:
    """The zoo's variants of an image family: square token grids of SIDE_P1, text of TXT."""
    return tuple(dict(side=s, txt=n) for s, n in zip(SIDE_P1, text))


def family_variants(maker: Callable[..., dict], sizes: Sequence[Mapping]) -> Callable:
    """A zoo input maker (model, gen, variant) from a family's config-driven maker and its sizes."""

    def make(model, gen, v):
        return maker(model.config, 1, gen, torch.float32, **pick(sizes, v))

    return make


# --- the families' input makers: (config, batch, gen, dtype, **size) -------------------------
# The defaults are example_inputs' sizes; the draws' order is part of the contract (tests compare
# outputs across runs).


def flux_inputs(cfg, batch, gen, dtype, *, side: int = 8, txt: int = 16) -> dict:
    """side x side packed image tokens, `txt` text tokens; `guidance` when the config embeds it."""
    kw = dict(
        hidden_states=randn(gen, batch, side * side, cfg["in_channels"]).to(dtype),
        encoder_hidden_states=randn(gen, batch, txt, cfg["joint_attention_dim"]).to(dtype),
        pooled_projections=randn(gen, batch, cfg["pooled_projection_dim"]).to(dtype),
        timestep=torch.full((batch,), 0.5, dtype=dtype),
        img_ids=grid_ids(side, side),
        txt_ids=torch.zeros(txt, 3),
    )
    if cfg.get("guidance_embeds"):
        kw["guidance"] = torch.full((batch,), 3.5, dtype=dtype)
    return kw


def qwen_image_inputs(cfg, batch, gen, dtype, *, side: int = 8, txt: int = 12) -> dict:
    """side x side packed image tokens (img_shapes says so), `txt` text tokens with a mask."""
    return dict(
        hidden_states=randn(gen, batch, side * side, cfg["in_channels"]).to(dtype),
        encoder_hidden_states=randn(gen, batch, txt, cfg["joint_attention_dim"]).to(dtype),
        encoder_hidden_states_mask=torch.ones(batch, txt, dtype=torch.long),
        timestep=torch.full((batch,), 0.5, dtype=dtype),
        img_shapes=[[(1, side, side)]] * batch,
    )


def _patch3(cfg) -> tuple[int, int, int]:
    p = cfg["patch_size"]
    return tuple(p) if isinstance(p, (list, tuple)) else (1, p, p)


def wan_inputs(cfg, batch, gen, dtype, *, frames: int = 2, side: int = 8, txt: int = 12) -> dict:
    """frames x side x side tokens; an image embedding when the config has image_dim (I2V)."""
    pt, ph, pw = _patch3(cfg)
    kw = dict(
        hidden_states=randn(gen, batch, cfg["in_channels"], frames * pt, side * ph, side * pw).to(dtype),
        timestep=torch.full((batch,), 500, dtype=torch.long),
        encoder_hidden_states=randn(gen, batch, txt, cfg["text_dim"]).to(dtype),
    )
    if cfg.get("image_dim"):
        kw["encoder_hidden_states_image"] = randn(gen, batch, 16, cfg["image_dim"]).to(dtype)
    return kw


def z_image_inputs(cfg, batch, gen, dtype, *, side: int = 8, txt: int = 16) -> dict:
    """Lists of per-image tensors: side x side tokens, `txt` caption tokens."""
    p, fp = cfg["all_patch_size"][0], cfg["all_f_patch_size"][0]
    return dict(
        x=[randn(gen, cfg["in_channels"], fp, side * p, side * p).to(dtype) for _ in range(batch)],
        t=torch.full((batch,), 0.5, dtype=dtype),
        cap_feats=[randn(gen, txt, cfg["cap_feat_dim"]).to(dtype) for _ in range(batch)],
    )


def sd3_inputs(cfg, batch, gen, dtype, *, side: int = 8, txt: int = 12) -> dict:
    """side x side tokens of patch_size latents, `txt` text tokens, a pooled embedding."""
    latent = side * cfg["patch_size"]
    return dict(
        hidden_states=randn(gen, batch, cfg["in_channels"], latent, latent).to(dtype),
        encoder_hidden_states=randn(gen, batch, txt, cfg["joint_attention_dim"]).to(dtype),
        pooled_projections=randn(gen, batch, cfg["pooled_projection_dim"]).to(dtype),
        timestep=torch.full((batch,), 500, dtype=dtype),
    )


# --- input makers several zoo entries share: (model, gen, variant) ----------------------------


def flux_like_in(channels: int, text_dim: int, *, pooled: int | None = None, guidance: bool = False):
    def make(model, gen, v):
        s, n = pick(SIDE_P1, v), pick(TXT, v)
        kw = dict(
            hidden_states=randn(gen, 1, s * s, channels),
            encoder_hidden_states=randn(gen, 1, n, text_dim),
            timestep=torch.rand(1, generator=gen),
            img_ids=grid_ids(s, s),
            txt_ids=torch.zeros(n, 3),
        )
        if pooled:
            kw["pooled_projections"] = randn(gen, 1, pooled)
        if guidance:
            kw["guidance"] = torch.full((1,), 3.5)
        return kw

    return make


def qwen_like_in(channels: int, text_dim: int, *, nested_shapes: bool):
    def make(model, gen, v):
        s, n = pick(SIDE_P1, v), pick(TXT, v)
        shapes = [[(1, s, s)]] if nested_shapes else [(1, s, s)]
        return dict(
            hidden_states=randn(gen, 1, s * s, channels),
            encoder_hidden_states=randn(gen, 1, n, text_dim),
            encoder_hidden_states_mask=torch.ones(1, n, dtype=torch.long),
            timestep=torch.rand(1, generator=gen),
            img_shapes=shapes,
        )

    return make


def video_bcfhw_in(channels: int, text_dim: int, *, patch1: bool = False, **extra):
    """Kwargs hidden_states (1, C, F, H, W), timestep, encoder_hidden_states (1, T, text_dim); each
    `extra` keyword is made by fn(gen, frames, side, text tokens)."""

    def make(model, gen, v):
        (f, s), n = pick(VID_P1 if patch1 else VID_P2, v), pick(TXT, v)
        kw = dict(
            hidden_states=randn(gen, 1, channels, f, s, s),
            timestep=rand_t(gen),
            encoder_hidden_states=randn(gen, 1, n, text_dim),
        )
        for key, fn in extra.items():
            kw[key] = fn(gen, f, s, n)
        return kw

    return make
