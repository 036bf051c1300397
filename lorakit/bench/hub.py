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

import contextlib
import json
import shutil
import time
from pathlib import Path

from lorakit.errors import InputError
from lorakit.io import link_or_copy, save_sharded
from lorakit.models.base import family_adapter
from lorakit.models.published import SHARD_BYTES, full_component, hub_names


def _tokenizer_for(name: str, pipe):
    """The tokenizer that feeds a text encoder component (text_encoder -> tokenizer, text_encoder_2 -> tokenizer_2;
    the processor where the pipeline has no tokenizer: Qwen-Image-2.1)."""
    return getattr(pipe, name.replace("text_encoder", "tokenizer"), None) or getattr(pipe, "processor", None)


def _build(adapter, name: str, part, pipe, device: str):
    """The published-size module of a pipeline component, on `device` ("meta": its shapes alone), in bf16."""
    import torch

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if name in ("transformer", "transformer_2"):  # transformer_2: Wan 2.2 A14B's low-noise expert
                return getattr(__import__("diffusers"), adapter.info.transformer_class)(**adapter.full_config)
            return full_component(name, part, _tokenizer_for(name, pipe))
    finally:
        torch.set_default_dtype(prev)


def _identity(module, seed: int, dtype) -> str:
    """What a component's weight files follow from: its class, its tensors' names, shapes and stored dtype, and the
    seed they are drawn from. Two components with the same identity are written byte for byte alike."""
    import hashlib

    tensors = [(k, list(v.shape), str(dtype if dtype is not None and v.is_floating_point() else v.dtype))
               for k, v in module.state_dict().items()]
    text = json.dumps({"class": type(module).__name__, "seed": seed, "tensors": tensors})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _link_weights(src: Path, folder: Path) -> None:
    """The weight files and their index of `src` in `folder`, hard-linked (copied where the disk cannot link)."""
    for f in sorted(src.glob("*.safetensors")) + sorted(src.glob("*.safetensors.index.json")):
        link_or_copy(f, folder / f.name)


def _home(folder: Path, home: Path) -> None:
    """`folder`, a component of a model folder, moved to `home` (emptied first) and linked from where it was."""
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    for item in folder.iterdir():
        shutil.move(str(item), home / item.name)
    folder.rmdir()
    folder.symlink_to(home.resolve(), target_is_directory=True)


def remove_model(folder) -> None:
    """A model folder `write_model` wrote, and the components it keeps elsewhere (`homes`)."""
    folder = Path(folder)
    if not folder.exists():
        return
    for part in folder.iterdir():
        if part.is_symlink() and part.is_dir():
            shutil.rmtree(part.resolve())
    shutil.rmtree(folder)


def weight_files(folder) -> list[Path]:
    """A model folder's weight files, the components it links to (`homes`) included: `rglob`'s "**" does not
    follow a linked folder."""
    folder = Path(folder)
    return sorted([*folder.glob("*.safetensors"), *folder.glob("*/*.safetensors")])


def _written(folder) -> dict:
    """The components write_model recorded in a folder (name -> class, params, bytes, identity); {} if none."""
    rec = Path(folder) / "lorakit_synthetic.json"
    comps = json.loads(rec.read_text()).get("components") if rec.is_file() else None
    return comps if isinstance(comps, dict) else {}  # tools/e2e.py's linked folders list their names only


def reusable(family: str, like, seed: int = 0, scale: str = "full", dtype=None) -> tuple[list[str], int]:
    """Which components of `family` the folder `like` (written by write_model) already holds, and the bytes the
    others would take: what writing `family` beside `like` costs the disk."""
    import torch

    theirs = _written(like)
    adapter = family_adapter(family)
    pipe = adapter.build_tiny(seed)
    same, need = [], 0
    for name, part in pipe.components.items():
        if not isinstance(part, torch.nn.Module):
            continue
        module = _build(adapter, name, part, pipe, "meta") if scale == "full" else part
        if theirs.get(name, {}).get("identity") == _identity(module, seed + len(name), dtype):
            same.append(name)
        else:
            need += sum(v.numel() * (2 if scale == "full" else v.element_size()) for v in module.state_dict().values())
    return same, need


def write_model(family: str, out, device: str = "cuda", seed: int = 0, scale: str = "full",
                progress=None, dtype=None, like=None, homes: dict | None = None) -> dict:
    """Write the family's model folder at `out` (replaced if present). Returns what was written: per component
    its parameters, bytes and seconds, and the totals. `dtype`: the floating-point dtype the weights are stored
    in (the full scale is bf16, as the hub stores these models; the tiny scale keeps float32 unless asked).
    `like`: a folder written before (another family of the same weights: Qwen-Image beside its Edit models); each
    component whose identity it holds is hard-linked from it instead of drawn and written again. `homes`: component ->
    a folder on another disk that holds its files, linked from the model folder (a disk too small for the whole
    model: FLUX.2 [dev]'s 105 GiB beside a 64 GiB disk, its 60 GiB transformer in RAM-backed /dev/shm).

    Raises:
        InputError: `homes` names a component this family's pipeline does not have."""
    import torch

    out = Path(out)
    adapter = family_adapter(family)
    torch.manual_seed(seed)
    pipe = adapter.build_tiny(seed)  # the layout, scheduler, tokenizers and processors of the real classes
    if scale == "full":
        _full_processor(pipe)
    parts = [n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)]
    unknown = sorted(set(homes or {}) - set(parts))
    if unknown:
        raise InputError(f"{unknown[0]}: {family} has no such component to keep elsewhere", "its components: "
                         + ", ".join(parts))
    remove_model(out)
    try:
        return _write(pipe, adapter, family, out, device, seed, scale, progress, dtype, like, homes or {})
    except BaseException:  # a folder cut short (a full disk, ^C) is not left to fill the disk (the next write would
        with contextlib.suppress(OSError):  # remove it first anyway); the error that cut it is the one raised
            remove_model(out)
        raise


def _write(pipe, adapter, family, out: Path, device, seed, scale, progress, dtype, like, homes: dict) -> dict:
    import torch

    pipe.save_pretrained(out, safe_serialization=True)
    report = {"family": family, "scale": scale, "components": {}}
    theirs = _written(like) if like is not None else {}
    t_all = time.perf_counter()
    for name, part in pipe.components.items():
        if not isinstance(part, torch.nn.Module):
            continue
        t0 = time.perf_counter()
        shape = _build(adapter, name, part, pipe, "meta") if scale == "full" else part
        ident = _identity(shape, seed + len(name), dtype)
        folder = out / name
        if name in homes:
            _home(folder, Path(homes[name]))
        kind = "diffusers" if type(shape).__module__.startswith("diffusers") else "transformers"
        for old in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")):
            old.unlink()
        if kind == "diffusers":
            shape.save_config(folder)
        else:  # a model built from its config has no `architectures` yet; save_pretrained would set it
            shape.config.architectures = [type(shape).__name__]
            shape.config.save_pretrained(folder)
        if theirs.get(name, {}).get("identity") == ident:
            _link_weights(Path(like) / name, folder)
            report["components"][name] = {**{k: theirs[name][k] for k in ("class", "params", "bytes")},
                                          "identity": ident, "linked_from": str(like),
                                          "seconds": round(time.perf_counter() - t0, 1)}
            if progress:
                progress(name, report["components"][name])
            continue
        torch.manual_seed(seed + len(name))
        module = _build(adapter, name, part, pipe, device) if scale == "full" else part
        tensors = hub_names(type(module).__name__, _unique_tensors(module))
        if dtype is not None:
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        save_sharded(tensors, folder, base="diffusion_pytorch_model" if kind == "diffusers" else "model",
                     max_shard_bytes=SHARD_BYTES[kind])
        n = sum(t.numel() for t in tensors.values())
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        report["components"][name] = {"class": type(module).__name__, "params": n, "bytes": size,
                                      "identity": ident, "seconds": round(time.perf_counter() - t0, 1)}
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
