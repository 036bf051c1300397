"""Kandinsky 5 (T2I and T2V): Qwen2.5-VL hidden states (template prefix dropped) + CLIP pooled;
latents = VAE mean x scaling_factor (the pipelines decode latents / scaling_factor)."""

from __future__ import annotations

from lorakit.models.base import Adapter


class Kandinsky5Adapter(Adapter):
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    max_sequence_length = 512

    def encode_prompts(self, texts, controls=None):
        import torch

        self.load(self.text_parts)
        with torch.no_grad():
            qwen, clip, cu = self.pipeline().encode_prompt(prompt=list(texts),
                                                           max_sequence_length=self.max_sequence_length)
        lengths = (cu[1:] - cu[:-1]).tolist()
        return [{"prompt_embeds": qwen[i, :lengths[i]], "pooled": clip[i]} for i in range(len(texts))]

    def _encode(self, x):
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        with torch.no_grad():
            return vae.encode(x.to(vae.device, vae.dtype)).latent_dist.mode() * vae.config.scaling_factor

    def encode_images(self, pixels):
        return self._encode(pixels)

    def encode_video(self, frames):
        return self._encode(frames)


ADAPTER = Kandinsky5Adapter
