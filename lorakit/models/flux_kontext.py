"""FLUX.1 Kontext (dev): image editing with FLUX. The FLUX.1-dev transformer, text encoders and VAE; the control
image's latents are packed and appended after the target's tokens, with position ids whose first coordinate is
1 (FluxKontextPipeline.prepare_latents), and only the target's tokens of the output are kept. The prompt does
not see the image (T5 + CLIP as FLUX.1-dev). Same LoRA keys and native (BFL / ComfyUI) names as FLUX.1-dev."""

from __future__ import annotations

from lorakit.models.facts import AttentionCase
from lorakit.models.flux import FluxAdapter

# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS (the sizes Kontext was trained at), as (width, height)
PREFERRED = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
             (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
             (1568, 672))


class FluxKontextAdapter(FluxAdapter):
    layout = "edit"
    max_controls = 1
    # FLUX's shapes, plus the sequence of a 1024² target with its 1024² control (2 x 4096 image + 512 text)
    attention_cases = FluxAdapter.attention_cases + (AttentionCase("1024px+control", 8704, False),
                                                     AttentionCase("1024px+control single", 8704, False, "single"))

    def control_size(self, width, height, resolution=None):
        """FluxKontextPipeline's rule: the preferred Kontext size nearest the image's aspect ratio (resolution:
        that many pixels squared at the image's aspect ratio instead), sides cut to multiples of 16."""
        w0, h0 = width // 16 * 16, height // 16 * 16  # the pipeline's image processor's default size for it
        if resolution:
            w, h = round((resolution * resolution * w0 / h0) ** 0.5), round((resolution * resolution * h0 / w0) ** 0.5)
        else:
            _, w, h = min((abs(w0 / h0 - pw / ph), pw, ph) for pw, ph in PREFERRED)
        return w // 16 * 16, h // 16 * 16

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
