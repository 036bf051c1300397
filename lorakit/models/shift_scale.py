"""The latent normalisations families share, as their stock pipelines apply them: FLUX.1 and Z-Image's
AutoencoderKL mean, `(z - shift_factor) * scaling_factor`, and its inverse before decoding; Qwen-Image's and Wan's
per-channel `(z - latents_mean) / latents_std` (`channel_stats`)."""

from __future__ import annotations


def channel_stats(vae, device, dtype):
    """(mean, std) of a Wan-style VAE's latent channels (config latents_mean / latents_std), shaped (1, C, 1, 1, 1)."""
    import torch

    n = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, n, 1, 1, 1).to(device, dtype)
    std = torch.tensor(vae.config.latents_std).view(1, n, 1, 1, 1).to(device, dtype)
    return mean, std


def encode_per_channel(vae, frames):
    """Pixels (B, C, T, H, W) -> the VAE's mean latents normalised per channel, `(z - latents_mean) / latents_std`
    (Qwen-Image, Qwen-Image-2.1, Wan), without gradients."""
    import torch

    with torch.no_grad():
        lat = vae.encode(frames.to(vae.device, vae.dtype)).latent_dist.mode()
    mean, std = channel_stats(vae, lat.device, lat.dtype)
    return (lat - mean) / std


def decode_per_channel(vae, latents):
    """Normalised latents (B, C, T, h, w) -> the VAE's decoded pixels (B, C', T', H, W): the inverse normalisation,
    then decode, as the pipelines do, without gradients."""
    import torch

    mean, std = channel_stats(vae, vae.device, vae.dtype)
    with torch.no_grad():
        return vae.decode(latents.to(vae.device, vae.dtype) * std + mean).sample


class ShiftScaleLatents:
    """encode_images / decode_latents for adapters whose VAE is an AutoencoderKL with shift and scaling factors."""

    def encode_images(self, pixels):
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        with torch.no_grad():
            lat = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return (lat - vae.config.shift_factor) * vae.config.scaling_factor

    def decode_latents(self, latents):
        """Normalised latents (B, 16, h, w) -> pixels (B, 3, H, W) in [-1, 1]."""
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        with torch.no_grad():
            lat = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
            return vae.decode(lat).sample
