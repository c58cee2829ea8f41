"""The tiny pipelines' VAEs as configs (with "_class_name"): model_source reads the sizes a
pipeline can make from them without building anything. Latent channels follow the transformer."""

#: two blocks -> vae_scale_factor 2: a 32x32 image is a 16x16 latent
AUTOENCODER_KL = dict(
    _class_name="AutoencoderKL",
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(16, 16),
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=32,
    scaling_factor=1.0,
    shift_factor=0.0,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)
#: one temporal-downsample entry -> vae_scale_factor 2
QWEN_VAE = dict(
    _class_name="AutoencoderKLQwenImage", base_dim=8, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False]
)
#: x2 in space and in time (causal: 1 + 2k frames from 1 + k latent frames)
WAN_VAE = dict(
    _class_name="AutoencoderKLWan",
    base_dim=8,
    dim_mult=[1, 1],
    num_res_blocks=1,
    temperal_downsample=[True],
    scale_factor_temporal=2,
    scale_factor_spatial=2,
)
