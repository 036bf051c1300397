"""The latent normalisation FLUX.1 and Z-Image share: an AutoencoderKL's mean, `(z - shift_factor) *
scaling_factor` (the VAE config's numbers), and its inverse before decoding — as their stock pipelines do."""

from __future__ import annotations


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
