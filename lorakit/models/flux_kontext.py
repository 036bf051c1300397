"""FLUX.1 Kontext (dev): image editing with FLUX. The FLUX.1-dev transformer, text encoders and VAE; the control
image's latents are packed and appended after the target's tokens, with position ids whose first coordinate is
1 (FluxKontextPipeline.prepare_latents), and only the target's tokens of the output are kept. The prompt does
not see the image (T5 + CLIP as FLUX.1-dev). Same LoRA keys and native (BFL / ComfyUI) names as FLUX.1-dev."""

from __future__ import annotations

from lorakit.models.facts import AttentionCase
from lorakit.models.flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    layout = "edit"
    max_controls = 1
    # FLUX's shapes, plus the sequence of a 1024² target with its 1024² control (2 x 4096 image + 512 text)
    attention_cases = FluxAdapter.attention_cases + (AttentionCase("1024px+control", 8704, False),
                                                     AttentionCase("1024px+control single", 8704, False, "single"))

    def call_kwargs(self, width: int, height: int, frames: int = 1) -> dict:
        # FluxKontextPipeline rescales the requested size to `max_area` (1024² by default) at its aspect ratio
        return {"width": width, "height": height, "max_area": width * height}

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for x_t (B, 16, h, w) given one control latent (B, 16, h', w'), as FluxKontextPipeline
        calls the transformer."""
        from diffusers import FluxPipeline

        tokens, ids = [], []
        for ctrl in controls or []:
            cb, cc, ch, cw = ctrl.shape
            ctrl = ctrl.to(x_t.device, x_t.dtype)
            tokens.append(FluxPipeline._pack_latents(ctrl, cb, cc, ch, cw))
            cid = FluxPipeline._prepare_latent_image_ids(cb, ch // 2, cw // 2, x_t.device, x_t.dtype)
            cid[..., 0] = 1  # the control image's positions: first coordinate 1, as the pipeline sets them
            ids.append(cid)
        return self._velocity(transformer, x_t, sigmas, text, guidance, tokens, ids)


ADAPTER = FluxKontextAdapter
