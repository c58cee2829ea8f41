"""Audio transformers of the zoo."""

from __future__ import annotations

import torch

from fx_fp8.tools.model_zoo.entry import TinyModel
from fx_fp8.tools.model_zoo.inputs import AUDIO, TXT, pick, rand_t, randn


def _ace_step_in(model, gen, v):
    t, n = pick(AUDIO, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, t, 8),
        timestep=torch.rand(1, generator=gen),
        timestep_r=torch.rand(1, generator=gen),
        encoder_hidden_states=randn(gen, 1, n, 32),
        context_latents=randn(gen, 1, t, 16),
    )


def _stable_audio_in(model, gen, v):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    t, n = pick(AUDIO, v), pick(TXT, v)
    rope = get_1d_rotary_pos_embed(4, t + 1, use_real=True, repeat_interleave_real=False)  # +1: the global token
    return dict(
        hidden_states=randn(gen, 1, 4, t),
        timestep=rand_t(gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        global_hidden_states=randn(gen, 1, 1, 8),
        rotary_embedding=rope,
    )


def _stable_audio3_in(model, gen, v):
    t, n = pick(AUDIO, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, 8, t),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=randn(gen, 1, n, 16),
        global_hidden_states=randn(gen, 1, 12),
    )


def _longcat_audio_in(model, gen, v):
    t, n = pick(AUDIO, v), pick(TXT, v)
    return dict(
        hidden_states=randn(gen, 1, t, 8),
        encoder_hidden_states=randn(gen, 1, n, 32),
        encoder_attention_mask=torch.ones(1, n, dtype=torch.bool),
        attention_mask=torch.ones(1, t, dtype=torch.bool),
        timestep=torch.rand(1, generator=gen),
    )


def _minimax_music3_in(model, gen, v):
    t = pick(AUDIO, v)
    # the condition is frame-aligned with the latent (same length)
    return dict(
        hidden_states=randn(gen, 1, 8, t), encoder_hidden_states=randn(gen, 1, t, 16), timestep=torch.full((1,), 0.5)
    )


AUDIO_MODELS = [
    TinyModel(
        "ace-step",
        "AceStepTransformer1DModel",
        "audio",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            in_channels=24,
            audio_acoustic_hidden_dim=8,
            patch_size=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            sliding_window=16,
        ),
        _ace_step_in,
        "sdpa=4; cross-attn; mask; gqa (enable_gqa=True: 4 query heads, 2 kv heads); sliding-window mask",
    ),
    TinyModel(
        "longcat-audio",
        "LongCatAudioDiTTransformer",
        "audio",
        dict(dit_dim=32, dit_depth=2, dit_heads=2, dit_text_dim=32, latent_dim=8, text_conv=False),
        _longcat_audio_in,
        "sdpa=4; cross-attn; mask",
    ),
    TinyModel(
        "minimax-music3",
        "MiniMaxMusic3Transformer1DModel",
        "audio",
        dict(
            in_channels=8,
            condition_dim=16,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=8,
            ff_inner_dim=32,
            rotary_dim=4,
            fourier_embedding_dim=8,
        ),
        _minimax_music3_in,
        "sdpa=2; self-attn-only; the condition is frame-aligned with the latent",
    ),
    TinyModel(
        "stable-audio",
        "StableAudioDiTModel",
        "audio",
        dict(
            sample_size=16,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_attention_heads=2,
            out_channels=4,
            cross_attention_dim=16,
            time_proj_dim=8,
            global_states_input_dim=8,
            cross_attention_input_dim=16,
        ),
        _stable_audio_in,
        "sdpa=2; cross-attn; kv heads repeated before SDPA; a global token is prepended",
    ),
    TinyModel(
        "stable-audio3",
        "StableAudio3DiTModel",
        "audio",
        dict(
            io_channels=8,
            patch_size=1,
            embed_dim=32,
            depth=2,
            num_heads=4,
            cond_token_dim=16,
            global_cond_dim=12,
            local_add_cond_dim=5,
            timestep_features_dim=16,
            ff_mult=2,
            num_memory_tokens=3,
            use_differential_attention=False,
        ),
        _stable_audio3_in,
        "sdpa=4; cross-attn; 3 memory tokens prepended",
    ),
]
