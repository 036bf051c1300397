"""Wan 2.1 / 2.2 (text-to-video, image-to-video, the 5B TI2V): umT5 hidden states padded with zeros to 512 tokens
(the transformer attends to the padding: no mask), AutoencoderKLWan latents normalised by the VAE's per-channel
mean and std, timestep = sigma x 1000, the flow-matching velocity as the output.

Wan 2.2 A14B is two experts of one architecture: `transformer` denoises the high-noise part of the trajectory
(timesteps >= boundary_ratio x 1000), `transformer_2` the rest; a LoRA is trained for one expert (`model.expert`),
on sigmas drawn only in that expert's range, and applies to that expert (ComfyUI: the model node of that expert;
diffusers: `load_lora_weights(..., load_into_transformer_2=True)` for the low-noise one). The I2V model takes the
first frame as a condition: 4 mask channels + the VAE latents of [first frame, zeros...] concatenated to the noisy
latents (36 input channels). TI2V-5B (one transformer, the Wan 2.2 VAE: 48 channels, 16x) takes one timestep per
token (`expand_timesteps`); lorakit trains it text-to-video.
"""

from __future__ import annotations

from lorakit.errors import ConfigError
from lorakit.models import tiny
from lorakit.models.base import Adapter
from lorakit.models.batch import Batch
from lorakit.models.facts import AttentionCase, LoraPresets, NativeName, Published
from lorakit.models.shift_scale import decode_per_channel, encode_per_channel

_ATTN = (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))
# the original checkpoints' names (Wan-AI's WanModel; ComfyUI's comfy/ldm/wan/model.py keeps them): diffusers'
# conversion script read backwards
WAN_NATIVE = (tuple(NativeName(f"blocks.{{i}}.{side}.{o}", (f"blocks.{{i}}.{attn}.{d}",))
                    for attn, side in (("attn1", "self_attn"), ("attn2", "cross_attn")) for d, o in _ATTN)
              + tuple(NativeName(f"blocks.{{i}}.{side}.{n}", (f"blocks.{{i}}.{attn}.{n}",))
                      for attn, side in (("attn1", "self_attn"), ("attn2", "cross_attn")) for n in ("norm_q", "norm_k"))
              + (NativeName("blocks.{i}.ffn.0", ("blocks.{i}.ffn.net.0.proj",)),
                 NativeName("blocks.{i}.ffn.2", ("blocks.{i}.ffn.net.2",)),
                 NativeName("blocks.{i}.norm3", ("blocks.{i}.norm2",)),  # the cross-attention norm
                 NativeName("patch_embedding", ("patch_embedding",)),
                 NativeName("text_embedding.0", ("condition_embedder.text_embedder.linear_1",)),
                 NativeName("text_embedding.2", ("condition_embedder.text_embedder.linear_2",)),
                 NativeName("time_embedding.0", ("condition_embedder.time_embedder.linear_1",)),
                 NativeName("time_embedding.2", ("condition_embedder.time_embedder.linear_2",)),
                 NativeName("time_projection.1", ("condition_embedder.time_proj",)),
                 NativeName("head.head", ("proj_out",))))
# the published transformers (config.json of Wan-AI's -Diffusers repositories)
A14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
I2V_A14B = dict(A14B, in_channels=36)
TI2V_5B = dict(A14B, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30)
# the pipelines' boundary_ratio (model_index.json): the high-noise expert takes timesteps >= this x 1000
BOUNDARY = {"2.2-t2v": 0.875, "2.2-i2v": 0.9}
EXPERT_PART = {"high": "transformer", "low": "transformer_2"}


class WanAdapter(Adapter):
    layout = "video"
    max_controls = 0
    guidance = "cfg"
    guidance_arg = "guidance_scale"
    lora_presets = LoraPresets(
        attention=tuple(f"{a}.{d}" for a in ("attn1", "attn2") for d, _ in _ATTN),
        mlp=("ffn.net.0.proj", "ffn.net.2"),
        # the patch embedder is a Conv3d: the Linear layers between the timestep and every block's modulation, and
        # the output projection
        io=("condition_embedder.time_embedder.linear_2", "condition_embedder.time_proj", "proj_out"))
    native_names = WAN_NATIVE
    lora_marks = (r"^blocks\.\d+\.attn[12]\.", r"^blocks\.\d+\.ffn\.net\.", r"^condition_embedder\.")
    text_parts = ("text_encoder", "tokenizer")
    max_sequence_length = 512
    temporal = 4
    # ComfyUI's WAN21 model reads the original names only ("diffusion_model.<native>", "lora_unet_<native>"):
    # lorakit writes Wan LoRAs in that layout, which diffusers' Wan loader converts too
    comfy_diffusers_prefixes = ()
    lora_file_layout = "comfyui"

    @property
    def full_config(self):
        return {"2.2-i2v": I2V_A14B, "2.2-ti2v": TI2V_5B}.get(self.info.variant, A14B)

    @property
    def first_frame(self):
        return self.info.variant == "2.2-i2v"

    @property
    def experts(self) -> tuple[str, ...]:
        """The experts a LoRA can be trained for (Wan 2.2 A14B: high- and low-noise; one transformer: none)."""
        return ("high", "low") if self.info.variant in BOUNDARY else ()

    @property
    def vae_factor(self):
        return 16 if self.info.variant == "2.2-ti2v" else 8

    @property
    def latent_channels(self):
        return 48 if self.info.variant == "2.2-ti2v" else 16

    @property
    def published(self):
        if self.info.variant == "2.2-ti2v":
            return Published(3072, 30, 5.0e9, 512, "Wan2.2-TI2V-5B-Diffusers transformer/config.json (3072 wide, "
                                                   "30 blocks)")
        return Published(5120, 40, 14.3e9, 512, "Wan2.2-T2V-A14B-Diffusers transformer/config.json, each expert "
                                                "(5120 wide, 40 blocks)")

    @property
    def attention_cases(self):
        heads = self.full_config["num_attention_heads"]
        per_frame = (480 // 16) * (832 // 16) if self.info.variant != "2.2-ti2v" else (704 // 32) * (1280 // 32)
        return (AttentionCase("480p 17 frames", per_frame * 5, False, heads=heads),
                AttentionCase("480p 81 frames", per_frame * 21, False, heads=heads))

    # ------------------------------------------------------------------ experts

    def boundary(self) -> float | None:
        """The pipeline's boundary_ratio (model_index.json; the published value without a folder), None for one
        transformer."""
        if self.info.variant not in BOUNDARY:
            return None
        value = self.index.get("boundary_ratio") if self.index else None
        return float(value) if isinstance(value, (int, float)) else BOUNDARY[self.info.variant]

    def trained_part(self, expert: str | None = None) -> str:
        if not self.experts:
            return super().trained_part(expert)
        return EXPERT_PART[self.expert(expert)]

    def expert(self, expert: str | None) -> str | None:
        """The expert a run trains: the one named, else the low-noise expert (the stage that draws the details a
        style or a likeness lives in)."""
        if not self.experts:
            return super().expert(expert)
        if expert not in (None, *self.experts):
            raise ConfigError([f"model.expert: {expert!r} is not an expert of {self.family}"],
                              hint="high (the high-noise expert: layout, motion) or low (details)")
        return expert or "low"

    def sigma_range(self, expert: str | None = None) -> tuple[float, float]:
        """The sigmas the trained expert denoises at sampling time: [boundary, 1] for the high-noise expert,
        [0, boundary) for the low-noise one."""
        b = self.boundary()
        if b is None:
            return (0.0, 1.0)
        return (b, 1.0) if self.expert(expert) == "high" else (0.0, b)

    # ------------------------------------------------------------------ text, latents

    def call_kwargs(self, width: int, height: int, frames: int = 1) -> dict:
        return {"width": width, "height": height, "num_frames": frames}

    def encode_prompts(self, texts, controls=None):
        import torch
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        self.load(self.text_parts)
        pipe = self.pipeline()
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(prompt=list(texts), do_classifier_free_guidance=False,
                                           max_sequence_length=self.max_sequence_length)
        mask = pipe.tokenizer([prompt_clean(t) for t in texts], padding="max_length",
                              max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
                              return_attention_mask=True, return_tensors="pt").attention_mask
        lengths = mask.gt(0).sum(dim=1).tolist()
        return [{"prompt_embeds": embeds[i, :lengths[i]]} for i in range(len(texts))]  # the zero padding dropped

    def encode_video(self, frames):
        """frames (B, 3, T, H, W) in [-1, 1] -> (B, C, T', h, w), normalised as the pipelines normalise."""
        self.load((self.vae_part,))
        return encode_per_channel(self.parts[self.vae_part], frames)

    def encode_images(self, pixels):
        return self.encode_video(pixels.unsqueeze(2))[:, :, 0]

    def encode_clip_condition(self, frames):
        """I2V: the first frame's condition for a clip (B, 3, T, H, W) as WanImageToVideoPipeline builds it — 4
        mask channels (1 on the first frame's 4 latent sub-frames) + the normalised latents of [first frame,
        zeros]. Other variants: None."""
        import torch

        if self.info.variant != "2.2-i2v":
            return None
        b, _, t, h, w = frames.shape
        video = torch.cat([frames[:, :, :1], frames.new_zeros(b, 3, t - 1, h, w)], dim=2)
        lat = self.encode_video(video)
        lt, lh, lw = lat.shape[2:]
        mask = torch.ones(b, 1, t, lh, lw, dtype=lat.dtype, device=lat.device)
        mask[:, :, 1:] = 0
        first = mask[:, :, :1].repeat_interleave(self.temporal, dim=2)
        mask = torch.cat([first, mask[:, :, 1:]], dim=2).view(b, -1, self.temporal, lh, lw).transpose(1, 2)
        return torch.cat([mask, lat], dim=1)

    def decode_latents(self, latents):
        """Latents (B, C, h, w) or clips (B, C, T, h, w) -> pixels in [-1, 1] (a clip: its middle frame; an I2V
        condition, mask channels first: its first frame)."""
        self.load((self.vae_part,))
        vae = self.parts[self.vae_part]
        if latents.shape[1] == vae.config.z_dim + 4:  # an I2V condition: the first frame it holds
            latents = latents[:, 4:, :1]
        out = decode_per_channel(vae, latents if latents.dim() == 5 else latents.unsqueeze(2))
        return out[:, :, out.shape[2] // 2]

    # ------------------------------------------------------------------ the transformer call

    def predict(self, transformer, x_t, sigmas, text: dict, guidance: float = 1.0, controls=None):
        """The velocity for x_t ((B, C, T, h, w) clips or (B, C, h, w) images), as the Wan pipelines call the
        transformer: text padded with zeros to 512 tokens, timestep = sigma x 1000 (TI2V-5B: one per token), the
        I2V condition (`controls[0]`) concatenated on the channels."""
        import torch

        video = x_t.dim() == 5
        x = x_t if video else x_t.unsqueeze(2)
        dev, dt = x.device, x.dtype
        emb = text["prompt_embeds"].to(dev, dt)
        mask = text.get("prompt_embeds_mask")
        if mask is not None:  # a batch of captions of several lengths: the pipeline's zeros where it pads
            emb = emb * mask.to(dev, dt).unsqueeze(-1)
        n = max(self.max_sequence_length, emb.shape[1])
        emb = torch.cat([emb, emb.new_zeros(emb.shape[0], n - emb.shape[1], emb.shape[2])], dim=1)
        inp = x
        if controls:
            cond = controls[0].to(dev, dt)
            inp = torch.cat([x, cond if cond.dim() == 5 else cond.unsqueeze(2)], dim=1)
        t = (sigmas * 1000).to(dev, dt)
        if self.info.variant == "2.2-ti2v":  # expand_timesteps: one timestep per patch token
            p = transformer.config.patch_size
            per = (x.shape[2] // p[0]) * (x.shape[3] // p[1]) * (x.shape[4] // p[2])
            t = t[:, None].expand(-1, per)
        out = transformer(hidden_states=inp, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]
        return out if video else out[:, :, 0]

    def example_inputs(self, config: dict, resolution: int, text_len: int, generator, frames: int = 1):
        import torch

        c, side = config["out_channels"], resolution // self.vae_factor
        t = (frames - 1) // self.temporal + 1
        text = {"prompt_embeds": torch.randn(1, text_len, config["text_dim"], generator=generator)}
        controls = []
        if config["in_channels"] > c:  # I2V: the condition's channels
            controls = [torch.randn(1, config["in_channels"] - c, t, side, side, generator=generator)]
        return Batch(["synthetic"], torch.randn(1, c, t, side, side, generator=generator), text, controls)

    def transformer_size(self, config: dict) -> tuple[int, int]:
        return config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def attention_model_config(self) -> dict:
        return {**self.full_config, "num_layers": 1}

    # ------------------------------------------------------------------ the tiny pipeline

    def build_tiny(self, seed: int):
        import torch
        from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

        v = self.info.variant
        lat = self.latent_channels
        tok = tiny.t5_tokenizer()

        def transformer(k: int):
            tiny.seeded(seed + k)
            tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                       in_channels=lat + (lat + 4 if v == "2.2-i2v" else 0), out_channels=lat,
                                       text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
            with torch.no_grad():  # modulations start near 0 in the published init; a trained model's are not
                for p in tr.parameters():
                    if p.dim() > 1 and not p.any():
                        p.normal_(0.0, 0.05)
            return tr.eval()

        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=5.0 if v == "2.2-ti2v" else 3.0)
        parts = dict(tokenizer=tok, text_encoder=tiny.t5_text(tok, seed + 30, umt5=True),
                     vae=tiny.wan_vae(seed + 20, v), scheduler=sched, transformer=transformer(10))
        if v in BOUNDARY:
            parts.update(transformer_2=transformer(11), boundary_ratio=BOUNDARY[v])
        if v == "2.2-ti2v":
            parts["expand_timesteps"] = True
        return self.pipeline_class()(**parts)


ADAPTER = WanAdapter
