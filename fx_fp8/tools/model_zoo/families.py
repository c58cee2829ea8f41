"""The five named families: each one entry, with its one tiny config (hidden sizes 64-128, the
structure of the real family: module names, block lists, attention kinds), its config-driven input
maker, its aliases and its tiny pipelines. The zoo, its named families (registry.FAMILIES), the tiny pipelines and
`fx-fp8 --model <family>` all build from these entries."""

from __future__ import annotations

from fx_fp8.tools.model_zoo.entry import Family, TinyModel
from fx_fp8.tools.model_zoo.inputs import (
    VID_P2,
    family_variants,
    flux_inputs,
    image_sizes,
    qwen_image_inputs,
    sd3_inputs,
    wan_inputs,
    z_image_inputs,
)
from fx_fp8.tools.model_zoo.vaes import AUTOENCODER_KL, QWEN_VAE, WAN_VAE

#: Wan's zoo variants: (frames, side) in tokens, from the (1, 2, 2)-patch latent table
_WAN_SIZES = tuple(dict(frames=f, side=s // 2, txt=n) for (f, s), n in zip(VID_P2, (6, 8, 10, 12)))


def _family(name, class_name, kind, config, *, aliases, layer_keys, inputs, variants, pipelines, vae, notes):
    fam = Family(aliases=aliases, layer_keys=layer_keys, inputs=inputs, variants=variants, pipelines=pipelines, vae=vae)
    return TinyModel(name, class_name, kind, config, family_variants(inputs, variants), notes, fam)


FAMILY_ENTRIES = [
    _family(
        "flux",
        "FluxTransformer2DModel",
        "image",
        dict(
            patch_size=1,
            in_channels=32,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=64,
            pooled_projection_dim=64,
            axes_dims_rope=(8, 12, 12),
        ),
        aliases=(),
        layer_keys=("num_layers", "num_single_layers"),
        inputs=flux_inputs,
        variants=image_sizes(),
        pipelines={"flux": "tiny_flux"},
        vae=AUTOENCODER_KL,
        notes="sdpa=4; self-attn-only; joint double-stream blocks and single-stream blocks",
    ),
    _family(
        "qwen-image",
        "QwenImageTransformer2DModel",
        "image",
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=64,
            axes_dims_rope=(8, 12, 12),
        ),
        aliases=("qwen", "qwenimage"),
        layer_keys=("num_layers",),
        inputs=qwen_image_inputs,
        variants=image_sizes(),
        pipelines={"qwen-image": "tiny_qwen_image"},
        vae=QWEN_VAE,
        notes="sdpa=2; self-attn-only; mask; joint double-stream attention",
    ),
    # Wan2.1 and Wan2.2 share the transformer class: the family is "wan", the version a pipeline
    _family(
        "wan",
        "WanTransformer3DModel",
        "video",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=32,
            in_channels=4,
            out_channels=4,
            text_dim=64,
            freq_dim=64,
            ffn_dim=128,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
        aliases=("wan2.1", "wan2.2"),
        layer_keys=("num_layers",),
        inputs=wan_inputs,
        variants=_WAN_SIZES,
        pipelines={"wan2.1": "tiny_wan", "wan2.2": "tiny_wan22"},
        vae=WAN_VAE,
        notes="sdpa=4; cross-attn",
    ),
    _family(
        "z-image",
        "ZImageTransformer2DModel",
        "image",
        dict(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=4,
            dim=96,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=3,
            n_kv_heads=3,
            cap_feat_dim=64,
            axes_dims=[8, 12, 12],
            axes_lens=[64, 32, 32],
        ),
        aliases=("zimage",),
        layer_keys=("n_layers",),
        inputs=z_image_inputs,
        variants=image_sizes(),
        pipelines={"z-image": "tiny_z_image"},
        vae=AUTOENCODER_KL,
        notes="sdpa=4; self-attn-only; list inputs (x, cap_feats); noise and context refiners, then joint layers",
    ),
    _family(
        "sd3",
        "SD3Transformer2DModel",
        "image",
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=64,
            caption_projection_dim=64,
            pooled_projection_dim=64,
            out_channels=4,
            pos_embed_max_size=32,
        ),
        aliases=(),
        layer_keys=("num_layers",),
        inputs=sd3_inputs,
        variants=image_sizes(),
        pipelines={"sd3": "tiny_sd3"},
        vae=AUTOENCODER_KL,
        notes="sdpa=2; self-attn-only; MMDiT joint attention",
    ),
]
