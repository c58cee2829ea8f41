"""Video transformers of the zoo (the family wan is in families.py)."""

from __future__ import annotations

import torch

from fx_fp8.tools.model_zoo.entry import TinyModel
from fx_fp8.tools.model_zoo.inputs import SIDE_P2, TXT, VID_P1, VID_P2, pick, rand_t, randn, video_bcfhw_in


def _anyflow_in(model, gen, v):
    """hidden_states is (batch, frames, channels, height, width); timesteps are per frame, r_timestep the one
    each frame jumps to."""
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    t = torch.randint(1, 1000, (1, f), generator=gen).float()
    return dict(
        hidden_states=randn(gen, 1, f, 4, s, s),
        timestep=t,
        r_timestep=t * 0.5,
        encoder_hidden_states=randn(gen, 1, n, 16),
    )


def _anyflow_far_in(model, gen, v):
    """The causal rollout (no KV cache): per-frame timesteps, one frame per chunk."""
    kw = _anyflow_in(model, gen, v)
    kw["chunk_partition"] = [1] * kw["timestep"].shape[1]
    return kw


def _cogvideox_in(model, gen, v):
    f, s = pick(VID_P2, v)
    # the text length is fixed to max_text_seq_length by the positional embedding
    return dict(
        hidden_states=randn(gen, 1, f, 4, s, s), encoder_hidden_states=randn(gen, 1, 8, 8), timestep=rand_t(gen)
    )


def _consisid_in(model, gen, v):
    kw = _cogvideox_in(model, gen, v)
    kw.update(id_vit_hidden=[randn(gen, 1, 2, 8)], id_cond=randn(gen, 1, 8))
    return kw


def _cosmos3_in(model, gen, v):
    """One packed sequence: the text prefix (causal, und_len tokens), then one video's (2, 2) patches; mRoPE
    positions (t, h, w) per token; every frame noisy."""
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    g = s // 2
    seq = n + f * g * g
    t, h, w = torch.meshgrid(torch.arange(f), torch.arange(g), torch.arange(g), indexing="ij")
    pos = torch.zeros(3, seq, dtype=torch.long)
    pos[:, :n] = torch.arange(n)
    pos[:, n:] = torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)]) + n
    return dict(
        input_ids=torch.randint(0, 100, (n,), generator=gen),
        text_indexes=torch.arange(n),
        position_ids=pos,
        und_len=n,
        sequence_length=seq,
        vision_tokens=[randn(gen, 1, 4, f, s, s)],
        vision_token_shapes=[(f, g, g)],
        vision_sequence_indexes=torch.arange(n, seq),
        vision_mse_loss_indexes=torch.arange(n, seq),
        vision_timesteps=torch.full((seq - n,), 0.5),
        vision_noisy_frame_indexes=[torch.arange(f)],
    )


def _cosmos_in(model, gen, v):
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, f, s, s),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        attention_mask=torch.ones(1, n),
        fps=30,
    )


def _minimax_h3_in(model, gen, v):
    """One packed sequence: text rows, then video rows ((1, 2, 2) patches), then audio rows, one timestep."""
    (f, s), n = pick(VID_P1, v), pick(TXT, v)
    video, audio = f * s * s, 2 * f
    seq = n + video + audio
    t, h, w = torch.meshgrid(torch.arange(f), torch.arange(s), torch.arange(s), indexing="ij")
    pos = torch.zeros(seq, 3, dtype=torch.long)
    pos[:n, 0] = torch.arange(n)
    pos[n : n + video] = torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)], dim=-1)
    pos[n + video :, 0] = torch.arange(audio)
    tags = torch.cat([torch.full((n,), 1), torch.zeros(video, dtype=torch.long), torch.full((audio,), 2)])
    return dict(
        hidden_states=randn(gen, 1, video, 16),
        audio_hidden_states=randn(gen, 1, audio, 8),
        encoder_hidden_states=randn(gen, 1, n, 16),
        timestep=torch.rand(1, generator=gen),
        timestep_indices=torch.zeros(seq, dtype=torch.long),
        token_tags=tags,
        position_ids=pos,
        video_indices=torch.arange(n, n + video),
        audio_indices=torch.arange(n + video, seq),
        text_indices=torch.arange(n),
    )


def _temporal_in(model, gen, v):
    """UNet temporal attention: frames stacked in the batch, attention over frames at each pixel."""
    f, s = pick(VID_P2, v)
    return dict(hidden_states=randn(gen, f, 4, s, s), num_frames=f)


def _text_mask(gen, f, s, n):
    return torch.ones(1, n)


FRAMEPACK = ((1, 4), (2, 4), (2, 8), (3, 8))  # (frames, side): the 4x history embedder patches 8x8


def _framepack_in(model, gen, v):
    (f, s), n = pick(FRAMEPACK, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, f, s, s),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        encoder_attention_mask=torch.ones(1, n),
        pooled_projections=randn(gen, 1, 8),
        guidance=torch.full((1,), 6.0),
        image_embeds=randn(gen, 1, 4, 16),
        indices_latents=torch.arange(f, dtype=torch.float32) + 3,
        latents_clean=randn(gen, 1, 4, 1, s, s),
        indices_latents_clean=torch.zeros(1),
        latents_history_2x=randn(gen, 1, 4, 2, s, s),
        indices_latents_history_2x=torch.tensor([1.0, 2.0]),
        latents_history_4x=randn(gen, 1, 4, 4, s, s),
        indices_latents_history_4x=torch.arange(4, dtype=torch.float32) + f + 3,
    )


def _ltx_in(model, gen, v):
    (f, s), n = pick(VID_P1, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, f * s * s, 4),
        encoder_hidden_states=randn(gen, 1, n, 16),
        timestep=rand_t(gen),
        encoder_attention_mask=torch.ones(1, n, dtype=torch.bool),
        num_frames=f,
        height=s,
        width=s,
    )


def _ltx2_in(model, gen, v):
    (f, s), n, a = pick(VID_P1, v), pick(TXT, v), pick((5, 9, 13, 17), v)
    return dict(
        hidden_states=randn(gen, 1, f * s * s, 4),
        audio_hidden_states=randn(gen, 1, a, 4),
        encoder_hidden_states=randn(gen, 1, n, 16),
        audio_encoder_hidden_states=randn(gen, 1, n, 16),
        timestep=rand_t(gen),
        encoder_attention_mask=torch.ones(1, n, dtype=torch.bool),
        num_frames=f,
        height=s,
        width=s,
        audio_num_frames=a,
        fps=25.0,
    )


def _latte_in(model, gen, v):
    # the temporal position embedding fixes the frame count to video_length: only the image size varies
    s, n = pick(SIDE_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, 2, s, s),
        encoder_hidden_states=randn(gen, 1, n, 8),
        timestep=rand_t(gen),
        enable_temporal_attentions=True,
    )


def _helios_in(model, gen, v):
    (f, s), n = pick(((1, 8), (2, 8), (2, 16), (3, 16)), v), pick(TXT, v)  # the long history patches 8x8 (4x)
    return dict(
        hidden_states=randn(gen, 1, 4, f, s, s),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        indices_hidden_states=torch.arange(f, dtype=torch.float32)[None] + 6,
        indices_latents_history_short=torch.ones(1, 1),
        indices_latents_history_mid=torch.ones(1, 1) * 2,
        indices_latents_history_long=torch.arange(4, dtype=torch.float32)[None] + 2,
        latents_history_short=randn(gen, 1, 4, 1, s, s),
        latents_history_mid=randn(gen, 1, 4, 1, s, s),
        latents_history_long=randn(gen, 1, 4, 4, s, s),
    )


def _kandinsky5_in(model, gen, v):
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, f, s, s, 4),
        encoder_hidden_states=randn(gen, 1, n, 16),
        timestep=rand_t(gen),
        pooled_projections=randn(gen, 1, 8),
        visual_rope_pos=[torch.arange(f), torch.arange(s // 2), torch.arange(s // 2)],
        text_rope_pos=torch.arange(n),
    )


def _kandinsky6_in(model, gen, v):
    """Channels-last video (B, F, H, W, C) and audio latents of 2 frames per video frame."""
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, f, s, s, 4),
        encoder_hidden_states=randn(gen, 1, n, 16),
        pooled_projections=randn(gen, 1, 8),
        timestep=rand_t(gen),
        audio_hidden_states=randn(gen, 1, 2 * f, 4),
    )


def _kandinsky6_sr_in(model, gen, v):
    """Channels-last (B, F, H, W, 2 * in_visual_dim + 1): the noisy latent, the low-resolution one, a mask."""
    f, s = pick(((1, 8), (2, 8), (1, 16), (2, 16)), v)  # NABLA's token grid: sides multiples of 8
    return dict(hidden_states=randn(gen, 1, f, s, s, 9), timestep=rand_t(gen))


def _wan_animate_in(model, gen, v):
    """Latents of f + 1 frames (the reference frame first), the pose latents of f frames, a 16 x 16 face video of
    4f frames (the face encoder divides time by 4)."""
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 12, f + 1, s, s),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        pose_hidden_states=randn(gen, 1, 4, f, s, s),
        face_pixel_values=randn(gen, 1, 3, 4 * f, 16, 16),
    )


def _sana_wm_in(model, gen, v):
    """Per-frame timesteps (B, 1, F), text as (B, 1, L, D), one 20-number camera condition per frame."""
    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 4, f, s, s),
        timestep=torch.full((1, 1, f), 500.0),
        encoder_hidden_states=randn(gen, 1, 1, n, 16),
        encoder_attention_mask=torch.ones(1, n),
        camera_conditions=randn(gen, 1, f, 20),
    )


def _sana_wm_refiner_in(model, gen, v):
    """Patchified tokens, a timestep per token, the rotary table the refiner pipeline builds for its window."""
    (f, s), n = pick(VID_P1, v), pick(TXT, v)
    rope = model.build_rotary_emb_for_absolute_positions(1, list(range(f)), s, s, torch.device("cpu"), fps=24.0)
    return dict(
        hidden_states=randn(gen, 1, f * s * s, 4),
        encoder_hidden_states=randn(gen, 1, n, 16),
        timestep=torch.full((1, f * s * s), 0.5),
        video_rotary_emb=rope,
        encoder_attention_mask=torch.ones(1, n),
    )


def _wan_animate2_in(model, gen, v):
    """The reference pass ("extract"): lists of per-sample (C, F, H, W) latents and condition latents, a fresh KV
    cache that the pass fills (the denoising pass reads it through flex attention)."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    (f, s), n = pick(VID_P2, v), pick(TXT, v)
    return dict(
        hidden_states=[randn(gen, 4, f, s, s)],
        timestep=rand_t(gen),
        encoder_hidden_states=[randn(gen, n, 16)],
        condition_latents=[randn(gen, 4, f, s, s)],
        kv_cache=WanAnimate2KVCache(model.config.num_layers),
        kv_cache_mode="extract",
        seq_len=f * (s // 2) ** 2,
        offset_grid_sizes=torch.tensor([[f, s // 2, s // 2]]),
    )


#: Wan-style models smaller than the wan family (hidden 24, one layer)
_WAN_LIKE = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=1,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)
#: the CogVideoX-style 3D models
_COG = dict(
    in_channels=4,
    out_channels=4,
    time_embed_dim=4,
    text_embed_dim=8,
    num_layers=1,
    sample_width=8,
    sample_height=8,
    sample_frames=5,
    patch_size=2,
    temporal_compression_ratio=4,
    max_text_seq_length=8,
)
#: HunyuanVideo and its Framepack variant
_HUNYUAN = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=10,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    patch_size_t=1,
    guidance_embeds=True,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(2, 4, 4),
    image_condition_type=None,
)

VIDEO = [
    TinyModel(
        "allegro",
        "AllegroTransformer3DModel",
        "video",
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            cross_attention_dim=16,
            sample_width=8,
            sample_height=8,
            sample_frames=8,
            caption_channels=8,
        ),
        video_bcfhw_in(4, 8),
        "sdpa=2; cross-attn",
    ),
    TinyModel(
        "anyflow",
        "AnyFlowTransformer3DModel",
        "video",
        dict({k: v for k, v in _WAN_LIKE.items() if k != "qk_norm"}, rope_max_seq_len=32),
        _anyflow_in,
        "sdpa=2; cross-attn; Wan-style, per-frame timesteps",
    ),
    TinyModel(
        "anyflow-far",
        "AnyFlowFARTransformer3DModel",
        "video",
        dict(
            {k: v for k, v in _WAN_LIKE.items() if k != "qk_norm"},
            rope_max_seq_len=32,
            compressed_patch_size=(1, 4, 4),
            chunk_partition=(1, 1),
        ),
        _anyflow_far_in,
        "sdpa=1; cross-attn; the self-attention is flex attention over a block-causal mask "
        "(no SDPA): it stays native; the causal rollout path (no KV cache)",
    ),
    TinyModel(
        "chronoedit",
        "ChronoEditTransformer3DModel",
        "video",
        dict(_WAN_LIKE, rope_max_seq_len=32, eps=1e-6, rope_temporal_skip_len=8),
        video_bcfhw_in(4, 16),
        "sdpa=2; cross-attn; Wan-style",
    ),
    TinyModel(
        "cogvideox",
        "CogVideoXTransformer3DModel",
        "video",
        dict(_COG, num_attention_heads=2, attention_head_dim=8, patch_size_t=None),
        _cogvideox_in,
        "sdpa=1; self-attn-only; joint text+video; text length fixed to max_text_seq_length (8)",
    ),
    TinyModel(
        "consisid",
        "ConsisIDTransformer3DModel",
        "video",
        # hidden 48: the 3D sin-cos embedding needs a multiple of 16 split 3:1, the face kv dim 2/3 of it
        dict(
            _COG,
            num_attention_heads=4,
            attention_head_dim=12,
            cross_attn_interval=1,
            is_kps=False,
            is_train_face=True,
            cross_attn_dim_head=8,
            cross_attn_num_heads=2,
            LFE_id_dim=8,
            LFE_vit_dim=8,
            LFE_depth=1,
            LFE_dim_head=8,
            LFE_num_heads=2,
            LFE_num_id_token=2,
            LFE_num_querie=4,
            LFE_output_dim=32,  # = the face cross-attention kv dim, 2/3 of the hidden size
            LFE_ff_mult=1,
            LFE_num_scale=1,
        ),
        _consisid_in,
        "sdpa=1; self-attn-only; CogVideoX-style, text length fixed (8); the face perceiver "
        "attentions compute softmax by hand (no SDPA)",
    ),
    TinyModel(
        "cosmos",
        "CosmosTransformer3DModel",
        "video",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=1,
            mlp_ratio=2,
            text_embed_dim=16,
            adaln_lora_dim=4,
            max_size=(4, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(2.0, 1.0, 1.0),
            concat_padding_mask=False,  # True resizes the padding mask with torchvision
            extra_pos_embed_type="learnable",
        ),
        _cosmos_in,
        "sdpa=2; cross-attn; mask; concat_padding_mask=False (True needs torchvision)",
    ),
    TinyModel(
        "cosmos3",
        "Cosmos3OmniTransformer",
        "video",
        dict(
            head_dim=16,
            hidden_size=32,
            intermediate_size=64,
            latent_channel=4,
            latent_patch_size=2,
            num_attention_heads=2,
            num_hidden_layers=1,
            num_key_value_heads=1,
            patch_latent_dim=16,
            vocab_size=100,
            rope_axes_dim=(4, 2, 2),
        ),
        _cosmos3_in,
        "sdpa=2; cross-attn; gqa; Cosmos3 omni: the text prefix attends to itself, the video tokens "
        "to text+video (one SDPA each)",
    ),
    TinyModel(
        "easyanimate",
        "EasyAnimateTransformer3DModel",
        "video",
        dict(
            attention_head_dim=16,
            num_attention_heads=2,
            in_channels=4,
            mmdit_layers=1,
            num_layers=1,
            out_channels=4,
            patch_size=2,
            sample_height=60,
            sample_width=90,
            text_embed_dim=16,
            time_embed_dim=8,
            time_position_encoding_type="3d_rope",
            timestep_activation_fn="silu",
        ),
        video_bcfhw_in(4, 16),
        "sdpa=1; self-attn-only; joint text+video attention",
    ),
    TinyModel(
        "helios",
        "HeliosTransformer3DModel",
        "video",
        dict(
            _WAN_LIKE,
            rope_dim=(4, 4, 4),
            has_multi_term_memory_patch=True,
            guidance_cross_attn=True,
            zero_history_timestep=True,
            is_amplify_history=False,
        ),
        _helios_in,
        "sdpa=2; cross-attn; short/mid/long history latents joined to the self-attention sequence",
    ),
    TinyModel(
        "hunyuan-video",
        "HunyuanVideoTransformer3DModel",
        "video",
        dict(_HUNYUAN, patch_size=1),
        video_bcfhw_in(
            4,
            16,
            patch1=True,
            encoder_attention_mask=_text_mask,
            pooled_projections=lambda gen, f, s, n: randn(gen, 1, 8),
            guidance=lambda gen, f, s, n: torch.full((1,), 6.0),
        ),
        "sdpa=3; self-attn-only; mask; token refiner, double-stream and single-stream blocks",
    ),
    TinyModel(
        "hunyuan-video-framepack",
        "HunyuanVideoFramepackTransformer3DModel",
        "video",
        dict(_HUNYUAN, patch_size=2, has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True),
        _framepack_in,
        "sdpa=3; self-attn-only; mask; graphs=4; break: slicing by a data-dependent text length",
    ),
    TinyModel(
        "hunyuan-video15",
        "HunyuanVideo15Transformer3DModel",
        "video",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=16,
            text_embed_2_dim=8,
            image_embed_dim=12,
            rope_axes_dim=(2, 2, 4),
            target_size=16,
            task_type="t2v",
        ),
        video_bcfhw_in(
            4,
            16,
            patch1=True,
            encoder_attention_mask=_text_mask,
            encoder_hidden_states_2=lambda gen, f, s, n: randn(gen, 1, 4, 8),
            encoder_attention_mask_2=lambda gen, f, s, n: torch.ones(1, 4),
            image_embeds=lambda gen, f, s, n: torch.zeros(1, 3, 12),
        ),
        "sdpa=2; self-attn-only; mask; graphs=3; break: `if is_t2v` on a tensor; the ByT5 projection is 2048 "
        "wide whatever the config (4.2M of the parameters)",
    ),
    TinyModel(
        "kandinsky5",
        "Kandinsky5Transformer3DModel",
        "video",
        dict(
            in_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=8,
            time_dim=16,
            out_visual_dim=4,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=64,
            num_text_blocks=1,
            num_visual_blocks=1,
            axes_dims=(4, 6, 6),
            visual_cond=False,
            attention_type="regular",
        ),
        _kandinsky5_in,
        "sdpa=3; cross-attn; hidden_states channels-last (B, F, H, W, C)",
    ),
    TinyModel(
        "kandinsky6",
        "Kandinsky6Transformer3DModel",
        "video",
        dict(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=8,
            time_dim=16,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=64,
            num_text_blocks=1,
            num_visual_blocks=1,
            axes_dims=(4, 6, 6),
            visual_cond=False,
            in_audio_dim=4,
            out_audio_dim=4,
        ),
        _kandinsky6_in,
        "sdpa=8; cross-attn; audio+video: a text branch for each, self, text cross and audio<->video cross attention",
    ),
    TinyModel(
        "kandinsky6-sr",
        "Kandinsky6SRTransformer3DModel",
        "video",
        dict(
            in_visual_dim=4,
            out_visual_dim=4,
            time_dim=16,
            patch_size=(1, 1, 1),
            model_dim=32,
            ff_dim=64,
            num_visual_blocks=1,
            axes_dims=(4, 6, 6),
            nabla_window=(3, 3, 3),
            tile_sizes=((64, 64),),
        ),
        _kandinsky6_sr_in,
        "sdpa=0; self-attn-only; the attention is flex attention over a NABLA block-sparse "
        "mask, no SDPA: it stays native, only the linears go FP8",
    ),
    TinyModel(
        "latte",
        "LatteTransformer3DModel",
        "video",
        dict(
            sample_size=8,
            num_layers=1,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=2,
            caption_channels=8,
            in_channels=4,
            cross_attention_dim=16,
            out_channels=8,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            video_length=2,
        ),
        _latte_in,
        "sdpa=3; cross-attn; temporal attention has batch=image tokens, seq=frames (2, fixed by "
        "video_length): only the image size varies",
    ),
    TinyModel(
        "ltx-video",
        "LTXVideoTransformer3DModel",
        "video",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            num_layers=1,
            qk_norm="rms_norm_across_heads",
            caption_channels=16,
        ),
        _ltx_in,
        "sdpa=2; cross-attn; mask",
    ),
    TinyModel(
        "ltx2-video",
        "LTX2VideoTransformer3DModel",
        "video",
        dict(
            in_channels=4,
            out_channels=4,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=4,
            audio_cross_attention_dim=8,
            num_layers=1,
            qk_norm="rms_norm_across_heads",
            caption_channels=16,
            rope_double_precision=False,
        ),
        _ltx2_in,
        "sdpa=6; cross-attn; mask; audio+video: self, text cross and audio<->video cross attention",
    ),
    TinyModel(
        "minimax-h3",
        "MiniMaxH3Transformer3DModel",
        "video",
        dict(
            num_attention_heads=2,
            attention_head_dim=16,
            hidden_size=32,
            num_layers=1,
            num_refiner_layers=1,
            ffn_dim=64,
            in_channels=4,
            audio_in_channels=8,
            patch_size=(1, 2, 2),
            text_dim=16,
            freq_dim=32,
            time_embed_hidden_dim=32,
            time_embed_dim=16,
            rope_freq_dim=2,
        ),
        _minimax_h3_in,
        "sdpa=2; self-attn-only; text, video and audio rows in one packed sequence; the "
        "output is the video rows (the audio rows are the second output)",
    ),
    TinyModel(
        "mochi",
        "MochiTransformer3DModel",
        "video",
        dict(
            patch_size=2,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            pooled_projection_dim=16,
            in_channels=4,
            out_channels=None,
            qk_norm="rms_norm",
            text_embed_dim=16,
            time_embed_dim=4,
            activation_fn="swiglu",
            max_sequence_length=16,
        ),
        video_bcfhw_in(4, 16, encoder_attention_mask=lambda gen, f, s, n: torch.ones(1, n, dtype=torch.bool)),
        "sdpa=1; cross-attn; mask; graphs=9; the joint attention loops over samples with torch.nonzero, so "
        "Dynamo skips that frame and its SDPA runs eagerly outside any graph; the one captured SDPA is the "
        "text attention pool (1 query)",
    ),
    TinyModel(
        "motif-video",
        "MotifVideoTransformer3DModel",
        "video",
        dict(
            in_channels=8,
            out_channels=8,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=1,
            num_single_layers=1,
            num_decoder_layers=0,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            qk_norm="rms_norm",
            norm_type="layer_norm",
            text_embed_dim=32,
            image_embed_dim=4,
            rope_theta=256.0,
            rope_axes_dim=(4, 4, 4),
            enable_text_cross_attention_dual=False,
            enable_text_cross_attention_single=False,
        ),
        video_bcfhw_in(8, 32, patch1=True),
        "sdpa=2; self-attn-only",
    ),
    TinyModel(
        "sana-video",
        "SanaVideoTransformer3DModel",
        "video",
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=1,
            num_cross_attention_heads=2,
            cross_attention_head_dim=12,
            cross_attention_dim=24,
            caption_channels=16,
            mlp_ratio=2.5,
            dropout=0.0,
            attention_bias=False,
            sample_size=8,
            patch_size=(1, 2, 2),
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
        video_bcfhw_in(4, 16),
        "sdpa=1; cross-attn; the self-attention is linear attention (no SDPA)",
    ),
    TinyModel(
        "sana-wm",
        "SanaWMTransformer3DModel",
        "video",
        dict(
            in_channels=4,
            num_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            linear_head_dim=16,
            softmax_every_n=2,
            caption_channels=16,
            use_chunk_plucker_post_attn=False,
            chunk_plucker_post_attn_blocks=0,
            chunk_plucker_channels=8,
            image_size=64,
            mixed_precision="fp32",
            fp32_attention=False,
        ),
        _sana_wm_in,
        "sdpa=4; cross-attn; mask; one block of two softmax attention (softmax_every_n=2), the "
        "other linear attention (no SDPA); a camera condition per frame",
    ),
    TinyModel(
        "sana-wm-refiner",
        "SanaWMLTX2RefinerTransformer3DModel",
        "video",
        dict(
            in_channels=4,
            out_channels=4,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=4,
            audio_cross_attention_dim=8,
            num_layers=1,
            caption_channels=16,
            rope_double_precision=False,
        ),
        _sana_wm_refiner_in,
        "sdpa=2; cross-attn; mask; LTX-2-style video blocks (the audio branch unused); the rotary table is an input",
    ),
    TinyModel(
        "skyreels-v2",
        "SkyReelsV2Transformer3DModel",
        "video",
        dict(_WAN_LIKE, rope_max_seq_len=32),
        video_bcfhw_in(4, 16),
        "sdpa=2; cross-attn; Wan-style",
    ),
    TinyModel(
        "transformer-temporal",
        "TransformerTemporalModel",
        "video",
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=1, norm_num_groups=2),
        _temporal_in,
        "sdpa=2; self-attn-only; the UNet's temporal attention: batch = pixels, seq = frames",
    ),
    TinyModel(
        "wan-animate",
        "WanAnimateTransformer3DModel",
        "video",
        dict(
            {k: v for k, v in _WAN_LIKE.items() if k not in ("in_channels",)},
            latent_channels=4,
            in_channels=12,
            image_dim=None,
            rope_max_seq_len=32,
            motion_encoder_size=16,
            motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
            motion_style_dim=16,
            motion_dim=4,
            motion_encoder_dim=16,
            face_encoder_hidden_dim=16,
            face_encoder_num_heads=2,
            inject_face_latents_blocks=1,
            motion_encoder_batch_size=8,
        ),
        _wan_animate_in,
        "sdpa=3; cross-attn; Wan-style, with a face adapter: per-frame cross-attention to "
        "motion features of a face video (16x16 here)",
    ),
    TinyModel(
        "wan-animate2",
        "WanAnimate2Transformer3DModel",
        "video",
        dict(
            patch_size=(1, 2, 2),
            text_len=24,
            in_dim=8,
            dim=32,
            ffn_dim=64,
            freq_dim=32,
            text_dim=16,
            out_dim=4,
            num_heads=2,
            num_layers=1,
            use_img_emb=False,
        ),
        _wan_animate2_in,
        "sdpa=2; cross-attn; graphs=10; breaks: grid_sizes.tolist() in each rope_apply "
        "(per-sample rotary loop); the reference pass (kv_cache_mode=extract): the denoising "
        "pass attends through flex attention",
    ),
    TinyModel(
        "wan-vace",
        "WanVACETransformer3DModel",
        "video",
        dict(_WAN_LIKE, rope_max_seq_len=32, num_layers=2, vace_layers=[0], vace_in_channels=12),
        video_bcfhw_in(4, 16, control_hidden_states=lambda gen, f, s, n: randn(gen, 1, 12, f, s, s)),
        "sdpa=6; cross-attn; one VACE control block",
    ),
]
