"""Kandinsky 5 (T2I and T2V): Qwen2.5-VL hidden states (template prefix dropped) + CLIP pooled;
latents = VAE mean x scaling_factor (the pipelines decode latents / scaling_factor); timestep = sigma x 1000."""

from __future__ import annotations

from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published

_ATTN = ("to_query", "to_key", "to_value", "out_layer")
_VISUAL = (tuple(f"self_attention.{m}" for m in _ATTN) + tuple(f"cross_attention.{m}" for m in _ATTN)
           + ("feed_forward.in_layer", "feed_forward.out_layer", "visual_modulation.out_layer"))
_TEXT = tuple(f"self_attention.{m}" for m in _ATTN) + ("feed_forward.in_layer", "feed_forward.out_layer",
                                                        "text_modulation.out_layer")
_TOP = ("time_embeddings.in_layer", "time_embeddings.out_layer", "text_embeddings.in_layer",
        "pooled_text_embeddings.in_layer", "visual_embeddings.in_layer", "out_layer.modulation.out_layer",
        "out_layer.out_layer", "text_embeddings.norm", "pooled_text_embeddings.norm")
# the attention norms (no LoRA on them; ComfyUI's model-diff extracts carry their differences)
_NORMS = ("query_norm", "key_norm")
# the diffusers port kept the original checkpoints' module names: native names are the diffusers names
K5_NATIVE = (tuple(NativeName(f"visual_transformer_blocks.{{i}}.{m}", (f"visual_transformer_blocks.{{i}}.{m}",))
                   for m in _VISUAL + tuple(f"{a}.{n}" for a in ("self_attention", "cross_attention") for n in _NORMS))
             + tuple(NativeName(f"text_transformer_blocks.{{i}}.{m}", (f"text_transformer_blocks.{{i}}.{m}",))
                     for m in _TEXT + tuple(f"self_attention.{n}" for n in _NORMS))
             + tuple(NativeName(m, (m,)) for m in _TOP))
# Kandinsky 5 Lite transformers (the original repository's dit_params; diffusers config keys)
_COMMON = dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512,
               patch_size=(1, 2, 2), num_text_blocks=2)
T2I_LITE = dict(_COMMON, model_dim=2560, ff_dim=10240, num_visual_blocks=50, axes_dims=(32, 48, 48), visual_cond=False)
T2V_LITE = dict(_COMMON, model_dim=1792, ff_dim=7168, num_visual_blocks=32, axes_dims=(16, 24, 24), visual_cond=True)
# the sizes Kandinsky5T2IPipeline accepts (it resizes anything else to one of them)
T2I_SIZES = ((1024, 1024), (640, 1408), (1408, 640), (768, 1280), (1280, 768), (896, 1152), (1152, 896))


class Kandinsky5Adapter(Adapter):
    max_controls = 0
    guidance = "cfg"
    guidance_arg = "guidance_scale"
    lora_presets = LoraPresets(
        attention=tuple(f"self_attention.{m}" for m in _ATTN) + tuple(f"cross_attention.{m}" for m in _ATTN),
        mlp=("feed_forward.in_layer", "feed_forward.out_layer"),
        io=("visual_embeddings.in_layer", "out_layer.modulation.out_layer", "out_layer.out_layer"))
    native_names = K5_NATIVE
    lora_marks = (r"^(visual|text)_transformer_blocks\.",)
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    max_sequence_length = 512
    comfy_diffusers_prefixes = ("", "transformer.")  # ComfyUI's Kandinsky5 branch

    @property
    def layout(self):
        return "video" if self.info.variant == "t2v" else "flat"

    @property
    def temporal(self):
        return 4 if self.info.variant == "t2v" else 1

    @property
    def full_config(self):
        return T2V_LITE if self.info.variant == "t2v" else T2I_LITE

    @property
    def published(self):
        # the blocks keep more for backward than FLUX's (self- and cross-attention, a 4x MLP, each modulated):
        # T2I Lite at 1024² on an H100 held 40.8 GiB uncompiled where 16 values per token and unit estimated 31.1
        # (measured uncompiled: the figure for both)
        if self.info.variant == "t2v":
            return Published(1792, 32, 2.0e9, 512, "Kandinsky 5.0 Video Lite dit_params (1792 wide, 32 visual blocks)",
                             working_set=26.0, working_set_uncompiled=26.0)
        return Published(2560, 50, 6.0e9, 512, "Kandinsky 5.0 Image Lite dit_params (2560 wide, 50 visual blocks)",
                         working_set=26.0, working_set_uncompiled=26.0)

    @property
    def attention_cases(self):
        hd = sum(self.full_config["axes_dims"])  # head size = the rotary axes' sum: 128 (T2I Lite), 64 (T2V Lite)
        heads = self.full_config["model_dim"] // hd
        return (AttentionCase(f"512px d{hd}", 1536, False, head_dim=hd, heads=heads),
                AttentionCase(f"1024px d{hd}", 4608, False, head_dim=hd, heads=heads))

    def call_kwargs(self, width: int, height: int, frames: int = 1) -> dict:
        if self.info.variant == "t2v":
            return {"width": width, "height": height, "num_frames": frames}
        w, h = min(T2I_SIZES, key=lambda s: abs(s[0] / s[1] - width / height))
        return {"width": w, "height": h}  # the T2I pipeline takes only its listed sizes

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
        if self.info.variant != "t2v":
            return super().encode_video(frames)
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

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        c, side = config["in_visual_dim"], resolution // 8
        t = (frames - 1) // self.temporal + 1
        shape = (1, c, t, side, side) if self.layout == "video" else (1, c, side, side)
        text = {"prompt_embeds": torch.randn(1, text_len, config["in_text_dim"], generator=generator),
                "pooled": torch.randn(1, config["in_text_dim2"], generator=generator)}
        return Batch(["synthetic"], torch.randn(shape, generator=generator), text, [])

    def transformer_size(self, config: dict) -> tuple[int, int]:
        return config["model_dim"], config["num_visual_blocks"]

    def attention_model_config(self) -> dict:
        return {**self.full_config, "num_visual_blocks": 1, "num_text_blocks": 1}

    def build_tiny(self, seed: int):
        import torch
        from diffusers import Kandinsky5Transformer3DModel

        video = self.info.variant == "t2v"
        qtok, ctok = tiny.qwen_tokenizer(), tiny.clip_tokenizer()
        tiny.seeded(seed + 10)
        transformer = Kandinsky5Transformer3DModel(in_visual_dim=16, out_visual_dim=16, in_text_dim=32, in_text_dim2=32,
                                                   time_dim=16, patch_size=(1, 2, 2), model_dim=32, ff_dim=64,
                                                   num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
                                                   visual_cond=video)
        with torch.no_grad():  # adaLN-zero modulations start at 0; a trained model's are not (else no block matters)
            for p in transformer.parameters():
                if p.dim() > 1 and not p.any():
                    p.normal_(0.0, 0.05)
        parts = dict(transformer=transformer.eval(), text_encoder=tiny.qwen_vl(qtok, seed + 30),
                     tokenizer=tiny.qwen_processor(qtok), text_encoder_2=tiny.clip_text(ctok, seed + 40),
                     tokenizer_2=ctok)
        if video:
            return self.pipeline_class()(vae=tiny.hunyuan_video_vae(seed + 20),
                                         scheduler=tiny.flow_scheduler(shift=5.0), **parts)
        return self.pipeline_class()(vae=tiny.flux_vae(seed + 20), scheduler=tiny.flow_scheduler(shift=7.0), **parts)


ADAPTER = Kandinsky5Adapter
