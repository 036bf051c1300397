"""Full-size model folders with random weights, in the hub layout of the published checkpoints.

`write_model(family, out)` writes what a user downloads — `model_index.json`, each component's config and its
weights sharded with an index as the hub repositories shard them, the scheduler config, tokenizers and
processors of the real classes — with the published architectures (the adapter's transformer `full_config`,
and the text encoders and VAEs below) and random weights drawn on the GPU and written through `lorakit.io`.
It is how the whole user path (doctor, cache, train, infer, stock diffusers) is measured at real size on a
machine with no model hub. The tokenizers are lorakit's small trained ones (the real classes; a small
vocabulary): text lengths, padding and every tensor shape are the real ones.

`scale="tiny"` writes the same layout with each component shrunk (CPU tests of this module and its script).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lorakit.io import save_sharded
from lorakit.models.base import family_adapter

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
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                norm_num_groups=32, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False, sample_size=1024)
# AutoencoderKLQwenImage() and AutoencoderKLHunyuanVideo() defaults are the published configs
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


def _full(name: str, part, tokenizer):
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
    if cls == "Qwen2_5_VLForConditionalGeneration":
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        ids = {k: getattr(part.config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                    "vision_end_token_id")}
        text = dict(QWEN25_VL_7B_TEXT, bos_token_id=None, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=QWEN25_VL_7B_VISION,
                                            tie_word_embeddings=False, **ids)
        return transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    if cls == "AutoencoderKL":
        return diffusers.AutoencoderKL(**FLUX_VAE)
    if cls in ("AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo"):
        return getattr(diffusers, cls)()
    raise ValueError(f"no published config known for {name} ({cls})")


def _tokenizer_for(name: str, pipe):
    """The tokenizer that feeds a text encoder component (text_encoder -> tokenizer, text_encoder_2 -> tokenizer_2)."""
    return getattr(pipe, name.replace("text_encoder", "tokenizer"), None)


def write_model(family: str, out, device: str = "cuda", seed: int = 0, scale: str = "full",
                progress=None) -> dict:
    """Write the family's model folder at `out` (replaced if present). Returns what was written: per component
    its parameters, bytes and seconds, and the totals."""
    import shutil

    import torch

    out = Path(out)
    adapter = family_adapter(family)
    torch.manual_seed(seed)
    pipe = adapter.build_tiny(seed)  # the layout, scheduler, tokenizers and processors of the real classes
    if scale == "full":
        _full_processor(pipe)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    report = {"family": family, "scale": scale, "components": {}}
    t_all = time.perf_counter()
    for name, part in pipe.components.items():
        if not isinstance(part, torch.nn.Module):
            continue
        t0 = time.perf_counter()
        torch.manual_seed(seed + len(name))
        if scale == "full":
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(device):
                    module = (getattr(__import__("diffusers"), adapter.info.transformer_class)(**adapter.full_config)
                              if name == "transformer" else _full(name, part, _tokenizer_for(name, pipe)))
            finally:
                torch.set_default_dtype(prev)
        else:
            module = part
        folder = out / name
        kind = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
        for old in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")):
            old.unlink()
        if kind == "diffusers":
            module.save_config(folder)
        else:  # a model built from its config has no `architectures` yet; save_pretrained would set it
            module.config.architectures = [type(module).__name__]
            module.config.save_pretrained(folder)
        tensors = hub_names(type(module).__name__, _unique_tensors(module))
        save_sharded(tensors, folder, base="diffusion_pytorch_model" if kind == "diffusers" else "model",
                     max_shard_bytes=SHARD_BYTES[kind])
        n = sum(t.numel() for t in tensors.values())
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        report["components"][name] = {"class": type(module).__name__, "params": n, "bytes": size,
                                      "seconds": round(time.perf_counter() - t0, 1)}
        if progress:
            progress(name, report["components"][name])
        del module, tensors
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["bytes"] = sum(c["bytes"] for c in report["components"].values())
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    (out / "lorakit_synthetic.json").write_text(json.dumps(report, indent=2))
    return report


def _unique_tensors(module) -> dict:
    """The state dict with each storage once (tied weights: the first name, as the hub files keep one)."""
    seen, out = set(), {}
    for k, v in module.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


def _full_processor(pipe) -> None:
    """Qwen2-VL image processing at the published pixel budget (Qwen2.5-VL's preprocessor_config: 3136 to
    12845056 pixels; the tiny one keeps images small)."""
    for name in ("processor", "tokenizer"):
        proc = getattr(pipe, name, None)
        if type(getattr(proc, "image_processor", None)).__name__.startswith("Qwen2VL"):
            from transformers import Qwen2VLImageProcessor

            proc.image_processor = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056)
