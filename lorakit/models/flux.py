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


ADAPTER = FluxAdapter
