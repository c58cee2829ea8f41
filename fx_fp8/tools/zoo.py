"""A zoo of tiny random diffusers transformers (image, video, audio) for tests and benchmarks.

Everything is built offline and in-process: no hub, no network. Each entry builds a randomly
initialised diffusers transformer at hidden sizes of 16-64 with 1-2 layers, and makes forward
kwargs at 4 size variants (0 = fewest attention tokens, 3 = most)::

    from fx_fp8.tools.zoo import ZOO, build, make_inputs, output_tensor

    model = build("cogvideox", seed=0)
    kwargs = make_inputs("cogvideox", model, seed=0, variant=2)
    out = output_tensor(model(**kwargs))

`ZooEntry.notes` starts with facts measured at variant 0, as "; "-separated flags, then free text:

- ``sdpa=N``: Dynamo captures N F.scaled_dot_product_attention call_function nodes (diffusers'
  attention dispatcher and direct calls alike); N grows with the layer counts;
- ``cross-attn`` where some SDPA has query length != key length, else ``self-attn-only``
  (joint text+image attention over one concatenated sequence counts as self-attention);
- ``mask`` where some SDPA gets an attn_mask; ``gqa`` where some SDPA has fewer kv than query heads;
- ``graphs=N`` where torch.compile(backend="eager", fullgraph=False) makes N > 1 graphs (breaks);
  absent means one graph. ``warmup`` would mark a model that needs an eager call before compiling
  (none does). Every entry's compiled output equals its eager output (allclose 1e-5) at all variants.

Configs are tiny versions of those in diffusers' own model tests, adapted to the installed
diffusers; the sizes are chosen for speed, not to resemble a real checkpoint. The 5 families of
fx_fp8.tools.families (flux, qwen-image, wan, z-image, sd3) are also here, at smaller sizes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from fx_fp8.tools.families import ALIASES, normalize_name, output_tensor

__all__ = ["ZooEntry", "ZOO", "VARIANTS", "build", "make_inputs", "output_tensor", "names"]

VARIANTS = 4  # size variants 0..3 per entry


@dataclass(frozen=True)
class ZooEntry:
    """One tiny model: how to build it and how to make forward kwargs at a size variant."""

    name: str  # short id, e.g. "cogvideox"
    class_name: str  # diffusers class, e.g. "CogVideoXTransformer3DModel"
    kind: str  # "image" | "video" | "audio"
    build: Callable[[], torch.nn.Module]  # tiny random model; call under torch.manual_seed
    inputs: Callable[[torch.nn.Module, torch.Generator, int], dict]  # forward kwargs at variant 0..3
    notes: str = ""  # see the module docstring


# --- helpers ---------------------------------------------------------------------------------


def _cls(name: str):
    import diffusers

    try:
        return getattr(diffusers, name)
    except AttributeError:
        raise ImportError(f"diffusers {diffusers.__version__} has no {name} (the zoo targets 0.42)") from None


def _randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _t(gen: torch.Generator, high: int = 1000) -> torch.Tensor:
    """A random integer timestep in [0, high), as a float tensor of shape (1,)."""
    return torch.randint(0, high, (1,), generator=gen).float()


def _ids2d(h: int, w: int, t: float = 0.0) -> torch.Tensor:
    """Flux-style (h*w, 3) position ids: (t, row, col)."""
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                                indexing="ij")
    return torch.stack([torch.full_like(rows, t), rows, cols], -1).reshape(-1, 3)


def _pick(seq, variant: int):
    if not 0 <= variant < VARIANTS:
        raise ValueError(f"variant must be in 0..{VARIANTS - 1}, got {variant}")
    return seq[variant]


# Size tables: index = variant. Attention sees more tokens at each step.
SIDE_P2 = (8, 12, 16, 20)  # latent side for patch-2 image models: 16, 36, 64, 100 image tokens
SIDE_P1 = (4, 6, 8, 10)  # token-grid side for packed / patch-1 image models: 16, 36, 64, 100 tokens
TXT = (6, 8, 10, 12)  # text tokens
VID_P2 = ((1, 8), (2, 8), (2, 12), (3, 12))  # (latent frames, side) for (1, 2, 2) patches: 16, 32, 72, 108 tokens
VID_P1 = ((1, 4), (2, 4), (2, 6), (3, 6))  # (latent frames, side) for patch 1: 16, 32, 72, 108 tokens
AUDIO = (8, 16, 24, 32)  # audio latent frames


# --- image models ----------------------------------------------------------------------------


def _auraflow():
    return _cls("AuraFlowTransformer2DModel")(
        sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=16, num_attention_heads=2, caption_projection_dim=32, joint_attention_dim=32,
        out_channels=4, pos_embed_max_size=128)


def _auraflow_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 32), timestep=_t(gen))


def _flux_like_in(channels: int, text_dim: int, *, pooled: int | None = None, guidance: bool = False):
    def make(model, gen, v):
        s, n = _pick(SIDE_P1, v), _pick(TXT, v)
        kw = dict(hidden_states=_randn(gen, 1, s * s, channels), encoder_hidden_states=_randn(gen, 1, n, text_dim),
                  timestep=torch.rand(1, generator=gen), img_ids=_ids2d(s, s), txt_ids=torch.zeros(n, 3))
        if pooled:
            kw["pooled_projections"] = _randn(gen, 1, pooled)
        if guidance:
            kw["guidance"] = torch.full((1,), 3.5)
        return kw

    return make


def _flux():
    return _cls("FluxTransformer2DModel")(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def _bria():
    return _cls("BriaTransformer2DModel")(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=None, axes_dims_rope=[0, 8, 8])


def _bria_fibo():
    return _cls("BriaFiboTransformer2DModel")(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, text_encoder_dim=16, pooled_projection_dim=None, axes_dims_rope=[0, 8, 8])


def _bria_fibo_in(model, gen, v):
    kw = _flux_like_in(16, 32)(model, gen, v)
    n = kw["encoder_hidden_states"].shape[1]
    # one text-encoder layer per transformer block (double + single)
    kw["text_encoder_layers"] = [_randn(gen, 1, n, 16) for _ in range(2)]
    return kw


def _chroma():
    return _cls("ChromaTransformer2DModel")(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=[4, 4, 8], approximator_num_channels=8, approximator_hidden_dim=16,
        approximator_layers=1)


def _flux2():
    return _cls("Flux2Transformer2DModel")(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])


def _flux2_in(model, gen, v):
    s, n = _pick(SIDE_P1, v), _pick(TXT, v)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(s), torch.arange(s), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(n))
    return dict(hidden_states=_randn(gen, 1, s * s, 8), encoder_hidden_states=_randn(gen, 1, n, 32),
                img_ids=img_ids[None], txt_ids=txt_ids[None], timestep=torch.rand(1, generator=gen),
                guidance=torch.full((1,), 3.5))


def _longcat_image():
    return _cls("LongCatImageTransformer2DModel")(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def _ovis_image():
    return _cls("OvisImageTransformer2DModel")(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8))


def _cogview_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    size = torch.tensor([[s * 8, s * 8]], dtype=torch.float32)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 8), timestep=_t(gen),
                original_size=size, target_size=size.clone(), crop_coords=torch.zeros(1, 2))


def _cogview3plus():
    return _cls("CogView3PlusTransformer2DModel")(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2, out_channels=4,
        text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=16, sample_size=16)


def _cogview4():
    return _cls("CogView4Transformer2DModel")(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2, out_channels=4,
        text_embed_dim=8, time_embed_dim=8, condition_dim=4)


def _dit():
    return _cls("DiTTransformer2DModel")(
        in_channels=4, out_channels=8, activation_fn="gelu-approximate", num_attention_heads=2, attention_head_dim=8,
        attention_bias=True, num_layers=1, norm_type="ada_norm_zero", num_embeds_ada_norm=8, patch_size=2,
        sample_size=8)


def _dit_in(model, gen, v):
    s = _pick(SIDE_P2, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), timestep=_t(gen),
                class_labels=torch.randint(0, 4, (1,), generator=gen))


def _hidream():
    return _cls("HiDreamImageTransformer2DModel")(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
        force_inference_output=True)


def _hidream_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), timesteps=_t(gen),
                encoder_hidden_states_t5=_randn(gen, 1, n, 8),
                encoder_hidden_states_llama3=_randn(gen, 2, 1, n, 4),  # (llama layers, batch, tokens, dim)
                pooled_embeds=_randn(gen, 1, 8))


def _hunyuan_image():
    return _cls("HunyuanImageTransformer2DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False, text_embed_dim=32,
        text_embed_2_dim=None, rope_axes_dim=(4, 4))  # a text_embed_2_dim adds a 2048-wide ByT5 projection


def _hunyuan_image_in(model, gen, v):
    s, n = _pick(SIDE_P1, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), timestep=_t(gen), encoder_hidden_states=_randn(gen, 1, n, 32),
                encoder_attention_mask=torch.ones(1, n))


def _hunyuan_dit():
    return _cls("HunyuanDiT2DModel")(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16, text_len=4,
        text_len_t5=4, activation_fn="gelu-approximate")


def _hunyuan_dit_in(model, gen, v):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    s = _pick(SIDE_P2, v)
    grid = s // 2
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (grid, grid)), (grid, grid))
    # the text lengths are fixed by the config (text_len, text_len_t5): the image size varies
    return dict(hidden_states=_randn(gen, 1, 4, s, s), timestep=_t(gen), encoder_hidden_states=_randn(gen, 1, 4, 8),
                text_embedding_mask=torch.ones(1, 4), encoder_hidden_states_t5=_randn(gen, 1, 4, 8),
                text_embedding_mask_t5=torch.ones(1, 4),
                image_meta_size=torch.tensor([[1024.0, 1024.0, s * 8, s * 8, 0.0, 0.0]]),
                style=torch.zeros(1, dtype=torch.long), image_rotary_emb=rope)


def _lumina2():
    return _cls("Lumina2Transformer2DModel")(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=1, num_refiner_layers=1,
        num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
        scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32)


def _lumina2_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), timestep=torch.rand(1, generator=gen),
                encoder_hidden_states=_randn(gen, 1, n, 32), encoder_attention_mask=torch.ones(1, n, dtype=torch.bool))


def _omnigen():
    return _cls("OmniGenTransformer2DModel")(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, num_layers=2,
        pad_token_id=0, vocab_size=100, in_channels=4, time_step_dim=16,
        rope_scaling={"long_factor": list(range(1, 9)), "short_factor": list(range(1, 9))})


def _omnigen_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    seq = n + 1 + (s // 2) ** 2  # text tokens, the time token, the output image tokens
    return dict(hidden_states=_randn(gen, 1, 4, s, s), timestep=torch.rand(1, generator=gen),
                input_ids=torch.randint(1, 100, (1, n), generator=gen), input_img_latents=[], input_image_sizes={},
                attention_mask=torch.ones(1, seq, seq), position_ids=torch.arange(seq)[None])


def _prx():
    return _cls("PRXTransformer2DModel")(
        in_channels=4, patch_size=2, context_in_dim=32, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2,
        axes_dim=[8, 8], theta=10_000)


def _prx_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 32),
                timestep=torch.rand(1, generator=gen))


def _pixart():
    return _cls("PixArtTransformer2DModel")(
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=2, in_channels=4,
        cross_attention_dim=16, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        use_additional_conditions=False, caption_channels=16)


def _pixart_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 16), timestep=_t(gen),
                added_cond_kwargs={"aspect_ratio": None, "resolution": None})


def _qwen_image():
    return _cls("QwenImageTransformer2DModel")(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def _qwen_like_in(channels: int, text_dim: int, *, nested_shapes: bool):
    def make(model, gen, v):
        s, n = _pick(SIDE_P1, v), _pick(TXT, v)
        shapes = [[(1, s, s)]] if nested_shapes else [(1, s, s)]
        return dict(hidden_states=_randn(gen, 1, s * s, channels), encoder_hidden_states=_randn(gen, 1, n, text_dim),
                    encoder_hidden_states_mask=torch.ones(1, n, dtype=torch.long),
                    timestep=torch.rand(1, generator=gen), img_shapes=shapes)

    return make


def _nucleus_moe():
    return _cls("NucleusMoEImageTransformer2DModel")(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4), moe_enabled=False, capacity_factors=[8.0, 8.0])


def _sd3():
    return _cls("SD3Transformer2DModel")(
        sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=32)


def _sd3_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 32),
                pooled_projections=_randn(gen, 1, 32), timestep=_t(gen))


def _sana():
    return _cls("SanaTransformer2DModel")(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
        sample_size=16)


def _sana_in(model, gen, v):
    s, n = _pick(SIDE_P1, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 8), timestep=_t(gen))


def _zimage():
    return _cls("ZImageTransformer2DModel")(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])


def _zimage_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(x=[_randn(gen, 4, 1, s, s)], t=torch.rand(1, generator=gen), cap_feats=[_randn(gen, n, 32)])


def _glm_image():
    return _cls("GlmImageTransformer2DModel")(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        text_embed_dim=32, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=64)


def _glm_image_in(model, gen, v):
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    tokens = (s // 2) ** 2  # one prior token per image token
    return dict(hidden_states=_randn(gen, 1, 4, s, s), encoder_hidden_states=_randn(gen, 1, n, 32),
                prior_token_id=torch.randint(0, 64, (1, tokens), generator=gen),
                prior_token_drop=torch.zeros(1, tokens, dtype=torch.bool), timestep=_t(gen),
                target_size=torch.tensor([[s * 8.0, s * 8.0]]), crop_coords=torch.zeros(1, 2))


def _ernie_image():
    return _cls("ErnieImageTransformer2DModel")(
        hidden_size=32, num_attention_heads=2, num_layers=1, ffn_hidden_size=32, in_channels=16, out_channels=16,
        patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4), eps=1e-6, qk_layernorm=True)


def _ernie_image_in(model, gen, v):
    s, n = _pick(SIDE_P1, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 16, s, s), timestep=torch.ones(1), text_bth=_randn(gen, 1, n, 16),
                text_lens=torch.tensor([n]))


def _ideogram4():
    return _cls("Ideogram4Transformer2DModel")(
        in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=4, intermediate_size=32, adaln_dim=16,
        llm_features_dim=24, rope_theta=10_000, mrope_section=(2, 1, 1), norm_eps=1e-5)


def _ideogram4_in(model, gen, v):
    from diffusers.models.transformers import transformer_ideogram4 as m

    s, n = _pick(SIDE_P1, v), _pick(TXT, v)
    img = s * s
    seq = n + img
    hidden = torch.zeros(1, seq, 16)
    hidden[:, n:] = _randn(gen, 1, img, 16)
    text = torch.zeros(1, seq, 24)
    text[:, :n] = _randn(gen, 1, n, 24)
    pos = torch.zeros(1, seq, 3, dtype=torch.long)
    pos[0, :n] = torch.arange(n)[:, None]
    rows, cols = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    pos[0, n:, 0] = m.IMAGE_POSITION_OFFSET
    pos[0, n:, 1] = rows.reshape(-1) + m.IMAGE_POSITION_OFFSET
    pos[0, n:, 2] = cols.reshape(-1) + m.IMAGE_POSITION_OFFSET
    indicator = torch.full((1, seq), m.OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :n] = m.LLM_TOKEN_INDICATOR
    return dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.full((1,), 0.5), position_ids=pos,
                segment_ids=torch.ones(1, seq, dtype=torch.long), indicator=indicator)


def _krea2():
    return _cls("Krea2Transformer2DModel")(
        in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
        text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 2, 2), rope_theta=1000.0, norm_eps=1e-5)


def _krea2_in(model, gen, v):
    s, n = _pick(SIDE_P1, v), _pick(TXT, v)
    pos = torch.zeros(n + s * s, 3)
    pos[n:, 1] = torch.arange(s).repeat_interleave(s)
    pos[n:, 2] = torch.arange(s).repeat(s)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[:, -1] = False  # one padded text token
    return dict(hidden_states=_randn(gen, 1, s * s, 16), encoder_hidden_states=_randn(gen, 1, n, 3, 16),
                timestep=torch.full((1,), 0.5), position_ids=pos, encoder_attention_mask=mask)


# --- video models ----------------------------------------------------------------------------


def _cogvideox():
    return _cls("CogVideoXTransformer3DModel")(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=4,
        text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=8)


def _cogvideox_in(model, gen, v):
    f, s = _pick(VID_P2, v)
    # the text length is fixed to max_text_seq_length by the positional embedding
    return dict(hidden_states=_randn(gen, 1, f, 4, s, s), encoder_hidden_states=_randn(gen, 1, 8, 8), timestep=_t(gen))


def _consisid():
    return _cls("ConsisIDTransformer3DModel")(
        # hidden 48: the 3D sin-cos embedding needs a multiple of 16 split 3:1, the face kv dim 2/3 of it
        num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4, time_embed_dim=4,
        text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8, cross_attn_interval=1, is_kps=False,
        is_train_face=True, cross_attn_dim_head=8, cross_attn_num_heads=2, LFE_id_dim=8, LFE_vit_dim=8, LFE_depth=1,
        LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2, LFE_num_querie=4,
        LFE_output_dim=32,  # = the face cross-attention kv dim, 2/3 of the hidden size
        LFE_ff_mult=1, LFE_num_scale=1)


def _consisid_in(model, gen, v):
    kw = _cogvideox_in(model, gen, v)
    kw.update(id_vit_hidden=[_randn(gen, 1, 2, 8)], id_cond=_randn(gen, 1, 8))
    return kw


def _cosmos():
    return _cls("CosmosTransformer3DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1, mlp_ratio=2,
        text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0),
        concat_padding_mask=False,  # True resizes the padding mask with torchvision
        extra_pos_embed_type="learnable")


def _cosmos_in(model, gen, v):
    (f, s), n = _pick(VID_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, f, s, s), timestep=_t(gen), encoder_hidden_states=_randn(gen, 1, n, 16),
                attention_mask=torch.ones(1, n), fps=30)


def _easyanimate():
    return _cls("EasyAnimateTransformer3DModel")(
        attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=1, num_layers=1, out_channels=4,
        patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16, time_embed_dim=8,
        time_position_encoding_type="3d_rope", timestep_activation_fn="silu")


def _video_bcfhw_in(channels: int, text_dim: int, *, patch1: bool = False, **extra):
    """Kwargs hidden_states (1, C, F, H, W), timestep, encoder_hidden_states (1, T, text_dim)."""

    def make(model, gen, v):
        (f, s), n = _pick(VID_P1 if patch1 else VID_P2, v), _pick(TXT, v)
        kw = dict(hidden_states=_randn(gen, 1, channels, f, s, s), timestep=_t(gen),
                  encoder_hidden_states=_randn(gen, 1, n, text_dim))
        for key, fn in extra.items():
            kw[key] = fn(gen, f, s, n)
        return kw

    return make


def _hunyuan_video():
    return _cls("HunyuanVideoTransformer3DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None)


def _hunyuan_video15():
    return _cls("HunyuanVideo15Transformer3DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8,
        image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")


def _framepack():
    return _cls("HunyuanVideoFramepackTransformer3DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
        has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True)


FRAMEPACK = ((1, 4), (2, 4), (2, 8), (3, 8))  # (frames, side): the 4x history embedder patches 8x8


def _framepack_in(model, gen, v):
    (f, s), n = _pick(FRAMEPACK, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, f, s, s), timestep=_t(gen), encoder_hidden_states=_randn(gen, 1, n, 16),
                encoder_attention_mask=torch.ones(1, n), pooled_projections=_randn(gen, 1, 8),
                guidance=torch.full((1,), 6.0), image_embeds=_randn(gen, 1, 4, 16),
                indices_latents=torch.arange(f, dtype=torch.float32) + 3,
                latents_clean=_randn(gen, 1, 4, 1, s, s), indices_latents_clean=torch.zeros(1),
                latents_history_2x=_randn(gen, 1, 4, 2, s, s), indices_latents_history_2x=torch.tensor([1.0, 2.0]),
                latents_history_4x=_randn(gen, 1, 4, 4, s, s),
                indices_latents_history_4x=torch.arange(4, dtype=torch.float32) + f + 3)


def _ltx():
    return _cls("LTXVideoTransformer3DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16)


def _ltx_in(model, gen, v):
    (f, s), n = _pick(VID_P1, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, f * s * s, 4), encoder_hidden_states=_randn(gen, 1, n, 16),
                timestep=_t(gen), encoder_attention_mask=torch.ones(1, n, dtype=torch.bool), num_frames=f, height=s,
                width=s)


def _ltx2():
    return _cls("LTX2VideoTransformer3DModel")(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=1, qk_norm="rms_norm_across_heads",
        caption_channels=16, rope_double_precision=False)


def _ltx2_in(model, gen, v):
    (f, s), n, a = _pick(VID_P1, v), _pick(TXT, v), _pick((5, 9, 13, 17), v)
    return dict(hidden_states=_randn(gen, 1, f * s * s, 4), audio_hidden_states=_randn(gen, 1, a, 4),
                encoder_hidden_states=_randn(gen, 1, n, 16), audio_encoder_hidden_states=_randn(gen, 1, n, 16),
                timestep=_t(gen), encoder_attention_mask=torch.ones(1, n, dtype=torch.bool), num_frames=f, height=s,
                width=s, audio_num_frames=a, fps=25.0)


def _latte():
    return _cls("LatteTransformer3DModel")(
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=2, caption_channels=8,
        in_channels=4, cross_attention_dim=16, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        video_length=2)


def _latte_in(model, gen, v):
    # the temporal position embedding fixes the frame count to video_length: only the image size varies
    s, n = _pick(SIDE_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 4, 2, s, s), encoder_hidden_states=_randn(gen, 1, n, 8), timestep=_t(gen),
                enable_temporal_attentions=True)


def _mochi():
    return _cls("MochiTransformer3DModel")(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1, pooled_projection_dim=16,
        in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
        activation_fn="swiglu", max_sequence_length=16)


def _sana_video():
    return _cls("SanaVideoTransformer3DModel")(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16,
        mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8, patch_size=(1, 2, 2),
        norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _wan_kwargs(**over):
    kw = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    kw.update(over)
    return kw


def _wan():
    return _cls("WanTransformer3DModel")(**_wan_kwargs())


def _skyreels_v2():
    return _cls("SkyReelsV2Transformer3DModel")(**_wan_kwargs())


def _wan_vace():
    return _cls("WanVACETransformer3DModel")(**_wan_kwargs(num_layers=2, vace_layers=[0], vace_in_channels=12))


def _chronoedit():
    return _cls("ChronoEditTransformer3DModel")(**_wan_kwargs(eps=1e-6, rope_temporal_skip_len=8))


def _helios():
    return _cls("HeliosTransformer3DModel")(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_dim=(4, 4, 4), has_multi_term_memory_patch=True, guidance_cross_attn=True, zero_history_timestep=True,
        is_amplify_history=False)


def _helios_in(model, gen, v):
    (f, s), n = _pick(((1, 8), (2, 8), (2, 16), (3, 16)), v), _pick(TXT, v)  # the long history patches 8x8 (4x)
    return dict(hidden_states=_randn(gen, 1, 4, f, s, s), timestep=_t(gen), encoder_hidden_states=_randn(gen, 1, n, 16),
                indices_hidden_states=torch.arange(f, dtype=torch.float32)[None] + 6,
                indices_latents_history_short=torch.ones(1, 1), indices_latents_history_mid=torch.ones(1, 1) * 2,
                indices_latents_history_long=torch.arange(4, dtype=torch.float32)[None] + 2,
                latents_history_short=_randn(gen, 1, 4, 1, s, s), latents_history_mid=_randn(gen, 1, 4, 1, s, s),
                latents_history_long=_randn(gen, 1, 4, 4, s, s))


def _allegro():
    return _cls("AllegroTransformer3DModel")(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1,
        cross_attention_dim=16, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8)


def _kandinsky5():
    return _cls("Kandinsky5Transformer3DModel")(
        in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6), visual_cond=False,
        attention_type="regular")


def _kandinsky5_in(model, gen, v):
    (f, s), n = _pick(VID_P2, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, f, s, s, 4), encoder_hidden_states=_randn(gen, 1, n, 16),
                timestep=_t(gen), pooled_projections=_randn(gen, 1, 8),
                visual_rope_pos=[torch.arange(f), torch.arange(s // 2), torch.arange(s // 2)],
                text_rope_pos=torch.arange(n))


def _motif_video():
    return _cls("MotifVideoTransformer3DModel")(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12, num_layers=1,
        num_single_layers=1, num_decoder_layers=0, mlp_ratio=2.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
        norm_type="layer_norm", text_embed_dim=32, image_embed_dim=4, rope_theta=256.0, rope_axes_dim=(4, 4, 4),
        enable_text_cross_attention_dual=False, enable_text_cross_attention_single=False)


# --- audio models ----------------------------------------------------------------------------


def _ace_step():
    return _cls("AceStepTransformer1DModel")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2, rope_theta=10000.0, rms_norm_eps=1e-6,
        sliding_window=16)


def _ace_step_in(model, gen, v):
    t, n = _pick(AUDIO, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, t, 8), timestep=torch.rand(1, generator=gen),
                timestep_r=torch.rand(1, generator=gen), encoder_hidden_states=_randn(gen, 1, n, 32),
                context_latents=_randn(gen, 1, t, 16))


def _stable_audio():
    return _cls("StableAudioDiTModel")(
        sample_size=16, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        num_key_value_attention_heads=2, out_channels=4, cross_attention_dim=16, time_proj_dim=8,
        global_states_input_dim=8, cross_attention_input_dim=16)


def _stable_audio_in(model, gen, v):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    t, n = _pick(AUDIO, v), _pick(TXT, v)
    rope = get_1d_rotary_pos_embed(4, t + 1, use_real=True, repeat_interleave_real=False)  # +1: the global token
    return dict(hidden_states=_randn(gen, 1, 4, t), timestep=_t(gen), encoder_hidden_states=_randn(gen, 1, n, 16),
                global_hidden_states=_randn(gen, 1, 1, 8), rotary_embedding=rope)


def _stable_audio3():
    return _cls("StableAudio3DiTModel")(
        io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4, cond_token_dim=16, global_cond_dim=12,
        local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2, num_memory_tokens=3,
        use_differential_attention=False)


def _stable_audio3_in(model, gen, v):
    t, n = _pick(AUDIO, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, 8, t), timestep=torch.rand(1, generator=gen),
                encoder_hidden_states=_randn(gen, 1, n, 16), global_hidden_states=_randn(gen, 1, 12))


def _longcat_audio():
    return _cls("LongCatAudioDiTTransformer")(
        dit_dim=32, dit_depth=2, dit_heads=2, dit_text_dim=32, latent_dim=8, text_conv=False)


def _longcat_audio_in(model, gen, v):
    t, n = _pick(AUDIO, v), _pick(TXT, v)
    return dict(hidden_states=_randn(gen, 1, t, 8), encoder_hidden_states=_randn(gen, 1, n, 32),
                encoder_attention_mask=torch.ones(1, n, dtype=torch.bool),
                attention_mask=torch.ones(1, t, dtype=torch.bool), timestep=torch.rand(1, generator=gen))


def _minimax_music3():
    return _cls("MiniMaxMusic3Transformer1DModel")(
        in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=2, attention_head_dim=8, ff_inner_dim=32,
        rotary_dim=4, fourier_embedding_dim=8)


def _minimax_music3_in(model, gen, v):
    t = _pick(AUDIO, v)
    # the condition is frame-aligned with the latent (same length)
    return dict(hidden_states=_randn(gen, 1, 8, t), encoder_hidden_states=_randn(gen, 1, t, 16),
                timestep=torch.full((1,), 0.5))


# --- the table -------------------------------------------------------------------------------


def _bcfhw_mask(gen, f, s, n):
    return torch.ones(1, n)


_SPECS = [
    # name, class, kind, build, inputs
    ("auraflow", "AuraFlowTransformer2DModel", "image", _auraflow, _auraflow_in),
    ("bria", "BriaTransformer2DModel", "image", _bria, _flux_like_in(4, 32)),
    ("bria-fibo", "BriaFiboTransformer2DModel", "image", _bria_fibo, _bria_fibo_in),
    ("chroma", "ChromaTransformer2DModel", "image", _chroma, _flux_like_in(4, 32)),
    ("cogview3plus", "CogView3PlusTransformer2DModel", "image", _cogview3plus, _cogview_in),
    ("cogview4", "CogView4Transformer2DModel", "image", _cogview4, _cogview_in),
    ("dit", "DiTTransformer2DModel", "image", _dit, _dit_in),
    ("ernie-image", "ErnieImageTransformer2DModel", "image", _ernie_image, _ernie_image_in),
    ("flux", "FluxTransformer2DModel", "image", _flux, _flux_like_in(16, 32, pooled=32)),
    ("flux2", "Flux2Transformer2DModel", "image", _flux2, _flux2_in),
    ("glm-image", "GlmImageTransformer2DModel", "image", _glm_image, _glm_image_in),
    ("hidream", "HiDreamImageTransformer2DModel", "image", _hidream, _hidream_in),
    ("hunyuan-dit", "HunyuanDiT2DModel", "image", _hunyuan_dit, _hunyuan_dit_in),
    ("hunyuan-image", "HunyuanImageTransformer2DModel", "image", _hunyuan_image, _hunyuan_image_in),
    ("ideogram4", "Ideogram4Transformer2DModel", "image", _ideogram4, _ideogram4_in),
    ("krea2", "Krea2Transformer2DModel", "image", _krea2, _krea2_in),
    ("longcat-image", "LongCatImageTransformer2DModel", "image", _longcat_image,
     _flux_like_in(4, 32, guidance=True)),
    ("lumina2", "Lumina2Transformer2DModel", "image", _lumina2, _lumina2_in),
    ("nucleus-moe", "NucleusMoEImageTransformer2DModel", "image", _nucleus_moe,
     _qwen_like_in(16, 16, nested_shapes=False)),
    ("omnigen", "OmniGenTransformer2DModel", "image", _omnigen, _omnigen_in),
    ("ovis-image", "OvisImageTransformer2DModel", "image", _ovis_image, _flux_like_in(4, 32)),
    ("pixart", "PixArtTransformer2DModel", "image", _pixart, _pixart_in),
    ("prx", "PRXTransformer2DModel", "image", _prx, _prx_in),
    ("qwen-image", "QwenImageTransformer2DModel", "image", _qwen_image, _qwen_like_in(16, 32, nested_shapes=True)),
    ("sana", "SanaTransformer2DModel", "image", _sana, _sana_in),
    ("sd3", "SD3Transformer2DModel", "image", _sd3, _sd3_in),
    ("z-image", "ZImageTransformer2DModel", "image", _zimage, _zimage_in),
    ("allegro", "AllegroTransformer3DModel", "video", _allegro, _video_bcfhw_in(4, 8)),
    ("chronoedit", "ChronoEditTransformer3DModel", "video", _chronoedit, _video_bcfhw_in(4, 16)),
    ("cogvideox", "CogVideoXTransformer3DModel", "video", _cogvideox, _cogvideox_in),
    ("consisid", "ConsisIDTransformer3DModel", "video", _consisid, _consisid_in),
    ("cosmos", "CosmosTransformer3DModel", "video", _cosmos, _cosmos_in),
    ("easyanimate", "EasyAnimateTransformer3DModel", "video", _easyanimate, _video_bcfhw_in(4, 16)),
    ("helios", "HeliosTransformer3DModel", "video", _helios, _helios_in),
    ("hunyuan-video", "HunyuanVideoTransformer3DModel", "video", _hunyuan_video,
     _video_bcfhw_in(4, 16, patch1=True, encoder_attention_mask=_bcfhw_mask,
                     pooled_projections=lambda gen, f, s, n: _randn(gen, 1, 8),
                     guidance=lambda gen, f, s, n: torch.full((1,), 6.0))),
    ("hunyuan-video15", "HunyuanVideo15Transformer3DModel", "video", _hunyuan_video15,
     _video_bcfhw_in(4, 16, patch1=True, encoder_attention_mask=_bcfhw_mask,
                     encoder_hidden_states_2=lambda gen, f, s, n: _randn(gen, 1, 4, 8),
                     encoder_attention_mask_2=lambda gen, f, s, n: torch.ones(1, 4),
                     image_embeds=lambda gen, f, s, n: torch.zeros(1, 3, 12))),
    ("hunyuan-video-framepack", "HunyuanVideoFramepackTransformer3DModel", "video", _framepack, _framepack_in),
    ("kandinsky5", "Kandinsky5Transformer3DModel", "video", _kandinsky5, _kandinsky5_in),
    ("latte", "LatteTransformer3DModel", "video", _latte, _latte_in),
    ("ltx-video", "LTXVideoTransformer3DModel", "video", _ltx, _ltx_in),
    ("ltx2-video", "LTX2VideoTransformer3DModel", "video", _ltx2, _ltx2_in),
    ("mochi", "MochiTransformer3DModel", "video", _mochi,
     _video_bcfhw_in(4, 16, encoder_attention_mask=lambda gen, f, s, n: torch.ones(1, n, dtype=torch.bool))),
    ("motif-video", "MotifVideoTransformer3DModel", "video", _motif_video, _video_bcfhw_in(8, 32, patch1=True)),
    ("sana-video", "SanaVideoTransformer3DModel", "video", _sana_video, _video_bcfhw_in(4, 16)),
    ("skyreels-v2", "SkyReelsV2Transformer3DModel", "video", _skyreels_v2, _video_bcfhw_in(4, 16)),
    ("wan", "WanTransformer3DModel", "video", _wan, _video_bcfhw_in(4, 16)),
    ("wan-vace", "WanVACETransformer3DModel", "video", _wan_vace,
     _video_bcfhw_in(4, 16, control_hidden_states=lambda gen, f, s, n: _randn(gen, 1, 12, f, s, s))),
    ("ace-step", "AceStepTransformer1DModel", "audio", _ace_step, _ace_step_in),
    ("longcat-audio", "LongCatAudioDiTTransformer", "audio", _longcat_audio, _longcat_audio_in),
    ("minimax-music3", "MiniMaxMusic3Transformer1DModel", "audio", _minimax_music3, _minimax_music3_in),
    ("stable-audio", "StableAudioDiTModel", "audio", _stable_audio, _stable_audio_in),
    ("stable-audio3", "StableAudio3DiTModel", "audio", _stable_audio3, _stable_audio3_in),
]

# Measured at variant 0 with torch 2.13 / diffusers 0.42.1 (see the module docstring for the vocabulary).
# sdpa=N counts the SDPA call_function nodes Dynamo captures; it scales with the layer counts above.
NOTES: dict[str, str] = {
    "auraflow": "sdpa=2; self-attn-only; MMDiT joint text+image block and a single-stream block",
    "bria": "sdpa=2; self-attn-only; Flux-style joint attention",
    "bria-fibo": "sdpa=2; self-attn-only; Flux-style; text_encoder_layers gives one text state per block",
    "chroma": "sdpa=2; self-attn-only; Flux-style, no pooled projection",
    "cogview3plus": "sdpa=1; self-attn-only; joint text+image attention",
    "cogview4": "sdpa=1; self-attn-only; joint text+image attention",
    "dit": "sdpa=1; self-attn-only; class-conditional, no text",
    "ernie-image": "sdpa=1; self-attn-only; mask; single-stream text+image",
    "flux": "sdpa=2; self-attn-only; joint double-stream block and a single-stream block",
    "flux2": "sdpa=2; self-attn-only; 4-axis position ids, parallel single-stream block",
    "glm-image": "sdpa=1; self-attn-only; graphs=2; break: aten.nonzero (data-dependent shape)",
    "hidream": "sdpa=2; self-attn-only; graphs=21; breaks: MoE routing (aten.bincount, Tensor.item) in each MoE FFN "
               "and unpatchify",
    "hunyuan-dit": "sdpa=2; cross-attn; text lengths fixed by the config (text_len=4, text_len_t5=4), only the "
                   "image size varies; the text pooling attention is not SDPA",
    "hunyuan-image": "sdpa=3; self-attn-only; mask; token-refiner self-attention on text, then joint attention",
    "ideogram4": "sdpa=1; self-attn-only; mask; text and image tokens in one sequence (segment ids)",
    "krea2": "sdpa=3; self-attn-only; mask; kv heads repeated before SDPA; one SDPA has batch=text tokens and "
             "seq=text-encoder layers (3)",
    "longcat-image": "sdpa=2; self-attn-only; Flux-style",
    "lumina2": "sdpa=3; self-attn-only; mask; graphs=4; break: attention_mask.sum().tolist() (caption lengths)",
    "nucleus-moe": "sdpa=2; cross-attn; mask; image queries attend to image+text keys",
    "omnigen": "sdpa=2; self-attn-only; mask; graphs=4; break: data-dependent branch in the Phi-3 rope; no input "
               "image",
    "ovis-image": "sdpa=2; self-attn-only; Flux-style",
    "pixart": "sdpa=2; cross-attn",
    "prx": "sdpa=2; cross-attn; image queries attend to image+text keys",
    "qwen-image": "sdpa=1; self-attn-only; mask; joint double-stream attention",
    "sana": "sdpa=1; cross-attn; the self-attention is ReLU linear attention (no SDPA): only the cross-attention "
            "is SDPA",
    "sd3": "sdpa=1; self-attn-only; MMDiT joint attention",
    "z-image": "sdpa=3; self-attn-only; list inputs (x, cap_feats); noise and context refiners, then joint layer",
    "allegro": "sdpa=2; cross-attn",
    "chronoedit": "sdpa=2; cross-attn; Wan-style",
    "cogvideox": "sdpa=1; self-attn-only; joint text+video; text length fixed to max_text_seq_length (8)",
    "consisid": "sdpa=1; self-attn-only; CogVideoX-style, text length fixed (8); the face perceiver attentions "
                "compute softmax by hand (no SDPA)",
    "cosmos": "sdpa=2; cross-attn; mask; concat_padding_mask=False (True needs torchvision)",
    "easyanimate": "sdpa=1; self-attn-only; joint text+video attention",
    "helios": "sdpa=2; cross-attn; short/mid/long history latents joined to the self-attention sequence",
    "hunyuan-video": "sdpa=3; self-attn-only; mask; token refiner, double-stream and single-stream blocks",
    "hunyuan-video15": "sdpa=2; self-attn-only; mask; graphs=3; break: `if is_t2v` on a tensor; the ByT5 "
                       "projection is 2048 wide whatever the config (4.2M of the parameters)",
    "hunyuan-video-framepack": "sdpa=3; self-attn-only; mask; graphs=4; break: slicing by a data-dependent text "
                               "length",
    "kandinsky5": "sdpa=3; cross-attn; hidden_states channels-last (B, F, H, W, C)",
    "latte": "sdpa=3; cross-attn; temporal attention has batch=image tokens, seq=frames (2, fixed by "
             "video_length): only the image size varies",
    "ltx-video": "sdpa=2; cross-attn; mask",
    "ltx2-video": "sdpa=6; cross-attn; mask; audio+video: self, text cross and audio<->video cross attention",
    "mochi": "sdpa=1; cross-attn; mask; graphs=9; the joint attention loops over samples with torch.nonzero, so "
             "Dynamo skips that frame and its SDPA runs eagerly outside any graph; the one captured SDPA is the "
             "text attention pool (1 query)",
    "motif-video": "sdpa=2; self-attn-only",
    "sana-video": "sdpa=1; cross-attn; the self-attention is linear attention (no SDPA)",
    "skyreels-v2": "sdpa=2; cross-attn; Wan-style",
    "wan": "sdpa=2; cross-attn",
    "wan-vace": "sdpa=6; cross-attn; one VACE control block",
    "ace-step": "sdpa=4; cross-attn; mask; gqa (enable_gqa=True: 4 query heads, 2 kv heads); sliding-window mask",
    "longcat-audio": "sdpa=4; cross-attn; mask",
    "minimax-music3": "sdpa=2; self-attn-only; the condition is frame-aligned with the latent",
    "stable-audio": "sdpa=2; cross-attn; kv heads repeated before SDPA; a global token is prepended",
    "stable-audio3": "sdpa=4; cross-attn; 3 memory tokens prepended",
}

ZOO: dict[str, ZooEntry] = {s[0]: ZooEntry(*s, notes=NOTES[s[0]]) for s in _SPECS}


def names(kind: str | None = None) -> list[str]:
    """Entry names, optionally only those of one kind ("image", "video", "audio")."""
    return [n for n, e in ZOO.items() if kind is None or e.kind == kind]


def _entry(name: str) -> ZooEntry:
    key = normalize_name(name)
    key = ALIASES.get(key, key)  # the families' alias table: one set of names
    try:
        return ZOO[key]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}: expected one of {', '.join(ZOO)}") from None


def _to_dtype(model: torch.nn.Module, dtype) -> torch.nn.Module:
    """model.to(dtype), keeping the class's `_keep_in_fp32_modules` in float32 as from_pretrained does."""
    model = model.to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for pname, param in list(model.named_parameters()) + list(model.named_buffers()):
        if param.is_floating_point() and any(k in pname.split(".") for k in keep):
            param.data = param.data.float()
    return model


def _reinit_zero_layers(model: torch.nn.Module) -> None:
    """Diffusers zero-initialises output layers (adaLN-zero modulation, final projections): with
    random weights elsewhere the model's output then ignores them, or is 0, and hides any error
    made there. Such layers get their default random initialisation instead."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) \
                and weight is not None and weight.numel() > 1 and not weight.detach().any():
            module.reset_parameters()


def build(name: str, *, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    """The tiny random model `name`, seeded by `seed`, in eval mode. Zero-initialised linear and
    convolution layers are re-initialised at random so that every layer affects the output.

    With a `dtype` other than float32 the model is cast like `from_pretrained(torch_dtype=dtype)`
    does: the modules in the class's `_keep_in_fp32_modules` stay float32.
    """
    entry = _entry(name)
    from diffusers.utils import logging as dlogging

    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # silence "modules that should be kept in float32" on .to(dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = entry.build()
                _reinit_zero_layers(model)
            if dtype != torch.float32:
                model = _to_dtype(model, dtype)
    finally:
        dlogging.set_verbosity(verbosity)
    return model.eval()


_KEEP_FLOAT32 = ("ids", "indices", "rope", "rotary", "coords", "size")  # keyword parts left in float32


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def make_inputs(name: str, model, *, seed: int = 0, variant: int = 0, dtype=torch.float32) -> dict:
    """Forward kwargs for `model` (built by build(name)) at size `variant` (0..3, 0 the fewest tokens).

    Random tensors come from a torch.Generator seeded by `seed` only. Floating tensors are cast to
    `dtype`, except position ids, rotary tables, sizes and coordinates, which stay float32.
    """
    entry = _entry(name)
    gen = torch.Generator().manual_seed(seed)
    kwargs = entry.inputs(model, gen, variant)
    if dtype != torch.float32:
        kwargs = {k: v if any(p in k for p in _KEEP_FLOAT32) else _cast(v, dtype) for k, v in kwargs.items()}
    return kwargs
