"""Tiny random diffusers transformers by family name, with example inputs.

For inspection and tests without any download: `build_tiny_transformer("flux")`
returns a randomly initialised model whose structure (module names, block
lists, attention kinds) matches the real family, at hidden sizes of 64-128.
"""
from __future__ import annotations

from typing import Callable

import torch

FAMILIES = ("flux", "qwen-image", "wan", "z-image", "sd3")
#: the one alias table for family names (the tiny pipelines, the CLI and the zoo use it too);
#: Wan2.1 and Wan2.2 share the transformer class: the family is "wan", the pipeline version
#: is a separate choice of fx_fp8.tools.tiny_pipelines
ALIASES = {"qwen": "qwen-image", "qwenimage": "qwen-image", "zimage": "z-image", "wan2.1": "wan", "wan2.2": "wan"}


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def canonical_family(name: str) -> str:
    key = normalize_name(name)
    key = ALIASES.get(key, key)
    if key not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected one of {', '.join(FAMILIES)}")
    return key


def _flux(layers: int):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=32, num_layers=layers, num_single_layers=layers,
                                  attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                                  pooled_projection_dim=64, axes_dims_rope=(8, 12, 12))


def _flux_inputs(model, batch: int, gen: torch.Generator, dtype):
    img, txt = 64, 16
    return dict(hidden_states=torch.randn(batch, img, 32, generator=gen).to(dtype),
                encoder_hidden_states=torch.randn(batch, txt, 64, generator=gen).to(dtype),
                pooled_projections=torch.randn(batch, 64, generator=gen).to(dtype),
                timestep=torch.full((batch,), 0.5, dtype=dtype),
                img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1).reshape(-1, 3),
                txt_ids=torch.zeros(txt, 3))


def _qwen(layers: int):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=layers,
                                       attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                                       axes_dims_rope=(8, 12, 12))


def _qwen_inputs(model, batch, gen, dtype):
    h = w = 8  # latent tokens after packing: 8x8
    return dict(hidden_states=torch.randn(batch, h * w, 16, generator=gen).to(dtype),
                encoder_hidden_states=torch.randn(batch, 12, 64, generator=gen).to(dtype),
                encoder_hidden_states_mask=torch.ones(batch, 12, dtype=torch.long),
                timestep=torch.full((batch,), 0.5, dtype=dtype),
                img_shapes=[[(1, h, w)]] * batch)


def _wan(layers: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4,
                                 out_channels=4, text_dim=64, freq_dim=64, ffn_dim=128, num_layers=layers,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _wan_inputs(model, batch, gen, dtype):
    return dict(hidden_states=torch.randn(batch, 4, 2, 16, 16, generator=gen).to(dtype),
                timestep=torch.full((batch,), 500, dtype=torch.long),
                encoder_hidden_states=torch.randn(batch, 12, 64, generator=gen).to(dtype))


def _zimage(layers: int):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=96, n_layers=layers,
                                    n_refiner_layers=1, n_heads=3, n_kv_heads=3, cap_feat_dim=64,
                                    axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])


def _zimage_inputs(model, batch, gen, dtype):
    return dict(x=[torch.randn(4, 1, 16, 16, generator=gen).to(dtype) for _ in range(batch)],
                t=torch.full((batch,), 0.5, dtype=dtype),
                cap_feats=[torch.randn(16, 64, generator=gen).to(dtype) for _ in range(batch)])


def _sd3(layers: int):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=layers, attention_head_dim=32,
                                 num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=64,
                                 pooled_projection_dim=64, out_channels=4, pos_embed_max_size=32)


def _sd3_inputs(model, batch, gen, dtype):
    return dict(hidden_states=torch.randn(batch, 4, 16, 16, generator=gen).to(dtype),
                encoder_hidden_states=torch.randn(batch, 12, 64, generator=gen).to(dtype),
                pooled_projections=torch.randn(batch, 64, generator=gen).to(dtype),
                timestep=torch.full((batch,), 500, dtype=dtype))


_BUILDERS: dict[str, tuple[Callable, Callable]] = {
    "flux": (_flux, _flux_inputs),
    "qwen-image": (_qwen, _qwen_inputs),
    "wan": (_wan, _wan_inputs),
    "z-image": (_zimage, _zimage_inputs),
    "sd3": (_sd3, _sd3_inputs),
}


def build_tiny_transformer(family: str, *, layers: int = 2, seed: int = 0, dtype=torch.float32):
    """A randomly initialised tiny transformer of `family`, in eval mode."""
    build, _ = _BUILDERS[canonical_family(family)]
    torch.manual_seed(seed)
    return build(layers).to(dtype).eval()


def example_inputs(family: str, model, *, batch: int = 1, seed: int = 0, dtype=torch.float32) -> dict:
    """Keyword arguments for one forward call of build_tiny_transformer(family)."""
    _, make = _BUILDERS[canonical_family(family)]
    gen = torch.Generator().manual_seed(seed)
    return make(model, batch, gen, dtype)


def output_tensor(out) -> torch.Tensor:
    """The sample tensor of a diffusers transformer output (dataclass, tuple or list of tensors)."""
    if hasattr(out, "sample"):
        out = out.sample
    elif isinstance(out, tuple):
        out = out[0]
    if isinstance(out, (list, tuple)):
        return torch.stack([o.float() for o in out])
    return out
