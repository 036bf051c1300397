"""FLUX.2 [dev] and [klein] (variants of one adapter): one transformer class (double-stream blocks, then
single-stream blocks whose attention and SwiGLU MLP share one fused input projection `attn.to_qkv_mlp_proj`,
modulation shared by all blocks of a kind), a 32-channel VAE whose latents the pipelines 2x2-patchify to 128
channels and normalise with the VAE's batch-norm statistics (so 16 pixels per latent row/column), and text
embeddings stacked from three hidden layers of a causal language model, padded to 512 tokens and passed whole:

- dev: Mistral Small 3.1 (layers 10, 20, 30) through its processor's chat template with BFL's system message;
  guidance embedded (guidance-distilled).
- klein: Qwen3 (layers 9, 18, 27) through its chat template (thinking off); true classifier-free guidance
  against an empty prompt. The klein checkpoints without "base" in their name are step-distilled (4 steps, no
  guidance): train on klein-base (see docs/families.md).

Positions are 4-axis ids (t, h, w, l): image tokens (0, row, col, 0), text tokens (0, 0, 0, index). The stock
pipelines call the transformer with timestep = sigma and keep the first (target) tokens of its output; their
sampling shift is an empirical mu of the token count and the number of steps (`compute_empirical_mu`).
"""

from __future__ import annotations

from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.flux import BFL_SHARED, FluxAdapter

_D = "transformer_blocks.{i}."
_S = "single_transformer_blocks.{i}."
# Black Forest Labs' names (the original checkpoints, ComfyUI, kohya), as diffusers' own single-file converter
# (convert_flux2_transformer_checkpoint_to_diffusers) maps them: FLUX.1's where the modules are the same
FLUX2_NATIVE = (
    *BFL_SHARED,
    NativeName("double_blocks.{i}.img_mlp.0", (_D + "ff.linear_in",)),
    NativeName("double_blocks.{i}.img_mlp.2", (_D + "ff.linear_out",)),
    NativeName("double_blocks.{i}.txt_mlp.0", (_D + "ff_context.linear_in",)),
    NativeName("double_blocks.{i}.txt_mlp.2", (_D + "ff_context.linear_out",)),
    # one Linear in both layouts: q, k, v and the SwiGLU's gate and value rows stay fused
    NativeName("single_blocks.{i}.linear1", (_S + "attn.to_qkv_mlp_proj",)),
    NativeName("single_blocks.{i}.linear2", (_S + "attn.to_out",)),
    NativeName("time_in.in_layer", ("time_guidance_embed.timestep_embedder.linear_1",)),
    NativeName("time_in.out_layer", ("time_guidance_embed.timestep_embedder.linear_2",)),
    NativeName("guidance_in.in_layer", ("time_guidance_embed.guidance_embedder.linear_1",)),
    NativeName("guidance_in.out_layer", ("time_guidance_embed.guidance_embedder.linear_2",)),
    NativeName("double_stream_modulation_img.lin", ("double_stream_modulation_img.linear",)),
    NativeName("double_stream_modulation_txt.lin", ("double_stream_modulation_txt.linear",)),
    NativeName("single_stream_modulation.lin", ("single_stream_modulation.linear",)),
)

# The published transformers (hub config.json): FLUX.2-dev (32B) and FLUX.2-klein-base-4B (klein-base-9B:
# 8 + 24 blocks of 4096, joint_attention_dim 12288)
DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
           num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
           axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)
KLEIN_4B = dict(DEV, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                guidance_embeds=False)
# bf16 values per token and hidden unit a block keeps for backward: FLUX.2 [dev] at 1024² on an H200 peaked 76.6
# GiB with 13 of 56 blocks keeping theirs (compiled) and 105.2 with 36 (uncompiled: the dgx-spark profile), cuDNN
# attention: 1.24 GiB more per block kept, 24.6 values, one figure for both ways, covering each point by 6-7 GiB
# (FLUX.1's 16 ran it 11 GiB out of memory under the dgx-spark profile). klein-base-4B keeps
# less (18: 16.2 GiB at its peak with no block recomputed under the rtx4090 profile, H100)
WORKING_SET = 25.0
TEXT_LAYERS = {"dev": (10, 20, 30), "klein": (9, 18, 27)}  # the pipelines' text_encoder_out_layers
DEFAULT_STEPS = 50  # the pipelines' num_inference_steps: the training shift's empirical mu is taken there


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The FLUX.2 pipelines' sampling shift (`compute_empirical_mu`, from BFL's flux2 sampling code): two lines
    fitted at 10 and 200 steps, interpolated in the step count; above 4300 tokens the 200-step line alone."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    m_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


REFERENCE_AREA = 1024 * 1024  # the pipelines shrink a larger reference image to this area (aspect kept)
MAX_REFERENCES = 4  # reference images per item lorakit trains with (the pipelines take more, at a token cost each)


class Flux2Adapter(Adapter):
    guidance_arg = "guidance_scale"
    lora_presets = LoraPresets(
        # the single blocks have no attention-only Linear: their fused input and output projections carry the
        # attention (and the MLP) — DiffSynth-Studio's FLUX.2 LoRA examples train these with the attention too
        attention=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                   "attn.to_qkv_mlp_proj", "attn.to_out"),
        mlp=("ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"),
        io=("x_embedder", "norm_out.linear", "proj_out"))
    native_names = FLUX2_NATIVE
    lora_marks = (r"\.attn\.to_qkv_mlp_proj$", r"\.ff(_context)?\.linear_(in|out)$", r"^time_guidance_embed\.",
                  r"_modulation(_img|_txt)?\.linear$")
    max_sequence_length = 512
    temporal = 1
    vae_factor = 16  # 8x VAE, then 2x2 patches folded into channels
    latent_channels = 128
    # ComfyUI's Flux branch (flux_to_diffusers, applied to FLUX.2 models too): diffusers names under these
    # prefixes, for the names it maps (`comfy_diffusers_names`); the native names always
    comfy_diffusers_prefixes = ("transformer.", "lycoris_", "lora_transformer_", "")
    native_alpha_keys = False  # diffusers reads FLUX.2's "diffusion_model." files (ai-toolkit's) without alphas
    native_fused_ratios = {"linear1": 9, "img_mlp.0": 6, "txt_mlp.0": 6}  # q, k, v + SwiGLU gate and value (3x)
    # What that map holds for FLUX.2 (read from ComfyUI's issue #11926 / PR #11981, January 2026): the FLUX.1
    # double-block attention names, the single blocks' to_qkv_mlp_proj -> linear1 and attn.to_out -> linear2,
    # and FLUX.1's top-level names that FLUX.2 kept. The double blocks' ff.linear_in/out, the shared modulations
    # and the time embedder are not in it: `lorakit convert --to comfyui` writes their native names.
    comfy_diffusers_names = (r"^transformer_blocks\.\d+\.attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)$",
                             r"^single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)$",
                             r"^(x_embedder|context_embedder|proj_out|norm_out\.linear)$")

    # ------------------------------------------------------------------ variant facts

    @property
    def klein(self) -> bool:
        return self.info.variant.startswith("klein")

    @property
    def edit(self) -> bool:
        """The -edit families: the target image conditioned on reference images (the pipelines' `image=`)."""
        return self.info.variant.endswith("-edit")

    @property
    def layout(self) -> str:
        return "edit" if self.edit else "flat"

    @property
    def max_controls(self) -> int:
        return MAX_REFERENCES if self.edit else 0

    @property
    def guidance(self) -> str:
        return "cfg" if self.klein else "embedded"

    @property
    def full_config(self) -> dict:
        return dict(KLEIN_4B if self.klein else DEV)

    @property
    def published(self) -> Published:
        if self.klein:
            return Published(hidden=3072, blocks=25, params=3.9e9, text_tokens=512, working_set=18.0,
                             source="FLUX.2-klein-base-4B transformer/config.json (5 double + 20 single blocks)")
        return Published(hidden=6144, blocks=56, params=32.2e9, text_tokens=512, working_set=WORKING_SET,
                         working_set_uncompiled=WORKING_SET,  # one figure for both (above)
                         source="FLUX.2-dev transformer/config.json (8 double + 48 single blocks)")

    @property
    def attention_cases(self) -> tuple[AttentionCase, ...]:
        heads = self.full_config["num_attention_heads"]  # 512 text tokens + the image's, no mask
        return (AttentionCase("512px", 1024 + 512, False, heads=heads),
                AttentionCase("1024px", 4096 + 512, False, heads=heads))

    @property
    def text_parts(self) -> tuple[str, ...]:
        return ("text_encoder", "tokenizer")

    # ------------------------------------------------------------------ conventions

    def shift_mu(self, image_seq_len: int, scheduler_config: dict, steps: int | None = None) -> float | None:
        """The pipelines' empirical mu (training: at their default 50 steps)."""
        return empirical_mu(image_seq_len, steps or DEFAULT_STEPS)

    def control_size(self, width: int, height: int, resolution: int | None = None) -> tuple[int, int]:
        """As the pipelines size a reference image: shrunk to 1024² area when larger (`resolution`: that area
        instead), then each side down to a multiple of 16 (centre-cropped to it)."""
        if not self.edit:
            return super().control_size(width, height, resolution)
        area = resolution * resolution if resolution else REFERENCE_AREA
        if width * height > area:
            scale = (area / (width * height)) ** 0.5
            width, height = int(width * scale), int(height * scale)
        return width // 16 * 16, height // 16 * 16

    def encode_controls(self, images: list, resolution: int | None = None) -> list:
        """Reference images (PIL) -> one normalised latent (128, h, w) each, prepared as the pipelines prepare
        them: shrunk with Lanczos to the area, resized to cover the 16-multiple size and centre-cropped."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        proc = Flux2ImageProcessor(vae_scale_factor=self.vae_factor)
        area = resolution * resolution if resolution else REFERENCE_AREA
        out = []
        for im in images:
            im = im.convert("RGB")
            if im.width * im.height > area:
                im = proc._resize_to_target_area(im, area)
            w, h = im.width // 16 * 16, im.height // 16 * 16
            out.append(self.encode_images(proc.preprocess(im, height=h, width=w, resize_mode="crop"))[0])
        return out

    def encode_prompts(self, texts, controls=None):
        import torch

        self.load(self.text_parts)
        with torch.no_grad():
            embeds, _ = self.pipeline().encode_prompt(prompt=list(texts), max_sequence_length=self.max_sequence_length,
                                                      text_encoder_out_layers=TEXT_LAYERS["klein" if self.klein else "dev"])
        return [{"prompt_embeds": e} for e in embeds]  # the whole padded sequence: the pipelines pass no mask

    def encode_images(self, pixels):
        """pixels -> the VAE's mode, 2x2-patchified to 128 channels, normalised by its batch-norm statistics."""
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        pipe = self.pipeline_class()
        with torch.no_grad():
            lat = pipe._patchify_latents(vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())
        mean, std = self._bn(vae, lat)
        return (lat - mean) / std

    def decode_latents(self, latents):
        import torch

        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        with torch.no_grad():
            lat = latents.to(vae.device, vae.dtype)
            mean, std = self._bn(vae, lat)
            return vae.decode(self.pipeline_class()._unpatchify_latents(lat * std + mean)).sample

    @staticmethod
    def _bn(vae, like):
        import torch

        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for latents x_t (B, 128, h, w), as the FLUX.2 pipelines call the transformer: tokens in
        row-major order with (0, row, col, 0) ids, reference images' tokens after them with (10 + 10 k, row, col,
        0), text ids (0, 0, 0, index), timestep = sigma, the guidance embedding where the transformer has one; the
        target's tokens of the output."""
        import torch

        b, c, h, w = x_t.shape
        dev, dt = x_t.device, x_t.dtype
        tokens = [x_t.reshape(b, c, h * w).permute(0, 2, 1)]
        ids = [torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))]
        for k, ref in enumerate(controls or []):
            ref = ref.to(dev, dt)
            rh, rw = ref.shape[-2:]
            tokens.append(ref.reshape(b, c, rh * rw).permute(0, 2, 1))
            ids.append(torch.cartesian_prod(torch.tensor([10 + 10 * k]), torch.arange(rh), torch.arange(rw),
                                            torch.arange(1)))
        img_ids = torch.cat(ids)
        embeds = text["prompt_embeds"].to(dev, dt)
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                       torch.arange(embeds.shape[1]))
        gvec = torch.full((b,), guidance, device=dev, dtype=dt) if transformer.config.guidance_embeds else None
        out = transformer(hidden_states=torch.cat(tokens, dim=1), encoder_hidden_states=embeds,
                          timestep=sigmas.to(dev, dt),
                          img_ids=img_ids.expand(b, -1, -1).to(dev), txt_ids=txt_ids.expand(b, -1, -1).to(dev),
                          guidance=gvec, return_dict=False)[0]
        return out[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        side = resolution // self.vae_factor
        latents = torch.randn(1, config["in_channels"], side, side, generator=generator)
        text = {"prompt_embeds": torch.randn(1, text_len, config["joint_attention_dim"], generator=generator)}
        refs = [torch.randn(1, config["in_channels"], side, side, generator=generator) for _ in range(self.max_controls)]
        return Batch(["synthetic"], latents, text, refs)

    # the transformer's size and one-block config read as FLUX.1's (the same config keys)
    transformer_size = FluxAdapter.transformer_size
    attention_model_config = FluxAdapter.attention_model_config

    def build_tiny(self, seed: int):
        from diffusers import Flux2Transformer2DModel

        layers = TEXT_LAYERS["klein" if self.klein else "dev"]
        if self.klein:
            tok = tiny.qwen3_tokenizer()
            text = tiny.qwen3_causal(tok, seed + 30, layers=max(layers) + 1)
        else:
            tok = tiny.mistral3_processor()
            text = tiny.mistral3(tok, seed + 30, layers=max(layers) + 1)
        hidden = text.config.get_text_config().hidden_size
        tiny.seeded(seed + 10)
        # 16 latent channels (64 once patchified) instead of 32: at 128 the tiny model cannot pass enough of x_t
        # through a rank-16 LoRA on its in/out layers to show overfitting (the published VAE has 32)
        transformer = Flux2Transformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=hidden * len(layers), timestep_guidance_channels=32,
                                              axes_dims_rope=(4, 4, 4, 4), guidance_embeds=not self.klein)
        sched = tiny.flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                    base_image_seq_len=256, max_image_seq_len=4096)
        kw = {"is_distilled": False} if self.klein else {}
        return self.pipeline_class()(scheduler=sched, vae=tiny.flux2_vae(seed + 20), text_encoder=text, tokenizer=tok,
                                     transformer=transformer.eval(), **kw)


ADAPTER = Flux2Adapter
