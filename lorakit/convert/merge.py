"""Bake a LoRA into a model's transformer weights: W' = W + scale * delta (LoRA: alpha/rank * B @ A; DoRA, LoKr,
LoHa, full and bias differences likewise), in float64, stored back in the weight's own dtype. The output is a complete model folder (other components copied), written to a
temporary sibling and renamed, so a failure leaves nothing half-written."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from lorakit.convert import lora as L
from lorakit.errors import InputError
from lorakit.io import load, resolve_files, save_sharded, shared_tree
from lorakit.io.digest import file_hash
from lorakit.models.registry import family_info, family_of_folder


def merge(model_dir, lora_path, dst, scale: float = 1.0) -> dict:
    model_dir, dst = Path(model_dir), Path(dst)
    if dst.exists():
        raise InputError(f"{dst} exists", "name a new folder for the merged model")
    family = family_of_folder(model_dir)
    tdir = model_dir / "transformer"
    weights = load(tdir, copy=True)
    base = {k.removesuffix(".weight"): v for k, v in weights.items() if k.endswith(".weight")}
    lora = L.read(lora_path, arch=family_info(family).arch if family else None, base=base)
    missing = [m for m in lora.weights if m not in base] + [m for m in lora.biases if f"{m}.bias" not in weights]
    if missing:
        raise InputError(f"{lora_path}: modules the model does not have: {', '.join(missing[:3])}",
                         "is the LoRA for another model?")
    for m, p in lora.weights.items():
        w = weights[f"{m}.weight"]
        if tuple(w.shape) != tuple(p.shape):
            raise InputError(f"{m}: the LoRA changes a {tuple(p.shape)} weight, the model's is {tuple(w.shape)}")
        weights[f"{m}.weight"] = (w.double() + p.delta(w) * scale).to(w.dtype)  # DoRA: W + scale * (W' - W)
    for m, b in lora.biases.items():
        w = weights[f"{m}.bias"]
        weights[f"{m}.bias"] = (w.double() + b.double() * scale).to(w.dtype)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for item in model_dir.iterdir():
            if item.name != "transformer":
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        (tmp / "transformer").mkdir()
        for f in tdir.iterdir():
            if f.is_file() and ".safetensors" not in f.name:
                shutil.copy2(f, tmp / "transformer" / f.name)
        size = max(f.stat().st_size for f in resolve_files(tdir))
        save_sharded(weights, tmp / "transformer", max_shard_bytes=size + 1 if len(resolve_files(tdir)) == 1
                     else size, metadata={"format": "pt", "lorakit_merged_lora": file_hash(Path(lora_path)),
                                          "lorakit_merge_scale": str(scale)})
        shared_tree(tmp)  # mkdtemp makes 0700 and copies keep the base's modes: readable as any new file
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"model": str(model_dir), "lora": str(lora_path), "scale": scale, "output": str(dst),
            "modules": len(lora.weights), "biases": len(lora.biases), "lora_format": lora.facts["format"],
            "kinds": lora.facts["kinds"], "not_applied": [{"key": k, "why": w} for k, w in lora.unused]}
