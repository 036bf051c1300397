"""The reference a matrix cell compares `lorakit infer` with: the model folder through diffusers' own pipeline and
`load_lora_weights`, same prompt, seed and size, in its own process (`python -m lorakit.bench.stock SPEC-JSON`; it
prints {"peak_gpu_gib", "offload"}).

It is placed as diffusers' users place it, by size (`placement`):
- `none`: resident on the GPU (`pipe.to`), where the weights fit it;
- `model`: `enable_model_cpu_offload`, where they do not (or where matrix lanes share the GPU: `offload` in the
  spec) but the host's available memory holds them — diffusers loads every weight into process memory first;
- `split`: where they fit neither (FLUX.2 [dev]'s 105 GiB on an 80 GB H100 whose host keeps its 60 GiB transformer
  in /dev/shm): the text encoder alone on the GPU for the prompt's embeddings, freed, then the rest of the pipeline
  without it, given the embeddings. Both halves load with `device_map`, one shard at a time through the host."""

from __future__ import annotations

import inspect
import json
import sys

import numpy as np
import psutil
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from lorakit.bench.hub import weight_files
from lorakit.convert.lora import read
from lorakit.data.images import open_image
from lorakit.data.video import write_clip
from lorakit.dtypes import float32_inside, slow_on_cpu
from lorakit.models.base import component_entry, family_adapter
from lorakit.models.grid import sampling_steps

# what a pipeline's encode_prompt returns, in order, that its __call__ takes back (FLUX.1: embeddings, pooled, the
# text ids it makes again itself; FLUX.2: embeddings, text ids; Qwen-Image: embeddings, mask)
CARRIED = ("prompt_embeds", "pooled_prompt_embeds", "prompt_embeds_mask")


def placement(size: int, gpu: int | None, host: int | None, offload: bool) -> str:
    """`none`, `model` or `split` (the module docstring) for `size` bytes of weights; `gpu`: the GPU's bytes (None:
    no GPU, resident on the CPU); `host`: the host's available bytes (the page cache counts, /dev/shm's files do not:
    RAM only swap could free)."""
    if gpu is None:
        return "none"
    if size <= 0.85 * gpu and not offload:
        return "none"
    return "split" if host is not None and size > 0.9 * host else "model"


def _encoders(model: str) -> tuple[list[str], list[str]]:
    """(the pipeline's text encoders and their tokenizers/processors, the rest of its modules) from model_index.json."""
    config = DiffusionPipeline.load_config(model)
    parts = [n for n, v in config.items() if not n.startswith("_") and component_entry(v) and v[0] is not None]
    text = [n for n in parts if n.startswith(("text_encoder", "tokenizer", "processor"))]
    return text, [n for n in parts if n not in text and n != "scheduler"]


def _embeddings(model: str, rest: list[str], dt, dev: str, prompt: str) -> dict:
    """The prompt's embeddings from the text encoder alone on `dev` (the pipeline without its `rest`), as the
    pipeline's __call__ takes them."""
    enc = DiffusionPipeline.from_pretrained(model, torch_dtype=dt, device_map=dev, **{n: None for n in rest})
    takes = inspect.signature(enc.encode_prompt).parameters
    if "image" in takes:  # the Edit models' encoder reads the control image too: not one text-only pass
        raise SystemExit(f"stock: {type(enc).__name__}'s prompt encoding takes the image; no split placement")
    with torch.no_grad():
        out = enc.encode_prompt(prompt=prompt, device=dev)
    out = out if isinstance(out, tuple) else (out,)
    names = [n for n in CARRIED if n in inspect.signature(type(enc).__call__).parameters]
    embeds = {n: t for n, t in zip(names, out, strict=False)}
    del enc
    if dev == "cuda":
        torch.cuda.empty_cache()
    return embeds


def run(a: dict) -> dict:
    """The stock image (or clip) for the spec `a` (model, lora, family, prompt, steps, seed, width, height, frames,
    image, out, offload; `place` overrides the placement); returns {"peak_gpu_gib", "offload"}."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16  # as `lorakit infer` runs (on the CPU the matrix asks it for bf16 too)
    size = sum(f.stat().st_size for f in weight_files(a["model"]))
    place = a.get("place") or placement(size, torch.cuda.get_device_properties(0).total_memory if dev == "cuda"
                                        else None, psutil.virtual_memory().available, a.get("offload", False))
    ad = family_adapter(a["family"])
    kw = dict(num_inference_steps=a["steps"], generator=torch.Generator().manual_seed(a["seed"]))
    kw.update({k: v for k, v in ad.call_kwargs(a["width"], a["height"], a["frames"]).items() if k != "num_frames"})
    if place == "split":
        text, rest = _encoders(a["model"])
        kw.update(_embeddings(a["model"], rest, dt, dev, a["prompt"]))
        pipe = DiffusionPipeline.from_pretrained(a["model"], torch_dtype=dt, device_map=dev,
                                                 **{n: None for n in text})
    else:
        kw["prompt"] = a["prompt"]
        pipe = DiffusionPipeline.from_pretrained(a["model"], torch_dtype=dt)
        if place == "model":
            pipe.enable_model_cpu_offload()
        else:
            pipe = pipe.to(dev)
    pipe.set_progress_bar_config(disable=True)
    vae = getattr(pipe, ad.vae_part, None)
    if vae is not None and slow_on_cpu(dev, dt):  # as `lorakit infer` runs it on a CPU without bf16 convolutions
        float32_inside(vae)
    _, sigmas, _ = sampling_steps(pipe, a["steps"])  # the steps lorakit infer was asked for, on a model with its own
    if sigmas:  # grid (sample_sigmas) too
        kw["sigmas"] = sigmas
    low = read(a["lora"], arch=ad.arch).facts.get("expert") == "low"  # Wan 2.2 A14B: the low-noise expert's LoRA
    pipe.load_lora_weights(a["lora"], **({"load_into_transformer_2": True} if low else {}))
    if a["image"]:
        imgs = [open_image(p) for p in a["image"]]
        kw["image"] = imgs[0] if ad.max_controls == 1 or ad.first_frame else imgs
    if ad.layout == "video":
        kw["num_frames"] = a["frames"]
    out = pipe(**kw)
    if ad.layout == "video":  # written as `lorakit infer` writes a clip (the same H.264 writer), compared frame by frame
        frames = [f if isinstance(f, Image.Image) else Image.fromarray((np.asarray(f) * 255).clip(0, 255)
                  .astype("uint8")) for f in out.frames[0]]
        write_clip(a["out"].replace(".png", ".mp4"), frames, fps=24.0)
    else:  # Kandinsky 5 T2I's output names it `image`
        (out.images if hasattr(out, "images") else out.image)[0].save(a["out"])
    return {"peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
            "offload": place}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
