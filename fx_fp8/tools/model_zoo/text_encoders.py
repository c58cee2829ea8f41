"""Tiny random `transformers` text encoders built from configs (offline): what diffusers
pipelines load as text_encoder / text_encoder_2 (CLIP, T5), for component-scoped configs.

Sizes are multiples of 16 and at least min_features (32), so every block linear is eligible.
"""

from __future__ import annotations

import torch

VOCAB = 128
#: prompt length of the example inputs
TOKENS = 16


def tiny_t5(seed: int = 0, *, d_model: int = 64, layers: int = 2):
    """T5EncoderModel (Flux's / SD3's text_encoder_2 / _3): `wo` in _keep_in_fp32_modules."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.T5Config(
        vocab_size=VOCAB,
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=layers,
        num_heads=4,
        feed_forward_proj="gated-gelu",
    )
    return tf.T5EncoderModel(cfg).eval()


def tiny_clip(seed: int = 0, *, hidden: int = 64, layers: int = 2, positions: int = 32):
    """CLIPTextModelWithProjection (SD3's text_encoder / _2): a final `text_projection`."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        projection_dim=hidden,
        max_position_embeddings=positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return tf.CLIPTextModelWithProjection(cfg).eval()


def tiny_qwen25_vl(seed: int = 0, *, hidden: int = 64, layers: int = 2):
    """Qwen2_5_VLForConditionalGeneration (Qwen-Image's text_encoder; the pipeline takes the last
    hidden states): a one-block vision tower beside the language model."""
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_scaling={"type": "mrope", "mrope_section": [hidden // 32, hidden // 32, hidden // 16]},
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden,
        fullatt_block_indexes=[0],
        window_size=16,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()


TEXT_ENCODERS = {"t5": tiny_t5, "clip": tiny_clip, "qwen2.5-vl": tiny_qwen25_vl}


def token_ids(seed: int = 1, batch: int = 1, tokens: int = TOKENS, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def prompt_embeddings(encoder, ids: torch.Tensor) -> dict:
    """What a pipeline takes from the encoder: {"last_hidden_state"} (T5, CLIP's per-token
    embeddings), for CLIP {"text_embeds"} (the pooled embedding through text_projection), for a
    causal LM such as Qwen2.5-VL {"hidden_states[-1]"} (what Qwen-Image's pipeline reads)."""
    out = encoder(ids, output_hidden_states=True)
    found = {k: out[k] for k in ("last_hidden_state", "text_embeds") if k in out}
    if not found:
        found["hidden_states[-1]"] = out["hidden_states"][-1]
    return {k: v.detach() for k, v in found.items()}
