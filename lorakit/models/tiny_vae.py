"""The tiny models' VAEs and scheduler (`lorakit.models.tiny` builds the pipelines from them): the real classes at a
few thousand parameters, seeded."""

from __future__ import annotations


def seeded(seed: int):
    """Seed torch's default generator: the next module's random weights follow from `seed`."""
    import torch

    torch.manual_seed(seed)


def flux_vae(seed: int):
    from diffusers import AutoencoderKL

    seeded(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16, 16, 16, 16),
                         layers_per_block=1, norm_num_groups=8, latent_channels=16, scaling_factor=0.3611,
                         shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
                         sample_size=64).eval()


def flux2_vae(seed: int):
    """FLUX.2's VAE class (16 latent channels here, 32 published; batch-norm statistics of the 2x2-patchified
    latents, set away from 0 / 1 so that a missed normalisation shows)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    seeded(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8,
                             latent_channels=16, sample_size=64).eval()
    g = torch.Generator().manual_seed(seed)
    vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=g))
    vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    return vae


def qwen_vae(seed: int):
    from diffusers import AutoencoderKLQwenImage

    seeded(seed)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                  temperal_downsample=[False, True, True]).eval()


def qwen_image21_vae(seed: int):
    """AutoencoderKLQwenImage21: RGBA in and out, 64 channels, 16x (four downsamplings), residual blocks;
    per-channel statistics away from 0 / 1 so that a missed normalisation shows."""
    import torch
    from diffusers import AutoencoderKLQwenImage21

    seeded(seed)
    g = torch.Generator().manual_seed(seed)
    mean = (0.3 * torch.randn(64, generator=g)).tolist()
    std = (0.5 + torch.rand(64, generator=g)).tolist()
    return AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 2, 2, 2, 2],
                                    num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                    latents_mean=mean, latents_std=std).eval()


def wan_vae(seed: int, variant: str = ""):
    """AutoencoderKLWan: Wan 2.1's (16 channels, 8x) or, for TI2V-5B, Wan 2.2's (48 channels, 2x2 patches folded
    in: 16x, residual blocks); per-channel statistics away from 0 / 1 so that a missed normalisation shows."""
    import torch
    from diffusers import AutoencoderKLWan

    seeded(seed)
    ti2v = variant == "2.2-ti2v"
    z = 48 if ti2v else 16
    g = torch.Generator().manual_seed(seed)
    mean = (0.3 * torch.randn(z, generator=g)).tolist()
    std = (0.5 + torch.rand(z, generator=g)).tolist()
    kw = dict(is_residual=True, patch_size=2, scale_factor_spatial=16, in_channels=12, out_channels=12) if ti2v else {}
    return AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std,
                            **kw).eval()


def hunyuan_video_vae(seed: int):
    from diffusers import AutoencoderKLHunyuanVideo

    seeded(seed)
    return AutoencoderKLHunyuanVideo(latent_channels=16, block_out_channels=(16, 16, 16, 16), layers_per_block=1,
                                     norm_num_groups=8, mid_block_add_attention=False,
                                     spatial_compression_ratio=8, temporal_compression_ratio=4).eval()


def flow_scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)
