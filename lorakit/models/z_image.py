"""Z-Image (Tongyi-MAI; Turbo and the base model share the transformer): Qwen3 hidden states (the chat template,
the second-to-last layer, padding dropped: captions of any length, no mask) and AutoencoderKL latents with shift and
scale; one single-stream transformer over caption and image tokens (2 noise-refiner layers on the image tokens,
2 context-refiner layers on the caption's, then 30 joint layers). The pipeline calls it with a list of latents
(C, 1, h, w), timestep = 1 - sigma, a list of captions, and steps with the negated output: the velocity is -out.

Z-Image-Turbo is step-distilled (8 steps, no classifier-free guidance). A LoRA trained on it directly learns
against the distilled model and slowly undoes the distillation (samples then need more steps); train on the base
model where it is published, or merge a de-distillation ("training") adapter into the base first and leave it out
at inference — see docs/families.md.
"""

from __future__ import annotations

from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.shift_scale import ShiftScaleLatents

_BLOCK_SAME = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention_norm1", "attention_norm2",
               "ffn_norm1", "ffn_norm2", "adaLN_modulation.0")


def _block(prefix: str) -> tuple[NativeName, ...]:
    """A transformer block's original names (ComfyUI's NextDiT model): q, k, v fused in attention.qkv."""
    p = prefix + ".{i}."
    return (NativeName(p + "attention.qkv", (p + "attention.to_q", p + "attention.to_k", p + "attention.to_v")),
            NativeName(p + "attention.out", (p + "attention.to_out.0",)),
            NativeName(p + "attention.q_norm", (p + "attention.norm_q",)),
            NativeName(p + "attention.k_norm", (p + "attention.norm_k",)),
            *(NativeName(p + m, (p + m,)) for m in _BLOCK_SAME))


# the original checkpoint's names (what ComfyUI loads; comfy/utils.py z_image_to_diffusers maps diffusers' names
# onto them): fused qkv, the one patch size's embedder and final layer without the "2-1" key
Z_IMAGE_NATIVE = (*_block("layers"), *_block("noise_refiner"), *_block("context_refiner"),
                  NativeName("x_embedder", ("all_x_embedder.2-1",)),
                  NativeName("final_layer.linear", ("all_final_layer.2-1.linear",)),
                  NativeName("final_layer.adaLN_modulation.1", ("all_final_layer.2-1.adaLN_modulation.1",)),
                  NativeName("cap_embedder.0", ("cap_embedder.0",)), NativeName("cap_embedder.1", ("cap_embedder.1",)),
                  NativeName("t_embedder.mlp.0", ("t_embedder.mlp.0",)),
                  NativeName("t_embedder.mlp.2", ("t_embedder.mlp.2",)))


class ZImageAdapter(ShiftScaleLatents, Adapter):
    layout = "flat"
    max_controls = 0
    guidance = "cfg"
    guidance_arg = "guidance_scale"
    lora_presets = LoraPresets(
        attention=("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"),
        mlp=("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
        io=("all_x_embedder.2-1", "all_final_layer.2-1.linear", "all_final_layer.2-1.adaLN_modulation.1"))
    published = Published(hidden=3840, blocks=34, params=6.15e9, text_tokens=512,
                          source="Z-Image-Turbo transformer/config.json (30 layers + 2 noise and 2 context "
                                 "refiner layers, dim 3840)")
    # one stream of caption (padded to 32) + image tokens, 30 heads of 128; a mask only when captions of one batch
    # differ in length
    attention_cases = (AttentionCase("512px", 1024 + 128, False, heads=30),
                       AttentionCase("1024px", 4096 + 128, False, heads=30),
                       AttentionCase("1024px+mask", 4096 + 128, True, heads=30))
    full_config = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                       n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                       rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512))
    native_names = Z_IMAGE_NATIVE
    lora_marks = (r"\.feed_forward\.w[123]$", r"^all_x_embedder\.", r"^(noise|context)_refiner\.")
    text_parts = ("text_encoder", "tokenizer")
    max_sequence_length = 512
    temporal = 1
    # ComfyUI's Lumina2 branch: z_image_to_diffusers's diffusers names under these prefixes, into the fused weights
    comfy_diffusers_prefixes = ("diffusion_model.", "transformer.", "lycoris_", "")

    def encode_prompts(self, texts, controls=None):
        import torch

        self.load(self.text_parts)
        with torch.no_grad():
            embeds, _ = self.pipeline().encode_prompt(prompt=list(texts), do_classifier_free_guidance=False,
                                                      max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": e} for e in embeds]  # already without padding

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for latents x_t (B, 16, h, w), as ZImagePipeline calls the transformer: one (C, 1, h, w)
        latent and one unpadded caption per item, timestep = 1 - sigma; the velocity is the negated output."""
        import torch

        dev, dt = x_t.device, x_t.dtype
        embeds = text["prompt_embeds"].to(dev, dt)
        mask = text.get("prompt_embeds_mask")
        caps = [embeds[i][mask[i].to(dev).bool()] if mask is not None else embeds[i] for i in range(len(embeds))]
        out = transformer(list(x_t.unsqueeze(2).unbind(0)), (1 - sigmas.float()).to(dev), caps,
                          return_dict=False)[0]
        return -torch.stack(out, dim=0)[:, :, 0]

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        side = resolution // 8
        latents = torch.randn(1, config["in_channels"], side, side, generator=generator)
        text = {"prompt_embeds": torch.randn(1, text_len, config["cap_feat_dim"], generator=generator)}
        return Batch(["synthetic"], latents, text, [])

    def transformer_size(self, config: dict) -> tuple[int, int]:
        return config["dim"], config["n_layers"] + 2 * config.get("n_refiner_layers", 2)

    def attention_model_config(self) -> dict:
        return {**self.full_config, "n_layers": 1, "n_refiner_layers": 1}

    def build_tiny(self, seed: int):
        from diffusers import ZImageTransformer2DModel

        tok = tiny.qwen3_tokenizer()
        tiny.seeded(seed + 10)
        transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                                               n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                               cap_feat_dim=32, axes_dims=[4, 6, 6])
        vae = tiny.flux_vae(seed + 20)  # an AutoencoderKL with 16 latent channels, shift and scale, as Z-Image's
        sched = tiny.flow_scheduler(shift=3.0, use_dynamic_shifting=False)  # Z-Image-Turbo's scheduler config
        return self.pipeline_class()(scheduler=sched, vae=vae, text_encoder=tiny.qwen3_text(tok, seed + 30),
                                     tokenizer=tok, transformer=transformer.eval())


ADAPTER = ZImageAdapter
