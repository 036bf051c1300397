"""Content fingerprints of files and folders (cache keys, LoRA and model hashes in image metadata)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def file_digest(path: Path) -> bytes:
    """sha256 of a file's bytes, read once per (path, size, mtime): the windows of one clip share it."""
    st = Path(path).stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _digest(path: str, size: int, mtime_ns: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.digest()


def file_hash(path: Path) -> str:
    """The first 16 hex digits of the sha256 of a file, or of a folder's files in name order."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(2**22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
