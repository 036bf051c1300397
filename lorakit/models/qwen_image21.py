"""Qwen-Image-2.1: one single-stream, block-causal transformer over the joint text + image sequence.

What the stock pipeline (`QwenImage21Pipeline`) does and lorakit does the same way:
- text: Qwen3-VL's last decoder layer *before* its final norm (the pipeline hooks the norm out), through a raw
  chat template with a system message whose tokens are dropped; each prompt keeps its own length;
- latents: a 64-channel, 16x VAE that reads and writes RGBA (an RGB picture goes in with alpha 1), normalised per
  channel with latents_mean / latents_std, fed to the transformer unpatched (one token per latent: 4096 at 1024²,
  sides a multiple of 32 because the encoder's image slots stand for 2x2 tokens);
- the call: the target's tokens appended after the text, `img_mask` marking their slots (one per 2x2 tokens),
  `img_shapes` for the rotary positions, timestep = sigma, the output's last (target) tokens; text tokens are
  modulated at t = 0 (`causal_condition`), which the transformer does itself from the mask.
Guidance is true classifier-free guidance (`true_cfg_scale`, with a negative prompt), as Qwen-Image's.
"""

from __future__ import annotations

from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.qwen_image import real_rotary
from lorakit.models.shift_scale import decode_per_channel, encode_per_channel

_B = "transformer_blocks.{i}."
_SAME = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.norm_q", "attn.norm_k", "img_mlp.out")
_TOP = ("img_in", "txt_in.in_layer", "txt_in.out_layer", "txt_in.text_norm", "modulation.1", "norm_out.linear",
        "proj_out", "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2")
# The original checkpoint's names (ComfyUI's; diffusers' single-file converter for this class maps them): the
# diffusers names, except that the SwiGLU's gate and up projections are one fused `img_mlp.gate_up`, gate rows first
QWEN21_NATIVE = (*(NativeName(_B + m, (_B + m,)) for m in _SAME),
                 NativeName(_B + "img_mlp.gate_up", (_B + "img_mlp.gate_layer", _B + "img_mlp.proj")),
                 *(NativeName(m, (m,)) for m in _TOP))

# Qwen/Qwen-Image-2.1 transformer/config.json (the class's defaults)
FULL = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
            num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
            causal_condition=True)


class QwenImage21Adapter(Adapter):
    layout = "flat"
    meta_forward = False
    max_controls = 0  # the pipeline also takes condition images (in the prompt); lorakit trains text-to-image
    guidance = "cfg"
    guidance_arg = "true_cfg_scale"
    vae_factor = 16
    latent_channels = 64
    token_pixels = 16  # one transformer token per latent (patch 1): image sides are still multiples of 32
    lora_presets = LoraPresets(
        attention=("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
        mlp=("img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out"),
        io=("img_in", "norm_out.linear", "proj_out"))
    published = Published(hidden=4096, blocks=32, params=7.12e9, text_tokens=512,
                          source="Qwen-Image-2.1 transformer/config.json (32 single-stream blocks of 4096, "
                                 "SwiGLU 3x)")
    # one causal-text + bidirectional-image sequence, 32 heads of 128: the target image attends to every key
    # unmasked (lorakit calls it once per caption length); the text's own causal segment attends with a mask
    attention_cases = (AttentionCase("512px", 1024 + 128, False, heads=32),
                       AttentionCase("1024px", 4096 + 128, False, heads=32),
                       AttentionCase("1024px+mask", 4096 + 128, True, heads=32))
    full_config = FULL
    native_names = QWEN21_NATIVE
    lora_marks = (r"\.img_mlp\.gate_layer$", r"^txt_in\.in_layer$", r"^modulation\.1$")
    text_parts = ("text_encoder", "processor")
    max_sequence_length = 1024  # the pipeline does not cut prompts; the memory estimate counts text_tokens
    temporal = 1
    # ComfyUI's key map for this model is not in the ComfyUI source read for lorakit (2025-10-12): no diffusers
    # names are claimed; `convert lora --to comfyui` writes the original names above, which its generic
    # `diffusion_model.<name>` map takes for any model it loads
    comfy_diffusers_prefixes = ()
    lora_file_layout = "comfyui"  # the original names: diffusers' Qwen-Image LoRA reader strips `diffusion_model.`

    def file_layout(self, modules) -> str:
        """The original names (which ComfyUI and diffusers both read) unless the LoRA is on the SwiGLU's gate or up
        projection: the original checkpoint fuses those into `img_mlp.gate_up`, a name diffusers cannot load, so
        such a file is written in diffusers' names (the run says ComfyUI then needs `convert --to comfyui`)."""
        fused = ("img_mlp.gate_layer", "img_mlp.proj")
        return "diffusers" if any(m.endswith(fused) for m in modules) else self.lora_file_layout

    def forward_flops(self, config: dict, batch) -> float:
        """One forward's FLOPs as FlopCounterMode counts them (its positions and masks come from the slot mask's
        values, so it cannot run on the meta device): per block q, k, v, out and the SwiGLU over all T = L + N
        tokens; attention as the stock processor calls it, the L text queries against their L keys (causal by a
        mask, counted whole) and the N target queries against all T keys; the text and latent projections."""
        d = config["num_attention_heads"] * config["attention_head_dim"]
        c, ctx, r = config["in_channels"], config["context_in_dim"], config["mlp_ratio"]
        n = batch.latents.shape[-2] * batch.latents.shape[-1]
        text = batch.text["prompt_embeds"].shape[1]
        t = n + text
        per_block = 2 * t * (4 * d * d + 3 * d * r * d) + 4 * d * (text * text + n * t)
        edges = 2 * n * c * d + 2 * text * (ctx * d + d * d) + 2 * t * d * c + 2 * 2 * d * 4 * d + 2 * 2 * d * d
        time = 2 * 2 * (256 * d + d * d)
        return float(batch.latents.shape[0] * (config["num_layers"] * per_block + edges) + time)

    def encode_prompts(self, texts, controls=None):
        import torch

        self.load(self.text_parts)
        pipe = self.pipeline()
        out = []
        with torch.no_grad():
            for text in texts:  # one at a time: the pipeline's left padding changes a batch's positions
                embeds, mask, _ = pipe.encode_prompt(prompt=[text])
                n = int(mask[0].sum()) if mask is not None else embeds.shape[1]
                out.append({"prompt_embeds": embeds[0, :n]})
        return out

    def encode_images(self, pixels):
        """RGB pixels (B, 3, H, W) in [-1, 1] -> normalised latents (B, 64, H/16, W/16); alpha 1 (opaque), as the
        pipeline's RGBA conversion of an RGB picture gives."""
        import torch

        self.load((self.vae_part,))
        if pixels.shape[1] == 3:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        return encode_per_channel(self.parts[self.vae_part], pixels.unsqueeze(2))[:, :, 0]

    def decode_latents(self, latents):
        """Normalised latents (B, 64, h, w) -> RGB pixels (B, 3, 16h, 16w) in [-1, 1] (the VAE's alpha left out)."""
        self.load((self.vae_part,))
        return decode_per_channel(self.parts[self.vae_part], latents.unsqueeze(2))[:, :3, 0]

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for x_t (B, 64, h, w), as QwenImage21Pipeline calls the transformer: the latents flattened
        to tokens, the text's slots then one image slot per 2x2 target tokens (`img_mask`), img_shapes, timestep =
        sigma; the output's target tokens.

        Captions of different lengths in one batch run one call per caption, each at its own length: the rotary
        positions of the image follow the text's length (padding moves them), so a padded caption would train
        against other positions than the pipeline samples a single prompt with."""
        import torch

        mask = text.get("prompt_embeds_mask")  # None where nothing is padded (`batch.drop_full_mask`)
        embeds = text["prompt_embeds"]
        lengths = [] if mask is None else mask.bool().sum(dim=1).tolist()
        if all(n == embeds.shape[1] for n in lengths):
            return self._call(transformer, x_t, sigmas, embeds)
        return torch.cat([self._call(transformer, x_t[i:i + 1], sigmas[i:i + 1], embeds[i:i + 1, :n])
                          for i, n in enumerate(lengths)])

    @staticmethod
    def _call(transformer, x_t, sigmas, embeds):
        import torch

        b, c, h, w = x_t.shape
        dev, dt = x_t.device, x_t.dtype
        slots = torch.cat([torch.zeros(b, embeds.shape[1], dtype=torch.bool, device=dev),
                           torch.ones(b, h * w // 4, dtype=torch.bool, device=dev)], dim=1)
        out = transformer(hidden_states=x_t.reshape(b, c, h * w).transpose(1, 2),
                          encoder_hidden_states=embeds.to(dev, dt), timestep=sigmas.to(dev, dt),
                          img_shapes=[[(1, h, w)]] * b, img_mask=slots, return_dict=False)[0][:, -h * w:]
        return out.transpose(1, 2).reshape(b, -1, h, w)

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        side = resolution // self.vae_factor
        latents = torch.randn(1, config["in_channels"], side, side, generator=generator)
        text = {"prompt_embeds": torch.randn(1, text_len, config["context_in_dim"], generator=generator),
                "prompt_embeds_mask": torch.ones(1, text_len, dtype=torch.long)}
        return Batch(["synthetic"], latents, text, [])

    def transformer_size(self, config: dict) -> tuple[int, int]:
        return config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def attention_model_config(self) -> dict:
        return {**self.full_config, "num_layers": 1}

    def before_compile(self, transformer) -> None:
        from diffusers.models.transformers import transformer_qwenimage21

        real_rotary(transformer, transformer_qwenimage21)

    def build_tiny(self, seed: int):
        from diffusers import QwenImage21Transformer2DModel

        tok = tiny.qwen_tokenizer()
        tiny.seeded(seed + 10)
        transformer = QwenImage21Transformer2DModel(in_channels=64, out_channels=64, num_layers=2,
                                                    attention_head_dim=16, num_attention_heads=2, context_in_dim=32,
                                                    mlp_ratio=3, axes_dims_rope=(4, 6, 6))
        sched = tiny.flow_scheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                    time_shift_type="exponential")
        return self.pipeline_class()(scheduler=sched, vae=tiny.qwen_image21_vae(seed + 20),
                                     text_encoder=tiny.qwen3_vl(tok, seed + 30),
                                     processor=tiny.qwen3_vl_processor(tok), transformer=transformer.eval())


ADAPTER = QwenImage21Adapter
