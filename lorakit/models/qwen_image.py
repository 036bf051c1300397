"""Qwen-Image, -Edit and -Edit-Plus (variants of one adapter): Qwen2.5-VL hidden states with the
pipeline's template and dropped prefix (edit: the control image(s) in the prompt); latents normalised
per channel with the VAE's latents_mean / latents_std; true classifier-free guidance."""

from __future__ import annotations

from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.shift_scale import decode_per_channel, encode_per_channel

CONDITION_AREA = 384 * 384  # Edit-Plus: prompt images are resized to this area, as the pipeline does
VAE_AREA = 1024 * 1024  # Edit and Edit-Plus: control images are VAE-encoded at this area, at their aspect ratio

_BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
          "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
          "txt_mlp.net.2", "img_mod.1", "txt_mod.1")
_TOP = ("img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
        "time_text_embed.timestep_embedder.linear_2", "txt_norm")
# the attention RMSNorms: no LoRA on them, but ComfyUI's model-diff extracts carry their differences
_BLOCK_NORMS = ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")
# Qwen-Image was published in diffusers layout: the original (ComfyUI, kohya) names are the diffusers names
QWEN_NATIVE = (tuple(NativeName(f"transformer_blocks.{{i}}.{m}", (f"transformer_blocks.{{i}}.{m}",))
                    for m in _BLOCK + _BLOCK_NORMS)
               + tuple(NativeName(m, (m,)) for m in _TOP))


_FULL = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))


def condition_size(width: int, height: int, area: int = CONDITION_AREA) -> tuple[int, int]:
    """The pipeline's rule: the given area at the image's aspect ratio, sides rounded to 32."""
    import math

    w = math.sqrt(area * width / height)
    h = w / (width / height)
    return round(w / 32) * 32, round(h / 32) * 32


class QwenImageAdapter(Adapter):
    guidance = "cfg"
    guidance_arg = "true_cfg_scale"
    lora_presets = LoraPresets(
        attention=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        mlp=("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
        io=("img_in", "norm_out.linear", "proj_out"))

    @property
    def published(self) -> Published:
        # the Edit models' blocks, uncompiled, keep 25 values per token and unit: Edit-2511 with two controls at
        # 1024² (12,800 tokens counted) under the dgx-spark profile (no compile), H200: 46.1 GiB with every block
        # recomputed, 62.6 / 80.9 / 99.2 with 10 / 20 / 30 keeping theirs, 1.83 GiB each (the compiled figure, 16,
        # ran all three Edit models out of memory at step 1 there); Qwen-Image itself kept ~19 there (70.6 GiB, none
        # recomputed: the default 1.25 x 16 covers it)
        return Published(hidden=3072, blocks=60, params=20.4e9, text_tokens=512,
                         source="Qwen-Image transformer/config.json (60 dual-stream blocks)",
                         working_set_uncompiled=25.0 if self.info.variant else None)

    attention_cases = (AttentionCase("512px+mask", 1536, True), AttentionCase("1024px+mask", 4608, True))
    native_names = QWEN_NATIVE
    lora_marks = (r"\.(img|txt)_(mlp|mod)\.", r"^img_in$", r"^txt_norm")
    max_sequence_length = 1024
    temporal = 1
    comfy_diffusers_prefixes = ("", "transformer.", "lycoris_")  # ComfyUI's QwenImage branch

    @property
    def zero_cond_t(self) -> bool:
        """Qwen-Image-Edit-2511's transformer modulates the control images' tokens at timestep 0 (its
        config.json: zero_cond_t); the stock pipeline's call is the same, the transformer splits by img_shapes."""
        return self.family == "qwen-image-edit-2511"

    @property
    def full_config(self):
        return {**_FULL, **({"zero_cond_t": True} if self.zero_cond_t else {})}

    @property
    def layout(self):
        return "edit" if self.info.variant else "flat"

    @property
    def max_controls(self):
        return {"": 0, "edit": 1, "edit-plus": 3}[self.info.variant]  # Edit-2511 as Edit-Plus

    @property
    def text_parts(self):
        base = ("text_encoder", "tokenizer")
        return base + (("processor",) if self.info.variant else ())

    def control_size(self, width, height, resolution=None):
        if not self.info.variant:
            return super().control_size(width, height, resolution)
        return condition_size(width, height, resolution * resolution if resolution else VAE_AREA)

    def prompt_controls(self, images):
        """Edit: the image at its VAE size (the pipeline prompts with that); Edit-Plus: each image at 384² area."""
        from PIL import Image

        if self.info.variant == "edit":
            return [im.resize(self.control_size(*im.size), Image.LANCZOS) for im in images[:1]]
        return [im.resize(condition_size(*im.size), Image.LANCZOS) for im in images]

    def encode_prompts(self, texts, controls=None):
        """controls: per text, the list of PIL control images as given to the pipeline (edit variants)."""
        import torch

        self.load(self.text_parts)
        pipe = self.pipeline()
        out = []
        with torch.no_grad():
            for i, text in enumerate(texts):  # one at a time: prompts carry different images
                kw = {}
                if self.info.variant:
                    imgs = self.prompt_controls(controls[i])
                    kw["image"] = imgs[0] if self.info.variant == "edit" else imgs
                embeds, mask = pipe.encode_prompt(prompt=[text], max_sequence_length=self.max_sequence_length, **kw)
                n = int(mask[0].sum()) if mask is not None else embeds.shape[1]  # None: no padding
                out.append({"prompt_embeds": embeds[0, :n]})
        return out

    def encode_images(self, pixels):
        self.load((self.vae_part,))
        return encode_per_channel(self.parts[self.vae_part], pixels.unsqueeze(2))[:, :, 0]

    def decode_latents(self, latents):
        """Normalised latents (B, 16, h, w) -> pixels (B, 3, H, W) in [-1, 1]."""
        self.load((self.vae_part,))
        return decode_per_channel(self.parts[self.vae_part], latents.unsqueeze(2))[:, :, 0]

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for x_t (B, 16, h, w), as the Qwen-Image pipelines call the transformer: 2x2-packed
        latents, control latents (edit) packed and appended after the target's tokens, img_shapes for the
        rotary positions, the text mask, timestep = sigma; the output's target tokens only."""
        import torch
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
        mask = text.get("prompt_embeds_mask")
        out = transformer(hidden_states=torch.cat(tokens, dim=1), timestep=sigmas.to(dev, dt),
                          encoder_hidden_states=text["prompt_embeds"].to(dev, dt),
                          encoder_hidden_states_mask=None if mask is None else mask.to(dev),
                          img_shapes=[shapes] * b, return_dict=False)[0][:, :seq]
        return QwenImagePipeline._unpack_latents(out, h * 8, w * 8, 8)[:, :, 0]

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        c, side = config.get("out_channels") or config["in_channels"] // 4, resolution // 8
        latents = torch.randn(1, c, side, side, generator=generator)
        text = {"prompt_embeds": torch.randn(1, text_len, config["joint_attention_dim"], generator=generator),
                "prompt_embeds_mask": torch.ones(1, text_len, dtype=torch.long)}
        n_ctrl = min(self.max_controls, 1)  # bench: one control of the target's size (Edit-Plus: add more by hand)
        controls = [torch.randn(1, c, side, side, generator=generator) for _ in range(n_ctrl)]
        return Batch(["synthetic"], latents, text, controls)

    def transformer_size(self, config: dict) -> tuple[int, int]:
        return config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def attention_model_config(self) -> dict:
        return {**self.full_config, "num_layers": 1}

    def before_compile(self, transformer) -> None:
        real_rotary(transformer)

    def build_tiny(self, seed: int):
        from diffusers import QwenImageTransformer2DModel

        tok = tiny.qwen_tokenizer()
        tiny.seeded(seed + 10)
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2,
                                                  joint_attention_dim=32, guidance_embeds=False,
                                                  axes_dims_rope=(4, 6, 6), zero_cond_t=self.zero_cond_t)
        sched = tiny.flow_scheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                    time_shift_type="exponential")
        parts = dict(scheduler=sched, vae=tiny.qwen_vae(seed + 20), text_encoder=tiny.qwen_vl(tok, seed + 30),
                     tokenizer=tok, transformer=transformer.eval())
        if self.info.variant:
            parts["processor"] = tiny.qwen_processor(tok)
        return self.pipeline_class()(**parts)


ADAPTER = QwenImageAdapter


def real_rotary(transformer, module=None) -> None:
    """The rotary embedding of this transformer's blocks in real arithmetic. Diffusers hands Qwen-Image's blocks
    complex frequencies and rotates queries and keys with a complex product, which inductor cannot generate code
    for ("does not support code generation for complex operators"): each compiled block then leaves that part to
    eager kernels. Here the positional module's output becomes (cos, sin) pairs (`view_as_real`, outside the
    blocks) and the rotation is the same product written out in float32: (a + ib)(c + id) = (ac - bd) + i(ad + bc).
    Only this transformer changes: the rotation function still takes complex frequencies as before, so a stock
    pipeline in the same process computes exactly what it did. `module`: the diffusers module whose
    `apply_rotary_emb_qwen` the blocks call (Qwen-Image's by default; Qwen-Image-2.1 has its own, and its
    positional module returns one tensor rather than a pair)."""
    import torch

    if module is None:
        from diffusers.models.transformers import transformer_qwenimage as module

    def real(freqs):
        if torch.is_tensor(freqs):
            return torch.view_as_real(freqs) if freqs.is_complex() else freqs
        return tuple(real(f) for f in freqs)

    if not getattr(module.apply_rotary_emb_qwen, "lorakit_real", False):
        module.apply_rotary_emb_qwen = _real_or_stock(module.apply_rotary_emb_qwen)
    if not getattr(transformer.pos_embed, "_lorakit_real_rotary", False):
        transformer.pos_embed.register_forward_hook(lambda _module, _args, freqs: real(freqs))
        transformer.pos_embed._lorakit_real_rotary = True


def _real_or_stock(stock):
    def rotary(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        if use_real or freqs_cis.is_complex():
            return stock(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim)
        import torch

        cos, sin = freqs_cis.unsqueeze(1).unbind(-1)  # (S, D/2, 2) -> (S, 1, D/2): broadcast over heads
        a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)  # (B, S, H, D/2): pairs (real, imaginary)
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

    rotary.lorakit_real = True
    return rotary
