"""Build the cache: validated items -> buckets -> text embeddings + latents in the store."""

from __future__ import annotations

import hashlib
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.cache.store import Store, item_key
from lorakit.data.buckets import POLICY, fit
from lorakit.data.check import strict_refusal
from lorakit.data.images import open_alpha, open_image
from lorakit.data.plan import plan_data
from lorakit.data.video import ClipError, read_window
from lorakit.dist import Dist
from lorakit.dtypes import torch_dtype
from lorakit.errors import InputError
from lorakit.events import Events
from lorakit.hardware.gpu import apply_cap, budget_gib, device_for
from lorakit.io import atomic_path, clean_orphans
from lorakit.io.lock import FolderLock
from lorakit.io.modules import load_facts
from lorakit.io.stream import folder_gib, too_large
from lorakit.models.base import load_adapter
from lorakit.models.pixels import to_pixels

# One item per encoder call, never batched: batched convolutions and padded attention round differently with
# other items in the batch, and a content-addressed entry must not depend on its neighbours.


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
    warnings: list = field(default_factory=list)  # what caches, but not as the user may think
    verified_bad: list = field(default_factory=list)
    cleaned: int = 0  # temporary files of an interrupted build, removed
    clips: int = 0  # video: the clips the items (windows) come from
    items_per_s: float = 0.0  # encoded items per second of encoding (model loading excluded)
    peak_gpu_gib: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cache_dir_for(cfg) -> Path:
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output.dir) / "cache"


def build(cfg, device: str | None = None, force: bool = False, verify: bool = False, strict: bool = False,
          events: Events | None = None, adapter=None, dist=None) -> Summary:
    """Encode every valid item not already in the store (the config's paths were checked when it was resolved).

    Args:
        device: where the encoders run (default: the profile's device on this machine).
        events: hears the phases (loading the encoders, encoding) and each item encoded.
        adapter: an already-loaded family adapter (tests, demo, a training run); loaded from cfg.model.path
            otherwise.
        dist: the ranks of a distributed run (`lorakit.dist.Dist`): each encodes its share of the items,
            rank 0 writes the manifest once all are done.
    """
    dist, events = dist or Dist(), events or Events()
    lock = FolderLock(cache_dir_for(cfg), "cache build", hint="wait for it to finish, or give this one another "
                                                              "data.cache_dir") if dist.main else nullcontext()
    with lock, events.phase("cache") as facts:
        s = _build(cfg, device, force, verify, strict, events, adapter, dist)
        facts.update(items=s.items, encoded=s.encoded, reused=s.reused, skipped=len(s.skipped))
    return s


def _build(cfg, device, force, verify, strict, events, adapter, dist) -> Summary:
    t0 = time.perf_counter()
    family = cfg.model.family
    store = Store(cache_dir_for(cfg))
    summary = Summary(cache_dir=str(store.root))
    if dist.main:  # temporary files a killed build left behind (finished entries are whole: atomic renames)
        summary.cleaned = len(clean_orphans(store.root, recursive=True))
    data = plan_data(cfg)
    controlled = any(e.item.controls for e in data.entries)  # edit data: each prompt sees its item's controls
    summary.skipped += data.problems
    summary.warnings += data.notes
    for n in data.notes:
        events.warn(n)
    if strict and summary.skipped:
        raise strict_refusal(summary.skipped, "`lorakit cache CONFIG --check` lists them all; without --strict "
                                              "the build skips those items")
    if not data.entries:
        raise InputError("no valid items to cache", "run `lorakit cache CONFIG --check` to see why")

    if adapter is None:
        device = device or device_for(cfg.profile)
        apply_cap(device)  # LORAKIT_MEMORY_CAP_GIB: a smaller card, emulated
        adapter = load_adapter(family, cfg.model.path, device=device, dtype=torch_dtype(cfg.model.dtype),
                               backend=cfg.memory.loader)
    stream_large_encoders(adapter, cfg.model.dtype)
    identity = adapter.identity()
    settings = {"family": family, "dtype": cfg.model.dtype, "policy": POLICY,
                "max_sequence_length": getattr(adapter, "max_sequence_length", None)}
    if cfg.data.caption_shuffle:  # more encodings per item: a different entry
        settings["caption_variants"] = [cfg.data.caption_variants, cfg.data.keep_tokens]
    planned = []
    for e in data.entries:
        sources = [e.item.target, *e.item.controls, *([e.item.mask] if e.item.mask else [])]
        mask_kind = {"mask_alpha": True} if e.item.mask_alpha else {}
        key = item_key(sources, e.item.caption, identity, {**settings, **e.settings(), **mask_kind}, e.bucket)
        planned.append((e, e.bucket, key))
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

    by_group: dict = {}  # entries of one batch group (bucket, control sizes) encode one after another
    for p in todo:
        by_group.setdefault(p[0].group, []).append(p)
    order = [p for _, group in sorted(by_group.items()) for p in group]
    if todo:  # the encoders load now, so that items/s times encoding only
        with events.phase("load encoders") as facts:
            t0 = time.perf_counter()
            adapter.load((*adapter.text_parts, adapter.vae_part))
            facts.update(load_facts([adapter.parts[n] for n in (*adapter.text_parts, adapter.vae_part)
                                     if hasattr(adapter.parts.get(n), "parameters")], time.perf_counter() - t0))
            for name, how in adapter.streamed.items():
                slow = "" if how["pinned"] else (f"; {how.get('pageable_gib', how['streamed_gib'])} GiB of it pageable"
                                                 ": the host has no room to pin it: slower")
                facts[name] = (f"{how['streamed_gib']} GiB streamed from host memory block by block (it does not "
                               f"fit this GPU{slow})")
    t_enc = time.perf_counter()
    events.progress("encoding", 0, len(todo))
    # The disk work overlaps the encoders: the next item's image is decoded and cropped on a reader thread,
    # each finished item is written (atomically, flushed) on a writer thread.
    with ThreadPoolExecutor(1, thread_name_prefix="lorakit-cache-read") as reader, store.writer() as put:
        ahead = reader.submit(_read, order[0]) if order else None
        for n, entry in enumerate(order):
            read = ahead.result()
            if n + 1 < len(order):
                ahead = reader.submit(_read, order[n + 1])
            summary.encoded += _encode_one(adapter, store, put, entry, read, cfg)
            events.progress("encoding", n + 1, len(todo), "x".join(str(x) for x in entry[1]))
    if summary.encoded:
        summary.items_per_s = round(summary.encoded / max(time.perf_counter() - t_enc, 1e-9), 3)
    dist.barrier()  # every rank's items are in the store
    if dist.main:  # entries that failed to encode (a clip damaged past its first frame): left out, by name
        failed = _collect_failures(store)
        summary.skipped += [failed[k] for k in keys if k in failed]
        planned = [p for p in planned if p[2] not in failed]
        keys = [k for k in keys if k not in failed]
    refused = dist.broadcast([failed[k] for k in failed] if dist.main and strict else [])
    if refused:  # --strict: a clip that failed while encoding stops the build too, by name
        raise strict_refusal(refused, "the items encoded so far are kept; without --strict the build skips it")
    empty = _empty_caption(adapter, store, identity, settings, controlled) if dist.main else None
    empty = dist.broadcast(empty)
    if dist.main:
        summary.pruned = store.prune(set(keys) | {empty})
    hist: dict = {}
    for _, b, _ in planned:
        name = "x".join(str(x) for x in b)
        hist[name] = hist.get(name, 0) + 1
    summary.buckets = dict(sorted(hist.items(), key=lambda kv: [int(x) for x in kv[0].split("x")]))
    summary.clips = len({id(e.item) for e, _, _ in planned if e.window is not None})
    if dist.main:
        _write_manifest(store, family, identity, settings, None if controlled else empty, planned, summary)
    dist.barrier()
    summary.bytes = sum(store.path(k).stat().st_size for k in set(keys) if store.path(k).is_file())
    summary.seconds = round(time.perf_counter() - t0, 2)
    if str(adapter.device).startswith("cuda"):
        import torch

        summary.peak_gpu_gib = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if cfg.memory.free_encoders_after_cache:
        adapter.unload(list(adapter.parts))
    return summary


def stream_large_encoders(adapter, dtype: str) -> None:
    """Mark the text encoders that do not fit this GPU with room to run (FLUX.2 [dev]'s 24 B Mistral, 45 GiB in
    bf16, on a 32 or 24 GiB card) to be streamed block by block from host memory when they load (`io.stream`):
    their embeddings are the same, only slower to make."""
    if adapter.model_dir is None or not str(adapter.device).startswith("cuda"):
        return
    budget = budget_gib(adapter.device)
    for name in adapter.text_parts:
        gib = folder_gib(adapter.model_dir / name, {"fp32": 4}.get(dtype, 2))
        if gib is not None and too_large(gib, budget) and name not in adapter.parts:
            adapter.streamed.setdefault(name, None)


def _write_manifest(store, family, identity, settings, empty, planned, summary) -> None:
    store.write_manifest({
        "family": family, "identity": identity, "settings": settings, "policy": POLICY,
        "empty_caption": empty,  # None: each item holds its own (its prompt sees its controls)
        "items": [{"stem": e.item.stem, "label": e.label, "key": k, "bucket": list(b), "group": list(e.group),
                   "dataset": e.dataset,
                   "caption": e.item.caption, "source": str(e.item.target),
                   "controls": [str(c) for c in e.item.controls], **e.settings()} for e, b, k in planned],
        "skipped": summary.skipped})


def _read(entry):
    """The CPU side of one entry (reader thread): its pixels decoded and cropped to the bucket (a window of a
    clip: its frames), its control images opened; a clip that fails to decode comes back as the ClipError."""
    e, bucket, _ = entry
    it = e.item
    if e.window is not None:
        try:
            frames = read_window(it.target, e.window)
        except ClipError as err:
            return err
        return {"pixels": to_pixels([fit(f, bucket[:2]) for f in frames])}  # (T, 3, H, W)
    return {"pixels": to_pixels([fit(open_image(it.target), bucket)]),
            "controls": [open_image(c) for c in it.controls] or None}


def _encode_one(adapter, store: Store, put, entry, read, cfg) -> int:
    """Encode one entry (alone: see the note at the top) and hand it to the writer; a clip that failed to decode is
    recorded as a failure (by key) instead of stopping the build. Returns how many were stored (0 or 1)."""
    e, bucket, key = entry
    it = e.item
    if isinstance(read, ClipError):
        _record_failure(store, key, {"path": str(it.target), "code": "unreadable",
                                     "message": f"{e.label}: {read.message.removeprefix(f'{it.target}: ')}"})
        return 0
    tensors = {}
    controls = read.get("controls")
    clip = read["pixels"].permute(1, 0, 2, 3).unsqueeze(0) if e.window is not None else read["pixels"].unsqueeze(2)
    cond = adapter.encode_clip_condition(clip)  # image-to-video: the first frame the clip starts from
    if cond is not None:
        tensors["control_latents_0"] = cond[0] if e.window is not None else cond[0, :, 0]
    if e.window is not None:
        tensors["latents"] = adapter.encode_video(clip)[0]
    else:
        tensors["latents"] = adapter.encode_images(read["pixels"])[0]
        if it.mask is not None:  # the loss mask at latent resolution (each latent: its pixels' mean)
            tensors["loss_mask"] = latent_mask(it.mask, bucket, tensors["latents"].shape, it.mask_alpha)
        if controls:
            for c, lat in enumerate(adapter.encode_controls(controls, cfg.data.control_resolution)):
                tensors[f"control_latents_{c}"] = lat
    texts = adapter.encode_prompts([it.caption], controls=[controls] if controls else None)
    tensors.update(texts[0])
    if cfg.data.caption_shuffle:  # variants 1..N-1: the tags after the first keep_tokens shuffled
        for v, caption in enumerate(caption_variants(it.caption, cfg.data.caption_variants,
                                                     cfg.data.keep_tokens, key)[1:], start=1):
            enc = adapter.encode_prompts([caption], controls=[controls] if controls else None)[0]
            tensors.update({f"{k}@{v}": t for k, t in enc.items() if k in ("prompt_embeds", "pooled")})
    if controls and cfg.data.caption_dropout > 0:  # an empty instruction still sees its controls
        tensors["empty_prompt_embeds"] = adapter.encode_prompts([""], controls=[controls])[0]["prompt_embeds"]
    put(key, tensors, {"stem": it.stem, "label": e.label, "caption": it.caption,
                       "bucket": "x".join(str(x) for x in bucket)})
    return 1


def caption_variants(caption: str, n: int, keep: int, key: str) -> list[str]:
    """The caption and n - 1 orderings of its comma-separated tags, the first `keep` in place (seeded by the
    item's key, so a rebuild encodes the same ones)."""
    tags = [t.strip() for t in caption.split(",") if t.strip()]
    rng = random.Random(key)
    out = [caption]
    for _ in range(n - 1):
        rest = tags[keep:]
        rng.shuffle(rest)
        out.append(", ".join(tags[:keep] + rest))
    return out


def latent_mask(path, bucket, latent_shape, alpha: bool = False):
    """A mask image (white: trained, black: ignored, grey: weighted; or an image's alpha channel: opaque
    trained) cropped as its target is, averaged over each latent's pixels: shape (1, [1, ...,] h, w),
    broadcasting over the latent's channels."""
    import numpy as np
    import torch

    m = fit(open_alpha(path) if alpha else open_image(path).convert("L"), bucket)
    t = torch.from_numpy(np.asarray(m, dtype=np.float32) / 255.0)[None, None]
    h, w = latent_shape[-2:]
    t = torch.nn.functional.interpolate(t, size=(h, w), mode="area")[0]
    return t.view(1, *([1] * (len(latent_shape) - 3)), h, w)


def _record_failure(store: Store, key: str, problem: dict) -> None:
    folder = store.root / "failed"
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / f"{key}.json") as tmp:
        tmp.write_text(json.dumps(problem), encoding="utf-8")


def _collect_failures(store: Store) -> dict:
    folder = store.root / "failed"
    out = {}
    if folder.is_dir():
        for p in sorted(folder.glob("*.json")):
            out[p.stem] = json.loads(p.read_text(encoding="utf-8"))
            p.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()
    return out


def _empty_caption(adapter, store: Store, identity: str, settings: dict, controlled: bool) -> str:
    """The empty caption's embedding, for caption dropout (edit families store theirs per item)."""
    key = "empty-" + hashlib.sha256((identity + repr(sorted(settings.items()))).encode()).hexdigest()[:24]
    if not controlled and not store.has(key):
        store.put(key, adapter.encode_prompts([""])[0], {"caption": ""})
    return key
