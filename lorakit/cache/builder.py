"""Build the cache: validated items -> buckets -> text embeddings + latents in the store."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.cache.store import Store, item_key
from lorakit.config import device_and_dtype
from lorakit.data.buckets import POLICY, fit, make_buckets, nearest_bucket
from lorakit.data.check import control_dirs_for
from lorakit.data.dataset import IMAGE_EXTS, open_image, scan
from lorakit.errors import InputError
from lorakit.models.registry import family_info

# One item per encoder call: batched convolutions and padded attention round differently with other
# items in the batch, and a content-addressed entry must not depend on its neighbours.
BATCH = 1


@dataclass
class Summary:
    cache_dir: str
    items: int = 0
    encoded: int = 0
    reused: int = 0
    pruned: int = 0
    bytes: int = 0
    seconds: float = 0.0
    buckets: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    verified_bad: list = field(default_factory=list)
    cleaned: int = 0  # temporary files of an interrupted build, removed

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cache_dir_for(cfg) -> Path:
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output.dir) / "cache"


def _pixels(images):
    import numpy as np
    import torch

    # the same arithmetic as diffusers' VaeImageProcessor (x / 255, then 2x - 1), bit for bit
    arr = np.stack([np.asarray(im).astype(np.float32) / 255.0 for im in images])
    arr = 2.0 * arr - 1.0
    return torch.from_numpy(arr.transpose(0, 3, 1, 2))  # the processor's layout too (channels-last strides)


def _frames(folder: Path, bucket, max_frames: int, temporal: int = 4):
    """Frames of a clip folder, fitted to the bucket, cut to 4k+1 frames (the VAE's temporal rule)."""

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS)
    n = min(len(files), max_frames)
    n = ((n - 1) // temporal) * temporal + 1
    pix = _pixels([fit(open_image(f), bucket) for f in files[:n]])  # (T, 3, H, W)
    return pix.permute(1, 0, 2, 3).unsqueeze(0)  # (1, 3, T, H, W)


def build(cfg, force: bool = False, verify: bool = False, strict: bool = False, progress=None,
          adapter=None, dist=None) -> Summary:
    """Encode every valid item not already in the store.

    Args:
        progress: callable(done, total, note) for a progress bar.
        adapter: an already-loaded family adapter (tests, demo); loaded from cfg.model.path otherwise.
        dist: the ranks of a distributed run (`lorakit.train.dist.Dist`): each encodes its share of the items,
            rank 0 writes the manifest once all are done.
    """
    from lorakit.train.dist import Dist

    dist = dist or Dist()
    t0 = time.perf_counter()
    from lorakit.config import check_paths

    check_paths(cfg, model=adapter is None, data=True)  # every path problem at once
    family = cfg.model.family
    from lorakit.models.base import family_adapter

    layout = family_adapter(family).layout
    info = family_info(family)
    store = Store(cache_dir_for(cfg))
    summary = Summary(cache_dir=str(store.root))
    if dist.main:  # temporary files a killed build left behind (finished entries are whole: atomic renames)
        from lorakit.io import clean_orphans

        summary.cleaned = len(clean_orphans(store.root, recursive=True))
    items = []
    for root in cfg.data.dirs:
        root = Path(root)
        controls = control_dirs_for(cfg, root) if root.is_dir() else cfg.data.control_dirs
        s = scan(root, layout=layout, control_dirs=controls, caption_ext=cfg.data.caption_ext,
                 min_side=cfg.data.bucket_min_side, trigger=cfg.data.trigger)
        summary.skipped += [p.__dict__ for p in s.problems]
        for it in s.items:
            if it.size is None:  # an .mp4 clip: lorakit reads frame folders
                summary.skipped.append({"path": str(it.target), "code": "unreadable",
                                        "message": "mp4 clips are not decoded here: extract the frames into "
                                                   f"clips/{it.stem}/ (e.g. ffmpeg -i {it.target.name} "
                                                   f"{it.stem}/%03d.png)"})
            else:
                items.append(it)
    if strict and summary.skipped:
        raise InputError(f"{len(summary.skipped)} dataset problem(s) and --strict",
                         "run `lorakit cache CONFIG --check` to list them")
    if not items:
        raise InputError("no valid items to cache", "run `lorakit cache CONFIG --check` to see why")

    if adapter is None:
        from lorakit.models.base import load_adapter

        device, dtype = device_and_dtype(cfg)
        adapter = load_adapter(family, cfg.model.path, device=device, dtype=dtype, backend=cfg.memory.loader)
    identity = adapter.identity()
    settings = {"family": family, "dtype": cfg.model.dtype, "policy": POLICY, "frames": cfg.data.frames,
                "max_sequence_length": getattr(adapter, "max_sequence_length", None)}
    buckets = make_buckets(cfg.data.resolution, info.patch, cfg.data.bucket_min_side, cfg.data.bucket_max_side)

    planned = []
    for it in items:
        bucket = nearest_bucket(it.size, buckets)
        key = item_key([it.target, *it.controls], it.caption, identity, settings, bucket)
        planned.append((it, bucket, key))
    keys = [k for _, _, k in planned]
    if verify and dist.main:
        summary.verified_bad = store.verify([k for k in keys if store.path(k).is_file()])
        for k in summary.verified_bad:
            store.path(k).unlink(missing_ok=True)
    dist.barrier()
    todo = [p for p in planned if force or not store.has(p[2])]
    summary.items = len(planned)
    summary.reused = len(planned) - len(todo)
    todo = dist.share(todo)
    delay = float(os.environ.get("LORAKIT_CACHE_ITEM_DELAY", "0") or 0)  # testing aid: makes a build interruptible

    by_bucket: dict = {}
    for p in todo:
        by_bucket.setdefault(p[1], []).append(p)
    done = 0
    if progress:
        progress(0, len(todo), "encoding")
    for bucket, group in sorted(by_bucket.items()):
        for i in range(0, len(group), BATCH):
            batch = group[i:i + BATCH]
            _encode_batch(adapter, store, batch, bucket, layout, cfg)
            done += len(batch)
            summary.encoded += len(batch)
            if progress:
                progress(done, len(todo), f"{bucket[0]}x{bucket[1]}")
            if delay:
                time.sleep(delay)
    dist.barrier()  # every rank's items are in the store
    empty = _empty_caption(adapter, store, identity, settings, layout) if dist.main else None
    empty = dist.broadcast(empty)
    if dist.main:
        summary.pruned = store.prune(set(keys) | {empty})
    hist: dict = {}
    for _, b, _ in planned:
        hist[f"{b[0]}x{b[1]}"] = hist.get(f"{b[0]}x{b[1]}", 0) + 1
    summary.buckets = dict(sorted(hist.items()))
    if dist.main:
        _write_manifest(store, family, identity, settings, layout, empty, planned, summary)
    dist.barrier()
    summary.bytes = sum(store.path(k).stat().st_size for k in set(keys))
    summary.seconds = round(time.perf_counter() - t0, 2)
    if cfg.memory.free_encoders_after_cache:
        adapter.unload(list(adapter.parts))
    return summary


def _write_manifest(store, family, identity, settings, layout, empty, planned, summary) -> None:
    store.write_manifest({
        "family": family, "identity": identity, "settings": settings, "policy": POLICY,
        "empty_caption": empty if layout != "edit" else None,
        "items": [{"stem": it.stem, "key": k, "bucket": list(b), "caption": it.caption, "source": str(it.target),
                   "controls": [str(c) for c in it.controls]} for it, b, k in planned],
        "skipped": summary.skipped})


def _encode_batch(adapter, store: Store, batch, bucket, layout: str, cfg) -> None:
    its = [b[0] for b in batch]
    controls = None
    tensors = [dict() for _ in batch]
    if layout == "video":
        for j, it in enumerate(its):
            frames = _frames(it.target, bucket, cfg.data.frames)
            tensors[j]["latents"] = adapter.encode_video(frames)[0]
    else:
        lat = adapter.encode_images(_pixels([fit(open_image(it.target), bucket) for it in its]))
        for j in range(len(its)):
            tensors[j]["latents"] = lat[j]
        if layout == "edit":
            controls = [[fit(open_image(c), bucket) for c in it.controls] for it in its]
            n_ctrl = len(controls[0])
            for c in range(n_ctrl):
                clat = adapter.encode_images(_pixels([ctrl[c] for ctrl in controls]))
                for j in range(len(its)):
                    tensors[j][f"control_latents_{c}"] = clat[j]
    text = adapter.encode_prompts([it.caption for it in its], controls=controls)
    if layout == "edit" and cfg.data.caption_dropout > 0:  # an empty instruction still sees its controls
        empty = adapter.encode_prompts([""] * len(its), controls=controls)
        for j in range(len(its)):
            tensors[j]["empty_prompt_embeds"] = empty[j]["prompt_embeds"]
    for j, (it, _, key) in enumerate(batch):
        tensors[j].update(text[j])
        store.put(key, tensors[j], {"stem": it.stem, "caption": it.caption, "bucket": f"{bucket[0]}x{bucket[1]}"})


def _empty_caption(adapter, store: Store, identity: str, settings: dict, layout: str) -> str:
    """The empty caption's embedding, for caption dropout (edit families store theirs per item)."""
    import hashlib

    key = "empty-" + hashlib.sha256((identity + repr(sorted(settings.items()))).encode()).hexdigest()[:24]
    if layout != "edit" and not store.has(key):
        store.put(key, adapter.encode_prompts([""])[0], {"caption": ""})
    return key
