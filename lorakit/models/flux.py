"""FLUX.1-dev: T5 sequence + CLIP pooled text embeddings; latents (x - shift) * scale; guidance embedded."""

from __future__ import annotations

from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.shift_scale import ShiftScaleLatents

_D = "transformer_blocks.{i}."
_S = "single_transformer_blocks.{i}."
# The original names FLUX.1 and FLUX.2 share with the same diffusers modules: the double blocks' attention
# projections (fused q, k, v), the latent/text input and output layers, the attention RMSNorms
BFL_SHARED = (
    NativeName("double_blocks.{i}.img_attn.qkv", (_D + "attn.to_q", _D + "attn.to_k", _D + "attn.to_v")),
    NativeName("double_blocks.{i}.img_attn.proj", (_D + "attn.to_out.0",)),
    NativeName("double_blocks.{i}.txt_attn.qkv", (_D + "attn.add_q_proj", _D + "attn.add_k_proj", _D + "attn.add_v_proj")),
    NativeName("double_blocks.{i}.txt_attn.proj", (_D + "attn.to_add_out",)),
    NativeName("img_in", ("x_embedder",)),
    NativeName("txt_in", ("context_embedder",)),
    NativeName("final_layer.linear", ("proj_out",)),
    # the final norm's modulation: BFL stores [scale, shift], diffusers [shift, scale]
    NativeName("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap_halves=True),
    # the attention RMSNorms (no LoRA on them, but ComfyUI's model-diff extracts carry their differences)
    NativeName("double_blocks.{i}.img_attn.norm.query_norm", (_D + "attn.norm_q",), param="scale"),
    NativeName("double_blocks.{i}.img_attn.norm.key_norm", (_D + "attn.norm_k",), param="scale"),
    NativeName("double_blocks.{i}.txt_attn.norm.query_norm", (_D + "attn.norm_added_q",), param="scale"),
    NativeName("double_blocks.{i}.txt_attn.norm.key_norm", (_D + "attn.norm_added_k",), param="scale"),
    NativeName("single_blocks.{i}.norm.query_norm", (_S + "attn.norm_q",), param="scale"),
    NativeName("single_blocks.{i}.norm.key_norm", (_S + "attn.norm_k",), param="scale"),
)
# Black Forest Labs' names (what ComfyUI and kohya use): the fused projections hold several diffusers Linears
FLUX_NATIVE = (
    *BFL_SHARED,
    NativeName("double_blocks.{i}.img_mlp.0", (_D + "ff.net.0.proj",)),
    NativeName("double_blocks.{i}.img_mlp.2", (_D + "ff.net.2",)),
    NativeName("double_blocks.{i}.txt_mlp.0", (_D + "ff_context.net.0.proj",)),
    NativeName("double_blocks.{i}.txt_mlp.2", (_D + "ff_context.net.2",)),
    NativeName("double_blocks.{i}.img_mod.lin", (_D + "norm1.linear",)),
    NativeName("double_blocks.{i}.txt_mod.lin", (_D + "norm1_context.linear",)),
    NativeName("single_blocks.{i}.linear1", (_S + "attn.to_q", _S + "attn.to_k", _S + "attn.to_v", _S + "proj_mlp"),
               split="qkv_mlp"),
    NativeName("single_blocks.{i}.linear2", (_S + "proj_out",)),
    NativeName("single_blocks.{i}.modulation.lin", (_S + "norm.linear",)),
    NativeName("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
    NativeName("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
    NativeName("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    NativeName("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
    NativeName("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
    NativeName("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",)),
)


class FluxAdapter(ShiftScaleLatents, Adapter):
    layout = "flat"
    max_controls = 0
    guidance = "embedded"
    guidance_arg = "guidance_scale"
    lora_presets = LoraPresets(
        attention=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        mlp=("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"),
        io=("x_embedder", "norm_out.linear", "proj_out"))
    published = Published(hidden=3072, blocks=57, params=11.9e9, text_tokens=512,
                          source="FLUX.1-dev transformer/config.json (19 double + 38 single blocks)")
    attention_cases = (AttentionCase("512px", 1536, False), AttentionCase("1024px", 4608, False),
                       AttentionCase("512px single", 1536, False, "single"),
                       AttentionCase("1024px single", 4608, False, "single"))
    full_config = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                       guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    native_names = FLUX_NATIVE
    # (FLUX.2 shares the block and x_embedder names: FLUX.1's single blocks are marked by their own Linears)
    lora_marks = (r"^single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|proj_out|norm\.linear)$", r"\.ff\.net\.",
                  r"\.norm1\.linear$", r"^x_embedder$")
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    max_sequence_length = 512
    temporal = 1
    # ComfyUI's Flux branch: diffusers names ("transformer." regular, "lycoris_" SimpleTuner, "lora_transformer_"
    # OneTrainer, bare for DiffSynth), placed into the BFL weights by row offsets (flux_to_diffusers)
    comfy_diffusers_prefixes = ("transformer.", "lycoris_", "lora_transformer_", "")
    native_fused_ratios = {"linear1": 7, "img_mlp.0": 4, "txt_mlp.0": 4}  # q, k, v + a 4x MLP; a 4x MLP

    def encode_prompts(self, texts, controls=None):
        import torch

        self.load(self.text_parts)
        with torch.no_grad():
            embeds, pooled, _ = self.pipeline().encode_prompt(prompt=list(texts), prompt_2=None,
                                                              max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": embeds[i], "pooled": pooled[i]} for i in range(len(texts))]

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for latents x_t (B, 16, h, w), as FluxPipeline calls the transformer: 2x2-packed latents,
        image/text position ids, timestep = sigma, guidance embedding."""
        return self._velocity(transformer, x_t, sigmas, text, guidance)

    def _velocity(self, transformer, x_t, sigmas, text: dict, guidance: float, extra_tokens=(), extra_ids=()):
        """FLUX's transformer call; extra (packed) tokens and their position ids follow the target's, and only the
        target's tokens of the output are kept."""
        import torch
        from diffusers import FluxPipeline

        b, c, h, w = x_t.shape
        dev, dt = x_t.device, x_t.dtype
        packed = FluxPipeline._pack_latents(x_t, b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, dev, dt)
        embeds = text["prompt_embeds"].to(dev, dt)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=dev, dtype=dt)
        gvec = torch.full((b,), guidance, device=dev, dtype=dt) if transformer.config.guidance_embeds else None
        out = transformer(hidden_states=torch.cat([packed, *extra_tokens], dim=1), timestep=sigmas.to(dev, dt),
                          guidance=gvec, pooled_projections=text["pooled"].to(dev, dt), encoder_hidden_states=embeds,
                          txt_ids=txt_ids, img_ids=torch.cat([img_ids, *extra_ids], dim=0), return_dict=False)[0]
        return FluxPipeline._unpack_latents(out[:, : packed.shape[1]], h * 8, w * 8, 8)

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        c, side = config["in_channels"] // 4, resolution // 8
        latents = torch.randn(1, c, side, side, generator=generator)
        text = {"prompt_embeds": torch.randn(1, text_len, config["joint_attention_dim"], generator=generator),
                "pooled": torch.randn(1, config["pooled_projection_dim"], generator=generator)}
        controls = [torch.randn(1, c, side, side, generator=generator) for _ in range(self.max_controls)]
        return Batch(["synthetic"], latents, text, controls)

    def transformer_size(self, config: dict) -> tuple[int, int]:
        return (config["num_attention_heads"] * config["attention_head_dim"],
                config["num_layers"] + config["num_single_layers"])

    def attention_model_config(self) -> dict:
        return {**self.full_config, "num_layers": 1, "num_single_layers": 1}

    def build_tiny(self, seed: int):
        from diffusers import FluxTransformer2DModel

        clip_tok, t5_tok = tiny.clip_tokenizer(), tiny.t5_tokenizer()
        tiny.seeded(seed + 10)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        sched = tiny.flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                    base_image_seq_len=256, max_image_seq_len=4096)
        return self.pipeline_class()(scheduler=sched, vae=tiny.flux_vae(seed + 20),
                                     text_encoder=tiny.clip_text(clip_tok, seed + 30), tokenizer=clip_tok,
                                     text_encoder_2=tiny.t5_text(t5_tok, seed + 40), tokenizer_2=t5_tok,
                                     transformer=transformer.eval())


ADAPTER = FluxAdapter
