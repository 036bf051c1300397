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

    def decode_latents(self, latents):
        """Latents (B, C, h, w) or clips (B, C, T, h, w) -> pixels in [-1, 1] (a clip: its middle frame)."""
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        with torch.no_grad():
            out = vae.decode(latents.to(vae.device, vae.dtype) / vae.config.scaling_factor).sample
        return out[:, :, out.shape[2] // 2] if out.dim() == 5 else out


    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for x_t ((B, C, h, w) images or (B, C, T, h, w) clips), as the Kandinsky 5 pipelines
        call the transformer: channels-last latents (T2V: with the zero visual condition and its mask),
        rotary positions of frames, rows, columns and text, timestep = sigma x 1000, the resolution's
        rope scale (T2V)."""
        import torch

        video = x_t.dim() == 5
        x = x_t if video else x_t.unsqueeze(2)
        b, c, t, h, w = x.shape
        dev, dt = x.device, x.dtype
        lat = x.permute(0, 2, 3, 4, 1)  # (B, T, h, w, C)
        if getattr(transformer, "visual_cond", False):
            lat = torch.cat([lat, torch.zeros_like(lat), torch.zeros(b, t, h, w, 1, device=dev, dtype=dt)], dim=-1)
        rope = [torch.arange(t, device=dev), torch.arange(h // 2, device=dev), torch.arange(w // 2, device=dev)]
        mask = text.get("prompt_embeds_mask")
        n_text = int(mask.sum(1).max()) if mask is not None else text["prompt_embeds"].shape[1]
        emb = text["prompt_embeds"][:, :n_text].to(dev, dt)
        scale = list(self.pipeline_scale(h * 8, w * 8)) if video else [1.0, 1.0, 1.0]
        out = transformer(hidden_states=lat, encoder_hidden_states=emb, pooled_projections=text["pooled"].to(dev, dt),
                          timestep=(sigmas * 1000).to(dev, dt), visual_rope_pos=rope,
                          text_rope_pos=torch.arange(n_text, device=dev), scale_factor=scale, sparse_params=None,
                          return_dict=True).sample
        v = out.permute(0, 4, 1, 2, 3)  # (B, C, T, h, w)
        return v if video else v[:, :, 0]

    @staticmethod
    def pipeline_scale(height: int, width: int) -> tuple:
        """Kandinsky5T2VPipeline's rope scale for a pixel size (480p-range sides: 2, else 3.16)."""
        return (1, 2, 2) if 480 <= height <= 854 and 480 <= width <= 854 else (1, 3.16, 3.16)


ADAPTER = Kandinsky5Adapter
