"""Real diffusers pipelines built offline from tiny random components.

For tests, examples and the CLI: no download, no tokenizer, no text encoder.
Each builder returns ``(pipe, call_kwargs)`` where ``call_kwargs`` are the
prompt-embedding arguments (``prompt_embeds``, ``pooled_prompt_embeds``,
negative embeddings for classifier-free guidance, ...) and sizes a call
needs: ``pipe(**call_kwargs, num_inference_steps=4, generator=g)``.

The transformers are the families' registry entries (fx_fp8.tools.model_zoo.families,
the same structure as the real families at hidden sizes of 64-128); the VAEs are one- or
two-block versions of the real ones. Weights are random: outputs are noise-like, but every
module, scheduler call and guidance path of the real pipeline runs.
"""

from __future__ import annotations

import warnings

import torch

from fx_fp8.tools.model_zoo.vaes import AUTOENCODER_KL, QWEN_VAE, WAN_VAE


def _transformer(family: str, layers: int, seed: int):
    """The family's tiny transformer (registry.build_tiny_transformer; imported here: registry
    imports this module when it builds a pipeline)."""
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    with warnings.catch_warnings():  # diffusers warns about unused config keys of tiny models
        warnings.simplefilter("ignore")
        return build_tiny_transformer(family, layers=layers, seed=seed)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vae(config: dict, seed: int, **over):
    import diffusers

    torch.manual_seed(seed)
    kw = {k: v for k, v in config.items() if k != "_class_name"}
    kw.update(over)
    return getattr(diffusers, config["_class_name"])(**kw).eval()


def _latent_stats(z_dim: int) -> dict:
    return dict(z_dim=z_dim, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)


def _scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)


def tiny_flux(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32):
    """FluxPipeline, 32x32 image = 8x8 packed tokens; guidance-distilled-free (guidance_embeds=False)."""
    from diffusers import FluxPipeline

    transformer = _transformer("flux", layers, seed)
    cfg = transformer.config
    vae = _vae(AUTOENCODER_KL, seed, latent_channels=cfg.in_channels // 4)  # Flux packs 2x2 latent patches
    pipe = FluxPipeline(
        scheduler=_scheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    g = _gen(seed + 1)
    kwargs = dict(
        prompt_embeds=torch.randn(1, 16, cfg.joint_attention_dim, generator=g),
        pooled_prompt_embeds=torch.randn(1, cfg.pooled_projection_dim, generator=g),
        height=height,
        width=width,
    )
    return pipe, kwargs


def tiny_sd3(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32):
    """StableDiffusion3Pipeline with classifier-free guidance batched into one transformer call."""
    from diffusers import StableDiffusion3Pipeline

    transformer = _transformer("sd3", layers, seed)
    cfg = transformer.config
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=_scheduler(shift=3.0),
        vae=_vae(AUTOENCODER_KL, seed, latent_channels=cfg.in_channels),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    g = _gen(seed + 1)
    text, pooled = cfg.joint_attention_dim, cfg.pooled_projection_dim
    kwargs = dict(
        prompt_embeds=torch.randn(1, 12, text, generator=g),
        pooled_prompt_embeds=torch.randn(1, pooled, generator=g),
        negative_prompt_embeds=torch.randn(1, 12, text, generator=g),
        negative_pooled_prompt_embeds=torch.randn(1, pooled, generator=g),
        guidance_scale=3.0,
        height=height,
        width=width,
    )
    return pipe, kwargs


def tiny_qwen_image(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32, true_cfg: bool = True):
    """QwenImagePipeline; with ``true_cfg`` the transformer runs twice per step (cond and uncond)."""
    from diffusers import QwenImagePipeline

    transformer = _transformer("qwen-image", layers, seed)
    cfg = transformer.config
    pipe = QwenImagePipeline(
        scheduler=_scheduler(),
        vae=_vae(QWEN_VAE, seed, **_latent_stats(cfg.in_channels // 4)),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    g = _gen(seed + 1)
    n = 12  # same length for both prompts: one graph serves the cond and the uncond call
    text = cfg.joint_attention_dim
    kwargs = dict(
        prompt_embeds=torch.randn(1, n, text, generator=g),
        prompt_embeds_mask=torch.ones(1, n, dtype=torch.long),
        height=height,
        width=width,
    )
    if true_cfg:
        kwargs.update(
            negative_prompt_embeds=torch.randn(1, n, text, generator=g),
            negative_prompt_embeds_mask=torch.ones(1, n, dtype=torch.long),
            true_cfg_scale=4.0,
        )
    else:
        kwargs.update(true_cfg_scale=1.0)
    return pipe, kwargs


def tiny_wan(
    *,
    two_experts: bool = False,
    boundary_ratio: float = 0.85,
    layers: int = 2,
    seed: int = 0,
    height: int = 32,
    width: int = 32,
    num_frames: int = 3,
):
    """WanPipeline (text-to-video; ``num_frames`` odd). ``two_experts`` builds Wan2.2: ``transformer`` for the
    high-noise steps (t >= boundary_ratio * 1000), ``transformer_2`` for the rest (with 5 steps and the
    default 0.85: steps 0-1 and 2-4)."""
    from diffusers import WanPipeline

    transformer = _transformer("wan", layers, seed)
    transformer_2 = _transformer("wan", layers, seed + 100) if two_experts else None
    cfg = transformer.config
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=_vae(WAN_VAE, seed, **_latent_stats(cfg.in_channels)),
        scheduler=_scheduler(shift=3.0),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=boundary_ratio if two_experts else None,
    )
    g = _gen(seed + 1)
    kwargs = dict(
        prompt_embeds=torch.randn(1, 12, cfg.text_dim, generator=g),
        negative_prompt_embeds=torch.randn(1, 12, cfg.text_dim, generator=g),
        guidance_scale=3.0,
        height=height,
        width=width,
        num_frames=num_frames,
    )
    return pipe, kwargs


def tiny_wan22(**kw):
    """Wan2.2: tiny_wan with two experts."""
    return tiny_wan(two_experts=True, **kw)


def tiny_z_image(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32):
    """ZImagePipeline; classifier-free guidance batched into one call (lists of per-image tensors)."""
    from diffusers import ZImagePipeline

    transformer = _transformer("z-image", layers, seed)
    cfg = transformer.config
    vae = _vae(AUTOENCODER_KL, seed, latent_channels=cfg.in_channels)
    pipe = ZImagePipeline(
        scheduler=_scheduler(shift=3.0), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    g = _gen(seed + 1)
    kwargs = dict(
        prompt_embeds=[torch.randn(16, cfg.cap_feat_dim, generator=g)],
        negative_prompt_embeds=[torch.randn(16, cfg.cap_feat_dim, generator=g)],
        guidance_scale=3.0,
        height=height,
        width=width,
    )
    return pipe, kwargs
