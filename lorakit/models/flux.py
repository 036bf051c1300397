"""FLUX.1-dev: T5 sequence + CLIP pooled text embeddings; latents (x - shift) * scale."""

from __future__ import annotations

from lorakit.models.base import Adapter


class FluxAdapter(Adapter):
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    max_sequence_length = 512

    def encode_prompts(self, texts, controls=None):
        import torch

        self.load(self.text_parts)
        with torch.no_grad():
            embeds, pooled, _ = self.pipeline().encode_prompt(prompt=list(texts), prompt_2=None,
                                                              max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": embeds[i], "pooled": pooled[i]} for i in range(len(texts))]

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


    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The transformer's velocity for latents x_t (B, 16, h, w) at per-item sigmas, as FluxPipeline
        calls it: 2x2-packed latents, image/text position ids, timestep = sigma, guidance embedding."""
        import torch
        from diffusers import FluxPipeline

        b, c, h, w = x_t.shape
        dev, dt = x_t.device, x_t.dtype
        packed = FluxPipeline._pack_latents(x_t, b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, dev, dt)
        embeds = text["prompt_embeds"].to(dev, dt)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=dev, dtype=dt)
        out = transformer(hidden_states=packed, timestep=sigmas.to(dev, dt), guidance=torch.full((b,), guidance, device=dev, dtype=dt),
                          pooled_projections=text["pooled"].to(dev, dt), encoder_hidden_states=embeds, txt_ids=txt_ids,
                          img_ids=img_ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)


ADAPTER = FluxAdapter
