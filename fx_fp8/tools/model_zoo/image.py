"""Image transformers of the zoo (the families flux, qwen-image, sd3 and z-image are in families.py)."""

from __future__ import annotations

import torch

from fx_fp8.tools.model_zoo.entry import TinyModel
from fx_fp8.tools.model_zoo.inputs import SIDE_P1, SIDE_P2, TXT, flux_like_in, pick, rand_t, randn


def _auraflow_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(hidden_states=randn(gen, 1, 4, s, s), encoder_hidden_states=randn(gen, 1, n, 32), timestep=rand_t(gen))


def _bria_fibo_in(model, gen, v):
    kw = flux_like_in(16, 32)(model, gen, v)
    n = kw["encoder_hidden_states"].shape[1]
    # one text-encoder layer per transformer block (double + single)
    kw["text_encoder_layers"] = [randn(gen, 1, n, 16) for _ in range(2)]
    return kw


def _bria_fibo2_in(model, gen, v):
    """encoder_hidden_states: (batch, 1 + injection blocks, text tokens, features): the Perceiver's bundle first."""
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=randn(gen, 1, 2, n, 16),
    )


def _flux2_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(s), torch.arange(s), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(n))
    return dict(
        hidden_states=randn(gen, 1, s * s, 8),
        encoder_hidden_states=randn(gen, 1, n, 32),
        img_ids=img_ids[None],
        txt_ids=txt_ids[None],
        timestep=torch.rand(1, generator=gen),
        guidance=torch.full((1,), 3.5),
    )


def _flux3_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(s), torch.arange(s), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(n))
    return dict(
        hidden_states=randn(gen, 1, s * s, 16),
        encoder_hidden_states=randn(gen, 1, n, 32),
        timestep=torch.rand(1, generator=gen),
        img_ids=img_ids,
        txt_ids=txt_ids,
    )


def _qwen_image21_in(model, gen, v):
    """Text to image: the encoder's sequence is the text tokens, then one image slot per 2x2 latent tokens."""
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    img_mask = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(s * s // 4, dtype=torch.bool)])[None]
    return dict(
        hidden_states=randn(gen, 1, s * s, 16),
        encoder_hidden_states=randn(gen, 1, n, 32),
        timestep=torch.rand(1, generator=gen),
        img_shapes=[[(1, s, s)]],
        img_mask=img_mask,
        encoder_hidden_states_mask=torch.ones(1, n, dtype=torch.bool),
    )


def _cogview_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    size = torch.tensor([[s * 8, s * 8]], dtype=torch.float32)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        encoder_hidden_states=randn(gen, 1, n, 8),
        timestep=rand_t(gen),
        original_size=size,
        target_size=size.clone(),
        crop_coords=torch.zeros(1, 2),
    )


def _dit_in(model, gen, v):
    s = pick(SIDE_P2, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=rand_t(gen),
        class_labels=torch.randint(0, 4, (1,), generator=gen),
    )


def _hidream_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timesteps=rand_t(gen),
        encoder_hidden_states_t5=randn(gen, 1, n, 8),
        encoder_hidden_states_llama3=randn(gen, 2, 1, n, 4),  # (llama layers, batch, tokens, dim)
        pooled_embeds=randn(gen, 1, 8),
    )


def _hunyuan_image_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 32),
        encoder_attention_mask=torch.ones(1, n),
    )


def _hunyuan_dit_in(model, gen, v):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    s = pick(SIDE_P2, v)
    grid = s // 2
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (grid, grid)), (grid, grid))
    # the text lengths are fixed by the config (text_len, text_len_t5): the image size varies
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, 4, 8),
        text_embedding_mask=torch.ones(1, 4),
        encoder_hidden_states_t5=randn(gen, 1, 4, 8),
        text_embedding_mask_t5=torch.ones(1, 4),
        image_meta_size=torch.tensor([[1024.0, 1024.0, s * 8, s * 8, 0.0, 0.0]]),
        style=torch.zeros(1, dtype=torch.long),
        image_rotary_emb=rope,
    )


def _unet_transformer_in(model, gen, v):
    """The UNet-block transformers: a (batch, channels, height, width) feature map, text states to cross-attend."""
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(hidden_states=randn(gen, 1, 4, s, s), encoder_hidden_states=randn(gen, 1, n, 16), timestep=rand_t(gen))


def _lumina_next_in(model, gen, v):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    s, n = pick(SIDE_P2, v), pick(TXT, v)
    # the pipeline's table: head_dim x 384 x 384 positions, the model slices what the image needs
    rope = get_2d_rotary_pos_embed_lumina(model.head_dim, 32, 32)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        encoder_mask=torch.ones(1, n, dtype=torch.bool),
        image_rotary_emb=rope,
        cross_attention_kwargs={},
    )  # its default None fails: ** of None


def _prior_in(model, gen, v):
    """Kandinsky / unCLIP prior: the token count is fixed by the config (num_embeddings), so the variants grow the
    batch (1..4)."""
    b = v + 1
    return dict(
        hidden_states=randn(gen, b, 16),
        timestep=rand_t(gen),
        proj_embedding=randn(gen, b, 16),
        encoder_hidden_states=randn(gen, b, 4, 16),
        attention_mask=torch.ones(b, 4, dtype=torch.bool),
        return_dict=False,
    )  # its output class has no `sample`: the tuple's first item is the embedding


def _hunyuan_dit_controlnet_in(model, gen, v):
    """HunyuanDiT's inputs plus the control image's latents; the output is one residual per controlnet block."""
    kw = _hunyuan_dit_in(model, gen, v)
    kw.update(controlnet_cond=randn(gen, *kw["hidden_states"].shape), return_dict=False)
    return kw


def _lumina2_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=randn(gen, 1, n, 32),
        encoder_attention_mask=torch.ones(1, n, dtype=torch.bool),
    )


def _nucleus_moe_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, s * s, 16),
        encoder_hidden_states=randn(gen, 1, n, 16),
        encoder_hidden_states_mask=torch.ones(1, n, dtype=torch.long),
        timestep=torch.rand(1, generator=gen),
        img_shapes=[(1, s, s)],
    )


def _omnigen_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    seq = n + 1 + (s // 2) ** 2  # text tokens, the time token, the output image tokens
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        timestep=torch.rand(1, generator=gen),
        input_ids=torch.randint(1, 100, (1, n), generator=gen),
        input_img_latents=[],
        input_image_sizes={},
        attention_mask=torch.ones(1, seq, seq),
        position_ids=torch.arange(seq)[None],
    )


def _prx_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        encoder_hidden_states=randn(gen, 1, n, 32),
        timestep=torch.rand(1, generator=gen),
    )


def _pixart_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        encoder_hidden_states=randn(gen, 1, n, 16),
        timestep=rand_t(gen),
        added_cond_kwargs={"aspect_ratio": None, "resolution": None},
    )


def _sana_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    return dict(hidden_states=randn(gen, 1, 4, s, s), encoder_hidden_states=randn(gen, 1, n, 8), timestep=rand_t(gen))


def _glm_image_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    tokens = (s // 2) ** 2  # one prior token per image token
    return dict(
        hidden_states=randn(gen, 1, 4, s, s),
        encoder_hidden_states=randn(gen, 1, n, 32),
        prior_token_id=torch.randint(0, 64, (1, tokens), generator=gen),
        prior_token_drop=torch.zeros(1, tokens, dtype=torch.bool),
        timestep=rand_t(gen),
        target_size=torch.tensor([[s * 8.0, s * 8.0]]),
        crop_coords=torch.zeros(1, 2),
    )


def _ernie_image_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 16, s, s),
        timestep=torch.ones(1),
        text_bth=randn(gen, 1, n, 16),
        text_lens=torch.tensor([n]),
    )


def _ideogram4_in(model, gen, v):
    from diffusers.models.transformers import transformer_ideogram4 as m

    s, n = pick(SIDE_P1, v), pick(TXT, v)
    img = s * s
    seq = n + img
    hidden = torch.zeros(1, seq, 16)
    hidden[:, n:] = randn(gen, 1, img, 16)
    text = torch.zeros(1, seq, 24)
    text[:, :n] = randn(gen, 1, n, 24)
    pos = torch.zeros(1, seq, 3, dtype=torch.long)
    pos[0, :n] = torch.arange(n)[:, None]
    rows, cols = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    pos[0, n:, 0] = m.IMAGE_POSITION_OFFSET
    pos[0, n:, 1] = rows.reshape(-1) + m.IMAGE_POSITION_OFFSET
    pos[0, n:, 2] = cols.reshape(-1) + m.IMAGE_POSITION_OFFSET
    indicator = torch.full((1, seq), m.OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :n] = m.LLM_TOKEN_INDICATOR
    return dict(
        hidden_states=hidden,
        encoder_hidden_states=text,
        timestep=torch.full((1,), 0.5),
        position_ids=pos,
        segment_ids=torch.ones(1, seq, dtype=torch.long),
        indicator=indicator,
    )


def _joyimage_edit_in(model, gen, v):
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, 1, s, s), timestep=rand_t(gen), encoder_hidden_states=randn(gen, 1, n, 32)
    )


def _joyimage_edit_plus_in(model, gen, v):
    """The latents come cut into (1, 2, 2) patches: (batch, patches, channels, 1, 2, 2); shape_list gives the grid."""
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, s * s, 4, 1, 2, 2),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 32),
        encoder_hidden_states_mask=torch.ones(1, n, dtype=torch.long),
        shape_list=[[(1, s, s)]],
    )


def _krea2_in(model, gen, v):
    s, n = pick(SIDE_P1, v), pick(TXT, v)
    pos = torch.zeros(n + s * s, 3)
    pos[n:, 1] = torch.arange(s).repeat_interleave(s)
    pos[n:, 2] = torch.arange(s).repeat(s)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[:, -1] = False  # one padded text token
    return dict(
        hidden_states=randn(gen, 1, s * s, 16),
        encoder_hidden_states=randn(gen, 1, n, 3, 16),
        timestep=torch.full((1,), 0.5),
        position_ids=pos,
        encoder_attention_mask=mask,
    )


# One flux-style double + single block: the Flux derivatives below differ in embedders and inputs.
_FLUX_LIKE = dict(
    patch_size=1,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
)

IMAGE = [
    TinyModel(
        "auraflow",
        "AuraFlowTransformer2DModel",
        "image",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=1,
            num_single_dit_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            caption_projection_dim=32,
            joint_attention_dim=32,
            out_channels=4,
            pos_embed_max_size=128,
        ),
        _auraflow_in,
        "sdpa=2; self-attn-only; MMDiT joint text+image block and a single-stream block",
    ),
    TinyModel(
        "bria",
        "BriaTransformer2DModel",
        "image",
        dict(_FLUX_LIKE, in_channels=4, pooled_projection_dim=None, axes_dims_rope=[0, 8, 8]),
        flux_like_in(4, 32),
        "sdpa=2; self-attn-only; Flux-style joint attention",
    ),
    TinyModel(
        "bria-fibo",
        "BriaFiboTransformer2DModel",
        "image",
        dict(_FLUX_LIKE, in_channels=16, text_encoder_dim=16, pooled_projection_dim=None, axes_dims_rope=[0, 8, 8]),
        _bria_fibo_in,
        "sdpa=2; self-attn-only; Flux-style; text_encoder_layers gives one text state per block",
    ),
    TinyModel(
        "bria-fibo2",
        "BriaFibo2Transformer2DModel",
        "image",
        dict(
            in_channels=4,
            patch_size=2,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            cap_feat_dim=16,
            injection_layer_ids=(1,),
            perceiver_num_layers=1,
            min_num_gist_tokens=4,
            max_num_gist_tokens=8,
            gist_step=4,
            gist_min_text_len=4,
            gist_max_text_len=16,
            axes_dims=(4, 6, 6),
            axes_lens=(32, 16, 16),
        ),
        _bria_fibo2_in,
        "sdpa=6; cross-attn; a Perceiver turns the text into gist tokens; one text bundle per injection block",
    ),
    TinyModel(
        "chroma",
        "ChromaTransformer2DModel",
        "image",
        dict(
            _FLUX_LIKE,
            in_channels=4,
            axes_dims_rope=[4, 4, 8],
            approximator_num_channels=8,
            approximator_hidden_dim=16,
            approximator_layers=1,
        ),
        flux_like_in(4, 32),
        "sdpa=2; self-attn-only; Flux-style, no pooled projection",
    ),
    TinyModel(
        "cogview3plus",
        "CogView3PlusTransformer2DModel",
        "image",
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=8,
            time_embed_dim=8,
            condition_dim=2,
            pos_embed_max_size=16,
            sample_size=16,
        ),
        _cogview_in,
        "sdpa=1; self-attn-only; joint text+image attention",
    ),
    TinyModel(
        "cogview4",
        "CogView4Transformer2DModel",
        "image",
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=8,
            time_embed_dim=8,
            condition_dim=4,
        ),
        _cogview_in,
        "sdpa=1; self-attn-only; joint text+image attention",
    ),
    TinyModel(
        "dit",
        "DiTTransformer2DModel",
        "image",
        dict(
            in_channels=4,
            out_channels=8,
            activation_fn="gelu-approximate",
            num_attention_heads=2,
            attention_head_dim=8,
            attention_bias=True,
            num_layers=1,
            norm_type="ada_norm_zero",
            num_embeds_ada_norm=8,
            patch_size=2,
            sample_size=8,
        ),
        _dit_in,
        "sdpa=1; self-attn-only; class-conditional, no text",
    ),
    TinyModel(
        "dreamlite",
        "DreamLiteTransformer2DModel",
        "image",
        dict(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            norm_num_groups=2,
            cross_attention_dim=16,
            ff_mult=2,
        ),
        _unet_transformer_in,
        "sdpa=2; cross-attn; UNet-style spatial transformer (GroupNorm, continuous (B, C, H, W) input)",
    ),
    TinyModel(
        "ernie-image",
        "ErnieImageTransformer2DModel",
        "image",
        dict(
            hidden_size=32,
            num_attention_heads=2,
            num_layers=1,
            ffn_hidden_size=32,
            in_channels=16,
            out_channels=16,
            patch_size=1,
            text_in_dim=16,
            rope_theta=256,
            rope_axes_dim=(8, 4, 4),
            eps=1e-6,
            qk_layernorm=True,
        ),
        _ernie_image_in,
        "sdpa=1; self-attn-only; mask; single-stream text+image",
    ),
    TinyModel(
        "flux2",
        "Flux2Transformer2DModel",
        "image",
        dict(_FLUX_LIKE, in_channels=8, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4]),
        _flux2_in,
        "sdpa=2; self-attn-only; 4-axis position ids, parallel single-stream block",
    ),
    TinyModel(
        "flux3",
        "Flux3Transformer2DModel",
        "image",
        dict(
            in_channels=16,
            cond_in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            timestep_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
        ),
        _flux3_in,
        "sdpa=3; self-attn-only; per-mode text and image blocks, then joint single-stream blocks",
    ),
    TinyModel(
        "glm-image",
        "GlmImageTransformer2DModel",
        "image",
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            text_embed_dim=32,
            time_embed_dim=16,
            condition_dim=8,
            prior_vq_quantizer_codebook_size=64,
        ),
        _glm_image_in,
        "sdpa=1; self-attn-only; graphs=2; break: aten.nonzero (data-dependent shape)",
    ),
    TinyModel(
        "hidream",
        "HiDreamImageTransformer2DModel",
        "image",
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_channels=[8, 4],
            text_emb_dim=8,
            num_routed_experts=2,
            num_activated_experts=2,
            axes_dims_rope=(4, 2, 2),
            max_resolution=(32, 32),
            llama_layers=(0, 1),
            force_inference_output=True,
        ),
        _hidream_in,
        "sdpa=2; self-attn-only; graphs=21; breaks: MoE routing (aten.bincount, Tensor.item) in "
        "each MoE FFN and unpatchify",
    ),
    TinyModel(
        "hunyuan-dit",
        "HunyuanDiT2DModel",
        "image",
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            cross_attention_dim=8,
            cross_attention_dim_t5=8,
            pooled_projection_dim=4,
            hidden_size=16,
            text_len=4,
            text_len_t5=4,
            activation_fn="gelu-approximate",
        ),
        _hunyuan_dit_in,
        "sdpa=2; cross-attn; text lengths fixed by the config (text_len=4, text_len_t5=4), "
        "only the image size varies; the text pooling attention is not SDPA",
    ),
    TinyModel(
        "hunyuan-dit-controlnet",
        "HunyuanDiT2DControlNetModel",
        "image",
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            transformer_num_layers=4,
            attention_head_dim=8,
            num_attention_heads=2,
            cross_attention_dim=8,
            cross_attention_dim_t5=8,
            pooled_projection_dim=4,
            hidden_size=16,
            text_len=4,
            text_len_t5=4,
        ),
        _hunyuan_dit_controlnet_in,
        "sdpa=2; cross-attn; a ControlNet: the output stacks its blocks' residuals; "
        "text lengths fixed by the config as in hunyuan-dit",
    ),
    TinyModel(
        "hunyuan-image",
        "HunyuanImageTransformer2DModel",
        "image",
        # a text_embed_2_dim adds a 2048-wide ByT5 projection
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=(1, 1),
            guidance_embeds=False,
            text_embed_dim=32,
            text_embed_2_dim=None,
            rope_axes_dim=(4, 4),
        ),
        _hunyuan_image_in,
        "sdpa=3; self-attn-only; mask; token-refiner self-attention on text, then joint attention",
    ),
    TinyModel(
        "ideogram4",
        "Ideogram4Transformer2DModel",
        "image",
        dict(
            in_channels=16,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            intermediate_size=32,
            adaln_dim=16,
            llm_features_dim=24,
            rope_theta=10_000,
            mrope_section=(2, 1, 1),
            norm_eps=1e-5,
        ),
        _ideogram4_in,
        "sdpa=1; self-attn-only; mask; text and image tokens in one sequence (segment ids)",
    ),
    TinyModel(
        "joyimage-edit",
        "JoyImageEditTransformer3DModel",
        "image",
        dict(
            patch_size=[1, 2, 2],
            in_channels=4,
            hidden_size=32,
            num_attention_heads=2,
            text_dim=32,
            mlp_width_ratio=2.0,
            num_layers=1,
            rope_dim_list=[4, 6, 6],
        ),
        _joyimage_edit_in,
        "sdpa=1; self-attn-only; joint text+image attention",
    ),
    TinyModel(
        "joyimage-edit-plus",
        "JoyImageEditPlusTransformer3DModel",
        "image",
        dict(
            patch_size=[1, 2, 2],
            in_channels=4,
            hidden_size=32,
            num_attention_heads=2,
            text_dim=32,
            mlp_width_ratio=2.0,
            num_layers=1,
            rope_dim_list=[4, 6, 6],
        ),
        _joyimage_edit_plus_in,
        "sdpa=1; self-attn-only; mask; joint text+image attention",
    ),
    TinyModel(
        "krea2",
        "Krea2Transformer2DModel",
        "image",
        dict(
            in_channels=16,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            timestep_embed_dim=8,
            text_hidden_dim=16,
            num_text_layers=3,
            text_num_attention_heads=2,
            text_num_key_value_heads=1,
            text_intermediate_size=16,
            num_layerwise_text_blocks=1,
            num_refiner_text_blocks=1,
            axes_dims_rope=(4, 2, 2),
            rope_theta=1000.0,
            norm_eps=1e-5,
        ),
        _krea2_in,
        "sdpa=3; self-attn-only; mask; kv heads repeated before SDPA; one SDPA has batch=text "
        "tokens and seq=text-encoder layers (3)",
    ),
    TinyModel(
        "longcat-image",
        "LongCatImageTransformer2DModel",
        "image",
        dict(_FLUX_LIKE, in_channels=4, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]),
        flux_like_in(4, 32, guidance=True),
        "sdpa=2; self-attn-only; Flux-style",
    ),
    TinyModel(
        "lumina2",
        "Lumina2Transformer2DModel",
        "image",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            hidden_size=24,
            num_layers=1,
            num_refiner_layers=1,
            num_attention_heads=3,
            num_kv_heads=1,
            multiple_of=2,
            ffn_dim_multiplier=None,
            norm_eps=1e-5,
            scaling_factor=1.0,
            axes_dim_rope=(4, 2, 2),
            axes_lens=(128, 128, 128),
            cap_feat_dim=32,
        ),
        _lumina2_in,
        "sdpa=3; self-attn-only; mask; graphs=4; break: attention_mask.sum().tolist() (caption lengths)",
    ),
    TinyModel(
        "lumina-next",
        "LuminaNextDiT2DModel",
        "image",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            hidden_size=32,
            num_layers=1,
            num_attention_heads=2,
            num_kv_heads=1,
            multiple_of=16,
            norm_eps=1e-5,
            learn_sigma=True,
            qk_norm=True,
            cross_attention_dim=16,
        ),
        _lumina_next_in,
        "sdpa=2; cross-attn; mask; kv heads repeated before SDPA; the rotary table is an input (image_rotary_emb)",
        uninitialised=("pad_token",),
    ),
    TinyModel(
        "nucleus-moe",
        "NucleusMoEImageTransformer2DModel",
        "image",
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=16,
            axes_dims_rope=(8, 4, 4),
            moe_enabled=False,
            capacity_factors=[8.0, 8.0],
        ),
        _nucleus_moe_in,
        "sdpa=2; cross-attn; mask; image queries attend to image+text keys",
    ),
    TinyModel(
        "omnigen",
        "OmniGenTransformer2DModel",
        "image",
        dict(
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            num_layers=2,
            pad_token_id=0,
            vocab_size=100,
            in_channels=4,
            time_step_dim=16,
            rope_scaling={"long_factor": list(range(1, 9)), "short_factor": list(range(1, 9))},
        ),
        _omnigen_in,
        "sdpa=2; self-attn-only; mask; graphs=4; break: data-dependent branch in the Phi-3 rope; no input image",
    ),
    TinyModel(
        "ovis-image",
        "OvisImageTransformer2DModel",
        "image",
        dict(_FLUX_LIKE, in_channels=4, out_channels=4, axes_dims_rope=(4, 4, 8)),
        flux_like_in(4, 32),
        "sdpa=2; self-attn-only; Flux-style",
    ),
    TinyModel(
        "pixart",
        "PixArtTransformer2DModel",
        "image",
        dict(
            sample_size=8,
            num_layers=1,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=2,
            in_channels=4,
            cross_attention_dim=16,
            out_channels=8,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            use_additional_conditions=False,
            caption_channels=16,
        ),
        _pixart_in,
        "sdpa=2; cross-attn",
    ),
    TinyModel(
        "prior",
        "PriorTransformer",
        "image",
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            embedding_dim=16,
            num_embeddings=4,
            additional_embeddings=4,
        ),
        _prior_in,
        "sdpa=1; self-attn-only; mask; unCLIP prior (causal mask); tokens fixed by the config "
        "(num_embeddings), the variants grow the batch",
    ),
    TinyModel(
        "prx",
        "PRXTransformer2DModel",
        "image",
        dict(
            in_channels=4,
            patch_size=2,
            context_in_dim=32,
            hidden_size=32,
            mlp_ratio=2.0,
            num_heads=2,
            depth=2,
            axes_dim=[8, 8],
            theta=10_000,
        ),
        _prx_in,
        "sdpa=2; cross-attn; image queries attend to image+text keys",
    ),
    TinyModel(
        "qwen-image21",
        "QwenImage21Transformer2DModel",
        "image",
        dict(
            patch_size=1,
            in_channels=16,
            out_channels=16,
            num_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=32,
            mlp_ratio=2,
            axes_dims_rope=(4, 6, 6),
        ),
        _qwen_image21_in,
        "sdpa=2; cross-attn; mask; graphs=11; breaks: the block-causal token bookkeeping "
        "(nonzero, int() of a sum, tolist() of the segments); one SDPA per causal segment "
        "(text, then image tokens over text+image)",
    ),
    TinyModel(
        "transformer-2d",
        "Transformer2DModel",
        "image",
        dict(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            num_layers=1,
            norm_num_groups=2,
            cross_attention_dim=16,
        ),
        _unet_transformer_in,
        "sdpa=2; cross-attn; the UNet blocks' spatial transformer (continuous input)",
    ),
    TinyModel(
        "sana",
        "SanaTransformer2DModel",
        "image",
        dict(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            num_cross_attention_heads=2,
            cross_attention_head_dim=8,
            cross_attention_dim=16,
            caption_channels=8,
            sample_size=16,
        ),
        _sana_in,
        "sdpa=1; cross-attn; the self-attention is ReLU linear attention (no SDPA): only the cross-attention is SDPA",
    ),
]
