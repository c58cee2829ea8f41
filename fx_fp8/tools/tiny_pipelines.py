"""Real diffusers pipelines built offline from tiny random components.

For tests, examples and the CLI: no download, no tokenizer, no text encoder.
Each builder returns ``(pipe, call_kwargs)`` where ``call_kwargs`` are the
prompt-embedding arguments (``prompt_embeds``, ``pooled_prompt_embeds``,
negative embeddings for classifier-free guidance, ...) and sizes a call
needs: ``pipe(**call_kwargs, num_inference_steps=4, generator=g)``.

The transformers come from :mod:`fx_fp8.tools.families` (same structure as the real
families at hidden sizes of 64-128); the VAEs are one- or two-block versions of
the real ones. Weights are random: outputs are noise-like, but every module,
scheduler call and guidance path of the real pipeline runs.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from fx_fp8.tools.families import build_tiny_transformer, canonical_family, normalize_name

#: pipelines this module can build, by name
TINY_PIPELINES = ("flux", "qwen-image", "wan2.1", "wan2.2", "z-image", "sd3")
#: the pipeline a family name means (family aliases: fx_fp8.tools.families.ALIASES); only Wan has versions
_FAMILY_PIPELINE = {"wan": "wan2.1"}


def _transformer(family: str, layers: int, seed: int):
    with warnings.catch_warnings():  # diffusers warns about unused config keys of tiny models
        warnings.simplefilter("ignore")
        return build_tiny_transformer(family, layers=layers, seed=seed)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _autoencoder_kl(latent_channels: int, seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    # two blocks -> vae_scale_factor 2: a 32x32 image is a 16x16 latent
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 16), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=8, sample_size=32, scaling_factor=1.0,
                         shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
                         mid_block_add_attention=False).eval()


def _scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)


def tiny_flux(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32):
    """FluxPipeline, 32x32 image = 8x8 packed tokens; guidance-distilled-free (guidance_embeds=False)."""
    from diffusers import FluxPipeline

    transformer = _transformer("flux", layers, seed)
    pipe = FluxPipeline(scheduler=_scheduler(), vae=_autoencoder_kl(transformer.config.in_channels // 4, seed),
                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    g = _gen(seed + 1)
    kwargs = dict(prompt_embeds=torch.randn(1, 16, 64, generator=g), pooled_prompt_embeds=torch.randn(1, 64, generator=g),
                  height=height, width=width)
    return pipe, kwargs


def tiny_sd3(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32):
    """StableDiffusion3Pipeline with classifier-free guidance batched into one transformer call."""
    from diffusers import StableDiffusion3Pipeline

    transformer = _transformer("sd3", layers, seed)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=_scheduler(shift=3.0),
                                    vae=_autoencoder_kl(transformer.config.in_channels, seed), text_encoder=None,
                                    tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                    tokenizer_3=None)
    g = _gen(seed + 1)
    kwargs = dict(prompt_embeds=torch.randn(1, 12, 64, generator=g), pooled_prompt_embeds=torch.randn(1, 64, generator=g),
                  negative_prompt_embeds=torch.randn(1, 12, 64, generator=g),
                  negative_pooled_prompt_embeds=torch.randn(1, 64, generator=g),
                  guidance_scale=3.0, height=height, width=width)
    return pipe, kwargs


def _qwen_vae(z_dim: int, seed: int):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    # one temporal-downsample entry -> vae_scale_factor 2
    return AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
                                  latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim).eval()


def tiny_qwen_image(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32, true_cfg: bool = True):
    """QwenImagePipeline; with ``true_cfg`` the transformer runs twice per step (cond and uncond)."""
    from diffusers import QwenImagePipeline

    transformer = _transformer("qwen-image", layers, seed)
    pipe = QwenImagePipeline(scheduler=_scheduler(), vae=_qwen_vae(transformer.config.in_channels // 4, seed),
                             text_encoder=None, tokenizer=None, transformer=transformer)
    g = _gen(seed + 1)
    n = 12  # same length for both prompts: one graph serves the cond and the uncond call
    kwargs = dict(prompt_embeds=torch.randn(1, n, 64, generator=g), prompt_embeds_mask=torch.ones(1, n, dtype=torch.long),
                  height=height, width=width)
    if true_cfg:
        kwargs.update(negative_prompt_embeds=torch.randn(1, n, 64, generator=g),
                      negative_prompt_embeds_mask=torch.ones(1, n, dtype=torch.long), true_cfg_scale=4.0)
    else:
        kwargs.update(true_cfg_scale=1.0)
    return pipe, kwargs


def _wan_vae(z_dim: int, seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    # x2 in space and in time (causal: 1 + 2k frames from 1 + k latent frames)
    return AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True],
                            latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim, scale_factor_temporal=2,
                            scale_factor_spatial=2).eval()


def tiny_wan(*, two_experts: bool = False, boundary_ratio: float = 0.85, layers: int = 2, seed: int = 0,
             height: int = 32, width: int = 32, num_frames: int = 3):
    """WanPipeline (text-to-video; ``num_frames`` odd). ``two_experts`` builds Wan2.2: ``transformer`` for the
    high-noise steps (t >= boundary_ratio * 1000), ``transformer_2`` for the rest (with 5 steps and the
    default 0.85: steps 0-1 and 2-4)."""
    from diffusers import WanPipeline

    transformer = _transformer("wan", layers, seed)
    transformer_2 = _transformer("wan", layers, seed + 100) if two_experts else None
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=_wan_vae(transformer.config.in_channels, seed),
                       scheduler=_scheduler(shift=3.0), transformer=transformer, transformer_2=transformer_2,
                       boundary_ratio=boundary_ratio if two_experts else None)
    g = _gen(seed + 1)
    kwargs = dict(prompt_embeds=torch.randn(1, 12, 64, generator=g), negative_prompt_embeds=torch.randn(1, 12, 64, generator=g),
                  guidance_scale=3.0, height=height, width=width, num_frames=num_frames)
    return pipe, kwargs


def tiny_z_image(*, layers: int = 2, seed: int = 0, height: int = 32, width: int = 32):
    """ZImagePipeline; classifier-free guidance batched into one call (lists of per-image tensors)."""
    from diffusers import ZImagePipeline

    transformer = _transformer("z-image", layers, seed)
    pipe = ZImagePipeline(scheduler=_scheduler(shift=3.0), vae=_autoencoder_kl(transformer.in_channels, seed),
                          text_encoder=None, tokenizer=None, transformer=transformer)
    g = _gen(seed + 1)
    kwargs = dict(prompt_embeds=[torch.randn(16, 64, generator=g)], negative_prompt_embeds=[torch.randn(16, 64, generator=g)],
                  guidance_scale=3.0, height=height, width=width)
    return pipe, kwargs


_BUILDERS: dict[str, Callable] = {
    "flux": tiny_flux,
    "qwen-image": tiny_qwen_image,
    "wan2.1": tiny_wan,
    "wan2.2": lambda **kw: tiny_wan(two_experts=True, **kw),
    "z-image": tiny_z_image,
    "sd3": tiny_sd3,
}


def build_tiny_pipeline(name: str, **kwargs):
    """``(pipe, call_kwargs)`` for one of :data:`TINY_PIPELINES`, or a family name or alias
    (``wan`` is Wan2.1; ``wan2.2`` the two-expert pipeline)."""
    key = normalize_name(name)
    if key not in _BUILDERS:
        try:
            family = canonical_family(key)
        except ValueError:
            family = None
        key = _FAMILY_PIPELINE.get(family, family) if family else key
    if key not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline {name!r}: expected one of {', '.join(TINY_PIPELINES)}")
    pipe, call_kwargs = _BUILDERS[key](**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe, call_kwargs
