"""Qwen-Image, -Edit and -Edit-Plus (variants of one adapter): Qwen2.5-VL hidden states with the
pipeline's template and dropped prefix (edit: the control image(s) in the prompt); latents normalised
per channel with the VAE's latents_mean / latents_std."""

from __future__ import annotations

from lorakit.models.base import Adapter

CONDITION_AREA = 384 * 384  # Edit-Plus: prompt images are resized to this area, as the pipeline does


def condition_size(width: int, height: int, area: int = CONDITION_AREA) -> tuple[int, int]:
    """The pipeline's rule: the given area at the image's aspect ratio, sides rounded to 32."""
    import math

    w = math.sqrt(area * width / height)
    h = w / (width / height)
    return round(w / 32) * 32, round(h / 32) * 32


class QwenImageAdapter(Adapter):
    max_sequence_length = 1024

    @property
    def text_parts(self):
        base = ("text_encoder", "tokenizer")
        return base + (("processor",) if self.info.variant else ())

    def encode_prompts(self, texts, controls=None):
        """controls: per text, a list of PIL control images (edit variants), already at the target size."""
        import torch

        self.load(self.text_parts)
        pipe = self.pipeline()
        out = []
        with torch.no_grad():
            for i, text in enumerate(texts):  # one at a time: prompts carry different images
                kw = {}
                if self.info.variant == "edit":
                    kw["image"] = controls[i][0]
                elif self.info.variant == "edit-plus":
                    imgs = controls[i]
                    kw["image"] = [pipe.image_processor.resize(im, *reversed(condition_size(*im.size)))
                                   for im in imgs]
                embeds, mask = pipe.encode_prompt(prompt=[text], max_sequence_length=self.max_sequence_length, **kw)
                n = int(mask[0].sum()) if mask is not None else embeds.shape[1]  # None: no padding
                out.append({"prompt_embeds": embeds[0, :n]})
        return out

    def _normalise(self, lat):
        import torch

        vae = self.parts[self.vae_part]
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(lat.device, lat.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(lat.device, lat.dtype)
        return (lat - mean) / std

    def encode_images(self, pixels):
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        with torch.no_grad():
            lat = vae.encode(pixels.to(vae.device, vae.dtype).unsqueeze(2)).latent_dist.mode()
        return self._normalise(lat)[:, :, 0]

    def decode_latents(self, latents):
        """Normalised latents (B, 16, h, w) -> pixels (B, 3, H, W) in [-1, 1]."""
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(vae.device, vae.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(vae.device, vae.dtype)
        with torch.no_grad():
            lat = latents.to(vae.device, vae.dtype).unsqueeze(2) * std + mean
            return vae.decode(lat).sample[:, :, 0]


    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The transformer's velocity for x_t (B, 16, h, w), as the Qwen-Image pipelines call it: 2x2-packed
        latents, control latents (edit) packed and appended after the target's tokens, img_shapes for the
        rotary positions, the text mask, timestep = sigma; the output's target tokens only."""
        from diffusers import QwenImagePipeline

        b, c, h, w = x_t.shape
        dev, dt = x_t.device, x_t.dtype
        seq = (h // 2) * (w // 2)
        tokens = [QwenImagePipeline._pack_latents(x_t, b, c, h, w)]
        shapes = [(1, h // 2, w // 2)]
        for ctrl in controls or []:
            cb, cc, ch, cw = ctrl.shape
            tokens.append(QwenImagePipeline._pack_latents(ctrl.to(dev, dt), cb, cc, ch, cw))
            shapes.append((1, ch // 2, cw // 2))
        import torch

        mask = text.get("prompt_embeds_mask")
        out = transformer(hidden_states=torch.cat(tokens, dim=1), timestep=sigmas.to(dev, dt),
                          encoder_hidden_states=text["prompt_embeds"].to(dev, dt),
                          encoder_hidden_states_mask=None if mask is None else mask.to(dev),
                          img_shapes=[shapes] * b, return_dict=False)[0][:, :seq]
        return QwenImagePipeline._unpack_latents(out, h * 8, w * 8, 8)[:, :, 0]


ADAPTER = QwenImageAdapter
