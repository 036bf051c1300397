"""The content-addressed store of text embeddings and latents.

    <cache_dir>/manifest.json            what the last build produced (items, skipped, settings)
    <cache_dir>/items/<key>.safetensors  one file per item, written atomically

An item's key hashes everything its tensors depend on: the image (and control) bytes, the caption,
the model identity, the encoder settings and the bucket. So changing one caption re-encodes that item
only, changing the model re-encodes all, and an interrupted build resumes: every finished item file is
complete (atomic rename) and is found again by its key.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import FileFormatError
from lorakit.io import atomic_path, load, read_header, save
from lorakit.io.digest import file_digest

MANIFEST_VERSION = 1


def item_key(sources: list[Path], caption: str, identity: str, settings: dict, bucket) -> str:
    h = hashlib.sha256()
    for p in sources:
        if p.is_dir():  # a frame folder: every frame, in order
            for f in sorted(x for x in p.iterdir() if x.is_file()):
                h.update(f.name.encode())
                h.update(file_digest(f))
        else:
            h.update(file_digest(p))
        h.update(b"\0")
    h.update(caption.encode())
    h.update(identity.encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(repr(tuple(bucket)).encode())
    return h.hexdigest()[:32]


@dataclass
class Store:
    root: Path

    @property
    def items_dir(self) -> Path:
        return self.root / "items"

    def path(self, key: str) -> Path:
        return self.items_dir / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        """A complete, valid file for this key exists."""
        p = self.path(key)
        if not p.is_file():
            return False
        try:
            read_header(p)
            return True
        except FileFormatError:
            return False

    def put(self, key: str, tensors: dict, meta: dict) -> Path:
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        return save(tensors, self.path(key), metadata={k: str(v) for k, v in meta.items()})

    @contextlib.contextmanager
    def writer(self, depth: int = 2):
        """`put` on a background thread: yields put(key, tensors, meta), which copies the tensors to the host
        (the caller may reuse them at once) and queues the write, waiting only while `depth` writes are
        pending. Leaving the block waits for every write; a failed write raises, at the next put or on leaving."""
        from concurrent.futures import ThreadPoolExecutor

        pending: collections.deque = collections.deque()
        with ThreadPoolExecutor(1, thread_name_prefix="lorakit-cache-write") as pool:
            def put(key: str, tensors: dict, meta: dict) -> None:
                host = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
                while len(pending) >= depth:
                    pending.popleft().result()
                pending.append(pool.submit(self.put, key, host, meta))

            yield put
            while pending:
                pending.popleft().result()

    def get(self, key: str) -> dict:
        return load(self.path(key), copy=True)

    def read_manifest(self) -> dict | None:
        p = self.root / "manifest.json"
        try:
            m = json.loads(p.read_text())
            return m if m.get("version") == MANIFEST_VERSION else None
        except (OSError, ValueError):
            return None

    def write_manifest(self, manifest: dict) -> None:
        manifest = {"version": MANIFEST_VERSION, **manifest}
        with atomic_path(self.root / "manifest.json") as tmp:
            tmp.write_text(json.dumps(manifest, indent=2, default=str))

    def prune(self, keep: set[str]) -> int:
        """Remove item files no longer referenced (stale captions, old models). Returns how many."""
        n = 0
        if self.items_dir.is_dir():
            for p in self.items_dir.glob("*.safetensors"):
                if p.stem not in keep:
                    p.unlink(missing_ok=True)
                    n += 1
            for p in self.items_dir.glob(".*.tmp"):  # left by a killed writer
                p.unlink(missing_ok=True)
        return n

    def verify(self, keys) -> list[str]:
        """Keys whose files are missing, malformed or hold non-finite values."""
        import torch

        bad = []
        for k in keys:
            try:
                t = self.get(k)
                if not all(torch.isfinite(v).all() for v in t.values() if v.is_floating_point()):
                    bad.append(k)
            except Exception:  # noqa: BLE001 - any unreadable entry counts as bad
                bad.append(k)
        return bad
