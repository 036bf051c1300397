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
from lorakit.models.published import SHARD_BYTES, full_component, hub_names


def _tokenizer_for(name: str, pipe):
    """The tokenizer that feeds a text encoder component (text_encoder -> tokenizer, text_encoder_2 -> tokenizer_2)."""
    return getattr(pipe, name.replace("text_encoder", "tokenizer"), None)


def write_model(family: str, out, device: str = "cuda", seed: int = 0, scale: str = "full",
                progress=None, dtype=None) -> dict:
    """Write the family's model folder at `out` (replaced if present). Returns what was written: per component
    its parameters, bytes and seconds, and the totals. `dtype`: the floating-point dtype the weights are stored
    in (the full scale is bf16, as the hub stores these models; the tiny scale keeps float32 unless asked)."""
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
                              if name == "transformer" else full_component(name, part, _tokenizer_for(name, pipe)))
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
        if dtype is not None:
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
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
