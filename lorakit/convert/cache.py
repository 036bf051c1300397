"""Legacy `.pt` caches (one pickled dict of tensors per item, as older trainers wrote them) -> a lorakit store.

Each file is read with `torch.load(weights_only=True)`, which cannot run code; anything that is not a flat dict
of tensors is refused, and every file is checked before anything is written. Names are mapped to lorakit's
(`latents`, `prompt_embeds`, `pooled`, `control_latents_N`); the item key is the hash of the file's bytes; the
bucket is the latent size x 8. The store (`items/<key>.safetensors` + `manifest.json`) is read by
`lorakit.cache.store.Store` and `train.data.CachedData` like one `lorakit cache` built.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lorakit.cache.store import Store
from lorakit.errors import InputError
from lorakit.io.pt import load_pt
from lorakit.models.base import vae_factor

SYNONYMS = {
    "latents": ("latents", "latent", "x0", "vae_latents", "latents_0"),
    "prompt_embeds": ("prompt_embeds", "text_embeds", "encoder_hidden_states", "t5_embeds", "text_embeddings"),
    "pooled": ("pooled", "pooled_prompt_embeds", "pooled_projections", "clip_pooled", "pooled_embeds"),
}
CONTROL = ("control_latents", "cond_latents", "control")


def _read(path: Path) -> dict:
    import torch

    if not path.is_file():
        raise InputError(f"{path}: not a regular file (a pipe, folder or device)")
    obj = load_pt(path)  # refused by name when it holds more than data
    if not isinstance(obj, dict):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a dict of tensors")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise InputError(f"{path}: key {bad[0]!r} holds a {type(obj[bad[0]]).__name__}, not a tensor",
                         "only dicts of tensors are migrated")
    return obj


def _rename(path: Path, obj: dict) -> dict:
    out = {}
    for ours, names in SYNONYMS.items():
        hit = next((n for n in names if n in obj), None)
        if hit is not None:
            out[ours] = obj[hit]
    controls = sorted(k for k in obj if k.startswith(CONTROL))
    for i, k in enumerate(controls):
        out[f"control_latents_{i}"] = obj[k]
    missing = [n for n in ("latents", "prompt_embeds") if n not in out]
    if missing:
        raise InputError(f"{path}: no {' or '.join(missing)} (keys: {', '.join(sorted(obj))[:200]})",
                         f"lorakit reads latents as one of {SYNONYMS['latents']} and text as one of "
                         f"{SYNONYMS['prompt_embeds']}")
    unbatched = {"prompt_embeds": 2, "pooled": 1}  # dims of one item; latents: 3 (image) or 4 (video)
    for k, t in list(out.items()):  # drop a leading batch dimension of 1
        want = unbatched.get(k)
        if t.shape and t.shape[0] == 1 and (t.dim() == want + 1 if want else t.dim() == 5 or (
                t.dim() == 4 and k.startswith("control"))):
            out[k] = t[0]
    if out["latents"].dim() == 4 and out["latents"].shape[0] == 1:
        out["latents"] = out["latents"][0]
    if out["latents"].dim() not in (3, 4):
        raise InputError(f"{path}: latents of shape {tuple(out['latents'].shape)} (expected C x h x w)")
    return out


def migrate(src, dst=None, family: str | None = None) -> dict:
    src = Path(src)
    if not src.is_dir():
        raise InputError(f"{src} is not a folder of .pt files")
    files = sorted(src.rglob("*.pt"))
    if not files:
        raise InputError(f"no .pt files under {src}")
    dst = Path(dst) if dst else src / "lorakit-cache"
    if (dst / "manifest.json").exists():
        raise InputError(f"{dst} already holds a lorakit cache", "name another output folder")
    items = []
    for f in files:  # everything is checked before anything is written
        tensors = _rename(f, _read(f))
        key = "legacy-" + hashlib.sha256(f.read_bytes()).hexdigest()[:24]
        h, w = tensors["latents"].shape[-2:]
        # the buckets are recorded in pixels, as the builder records them
        factor = vae_factor(family, int(tensors["latents"].shape[0]))
        items.append((f, key, tensors, [int(w) * factor, int(h) * factor]))
    store = Store(dst)
    for f, key, tensors, _ in items:
        store.put(key, tensors, {"migrated_from": f.name})
    store.write_manifest({"family": family, "identity": "migrated", "settings": {"migrated_from": str(src)},
                          "policy": "legacy", "empty_caption": None,
                          "items": [{"stem": f.stem, "key": k, "bucket": b, "caption": None, "source": str(f),
                                     "controls": []} for f, k, _, b in items], "skipped": []})
    return {"input": str(src), "output": str(dst), "items": len(items),
            "tensors": sorted({k for _, _, t, _ in items for k in t})}
