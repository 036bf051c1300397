"""The published sizes of the pipelines' components other than the transformer (whose published config is each
family adapter's `full_config`): text encoders and VAEs as the hub repositories' config.json files give them, and
the names the published files store some classes' tensors under. `full_component` builds one at that size (bench
and the user-path matrix write random-weight model folders from them)."""

from __future__ import annotations

# The published text encoders and VAEs (hub config.json values). Token ids come from the tokenizer written beside.
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu", vocab_size=49408)
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
              relative_attention_max_distance=128, feed_forward_proj="gated-gelu", vocab_size=32128,
              tie_word_embeddings=False)
QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])
# Qwen-Image-2.1's text encoder: Qwen3-VL-8B (hidden size 4096 = the transformer's context_in_dim; 8.77B parameters
# with its vision tower); its hub files name the modules as the installed transformers does
QWEN3_VL_8B_TEXT = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                            "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN3_VL_8B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
                          num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
# Z-Image-Turbo's text encoder: Qwen3-4B's config (its hidden size is the transformer's cap_feat_dim, 2560)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
# FLUX.2-dev's text encoder: Mistral Small 3.1 24B (Mistral3ForConditionalGeneration: Pixtral vision tower + Mistral
# language model; FLUX.2 reads hidden states 10, 20 and 30 of its 40 layers)
MISTRAL_SMALL_31_TEXT = dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000000.0)
MISTRAL_SMALL_31_VISION = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                               num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, rope_theta=10000.0)
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                norm_num_groups=32, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False, sample_size=1024)
# Wan's text encoder: umT5-XXL's encoder (google/umt5-xxl; the Wan-AI -Diffusers repositories' text_encoder)
UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="gated-gelu", vocab_size=256384,
                tie_word_embeddings=False)
# the Wan 2.2 VAE (TI2V-5B): 48 channels, 2x2 patches folded in (16x), residual blocks; the Wan 2.1 VAE (every other
# Wan model) is AutoencoderKLWan()'s defaults
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)
# AutoencoderKLQwenImage(), AutoencoderKLHunyuanVideo() and AutoencoderKLFlux2() defaults are the published configs
SHARD_BYTES = {"diffusers": 10 * 10**9, "transformers": 5 * 10**9}  # as the hub repositories shard them
# Where the published files name a class's tensors otherwise than the installed transformers names its modules
# (transformers renames them while loading): Qwen2.5-VL — Qwen-Image's, Qwen-Image-Edit's and Kandinsky 5's text
# encoder — is stored as `model.*` (the language model) and `visual.*`, as in the Qwen/Qwen-Image text_encoder
# shards, which musubi-tuner also loads by those names. Writing them so makes the synthetic folder exercise the
# renaming path that real checkpoints take.
HUB_NAMES = {"Qwen2_5_VLForConditionalGeneration": (("model.language_model.", "model."), ("model.visual.", "visual."))}


def hub_names(cls_name: str, tensors: dict) -> dict:
    """`tensors` (a module's state dict) under the names the published files of that class use."""
    rules = HUB_NAMES.get(cls_name, ())

    def rename(k: str) -> str:
        return next((old + k[len(new):] for new, old in rules if k.startswith(new)), k)

    return {rename(k): v for k, v in tensors.items()}


def _vision_ids(part) -> dict:
    """A Qwen vision-language encoder's special token ids, as the (tiny) part's config holds them."""
    return {k: getattr(part.config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id")}


def _stats(part) -> dict:
    """A per-channel VAE's latent statistics, as the (tiny) part's config holds them."""
    return {k: list(part.config[k]) for k in ("latents_mean", "latents_std")}


def full_component(name: str, part, tokenizer):
    """The published-size module for a pipeline component (built on the current default device and dtype)."""
    import diffusers
    import transformers

    cls = type(part).__name__
    if cls == "CLIPTextModel":
        ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
        return transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP_L, **ids))
    if cls == "T5EncoderModel":
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   decoder_start_token_id=tokenizer.pad_token_id)
        return transformers.T5EncoderModel(transformers.T5Config(**T5_XXL, **ids))
    if cls == "UMT5EncoderModel":
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   decoder_start_token_id=tokenizer.pad_token_id)
        return transformers.UMT5EncoderModel(transformers.UMT5Config(**UMT5_XXL, **ids))
    if cls == "AutoencoderKLWan":  # the statistics as the tiny one holds them (48 of them for Wan 2.2's)
        return diffusers.AutoencoderKLWan(**(WAN22_VAE if part.config.z_dim == 48 else {}), **_stats(part))
    if cls == "Qwen2_5_VLForConditionalGeneration":
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        ids = _vision_ids(part)
        text = dict(QWEN25_VL_7B_TEXT, bos_token_id=None, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=QWEN25_VL_7B_VISION,
                                            tie_word_embeddings=False, **ids)
        return transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    if cls == "Qwen3VLForConditionalGeneration":
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        ids = _vision_ids(part)
        cfg = transformers.Qwen3VLConfig(text_config=dict(QWEN3_VL_8B_TEXT, pad_token_id=tok.pad_token_id),
                                         vision_config=QWEN3_VL_8B_VISION, tie_word_embeddings=False, **ids)
        return transformers.Qwen3VLForConditionalGeneration(cfg)
    if cls == "AutoencoderKLQwenImage21":  # the published config is the class's defaults; the statistics as
        return diffusers.AutoencoderKLQwenImage21(**_stats(part))  # the tiny one holds them
    if cls == "Qwen3Model":
        return transformers.Qwen3Model(transformers.Qwen3Config(**QWEN3_4B, pad_token_id=tokenizer.pad_token_id))
    if cls == "Qwen3ForCausalLM":  # FLUX.2 klein 4B's text encoder
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_4B, pad_token_id=tokenizer.pad_token_id))
    if cls == "Mistral3ForConditionalGeneration":
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        text = dict(MISTRAL_SMALL_31_TEXT, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id)
        cfg = transformers.Mistral3Config(text_config=text, vision_config=MISTRAL_SMALL_31_VISION,
                                          image_token_index=part.config.image_token_index, spatial_merge_size=2,
                                          tie_word_embeddings=False)
        return transformers.Mistral3ForConditionalGeneration(cfg)
    if cls == "AutoencoderKL":
        return diffusers.AutoencoderKL(**FLUX_VAE)
    if cls in ("AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo", "AutoencoderKLFlux2"):
        return getattr(diffusers, cls)()
    raise ValueError(f"no published config known for {name} ({cls})")
