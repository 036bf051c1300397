"""Dataset folders under a root, for the dashboard: their images and clips with captions (editable in place) and the
problems `lorakit cache --check` finds in them for a family."""

from __future__ import annotations

import os
from pathlib import Path

from lorakit.config import validate
from lorakit.config.base import MAX_TEXT_CHARS
from lorakit.data.check import check as check_data
from lorakit.data.images import IMAGE_EXTS
from lorakit.data.video import CLIP_EXTS
from lorakit.errors import InputError, LorakitError
from lorakit.io import atomic_path
from lorakit.ui.confine import confined, is_file, read_text

MEDIA = tuple(IMAGE_EXTS) + tuple(CLIP_EXTS)
SKIP = {"cache", "checkpoints", "samples", "tensorboard", ".git"}


def _media(folder: Path) -> list[Path]:
    """The folder's images and clips (a link to a file outside the folder is not one of them)."""
    try:
        return sorted(p for p in folder.iterdir() if p.suffix.lower() in MEDIA and is_file(folder, p))
    except OSError:
        return []


def find_datasets(root: Path, depth: int = 2) -> list[dict]:
    """Folders holding images or clips, up to `depth` below root: name (relative) and item count."""
    root = Path(root)
    out = []

    def walk(d: Path, level: int):
        items = _media(d)
        if items:
            out.append({"name": str(d.relative_to(root)) if d != root else ".", "items": len(items)})
        if level >= depth:
            return
        try:
            subs = sorted(e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False)
                          and e.name not in SKIP and not e.name.startswith("."))
        except OSError:
            return
        for s in subs:
            walk(Path(s), level + 1)

    walk(root, 0)
    return out


def dataset_folder(root: Path, name: str) -> Path:
    folder = confined(root, name, "the datasets folder")
    if not folder.is_dir() or not _media(folder):
        raise InputError(f"{name}: not a dataset folder (no images or clips)")
    return folder


def items(folder: Path, name: str) -> list[dict]:
    """Each image or clip with its caption (None when it has no .txt beside it)."""
    out = []
    for p in _media(folder):
        cap = p.with_suffix(".txt")
        text = read_text(folder, cap) if is_file(folder, cap) else None
        out.append({"stem": p.stem, "file": f"{name}/{p.name}", "kind": "clip" if p.suffix.lower() in CLIP_EXTS
                    else "image", "caption": text})
    return out


def set_caption(folder: Path, stem: str, text: str) -> Path:
    """Write an item's caption (atomically, beside its file). InputError for an unknown item or a caption longer
    than lorakit reads."""
    match = [p for p in _media(folder) if p.stem == stem]
    if not match:
        raise InputError(f"{stem}: no image or clip of that name in {folder}")
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(f"caption of {stem}: {len(text)} characters (lorakit reads up to {MAX_TEXT_CHARS})")
    path = match[0].with_suffix(".txt")
    if path.is_symlink():  # the caption is written in place of the link, never through it
        raise InputError(f"{path}: the caption file is a symbolic link; lorakit writes only regular files here",
                         "replace the link with the caption file itself")
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path


def check(folder: Path, family: str) -> dict:
    """`lorakit cache --check` for this one folder with the family's defaults: its problems, or the config
    problem that stopped the check."""
    try:
        report = check_data(validate({"model": {"family": family}, "data": {"dirs": [str(folder)]}}))
    except LorakitError as e:
        return {"problems": [], "error": e.message, "hint": getattr(e, "hint", None)}
    root = str(folder).rstrip("/") + "/"
    return {"problems": [{**p, "path": p["path"].removeprefix(root)} for p in report["problems"]],
            "items": report["items"], "buckets": report["buckets"], "warnings": report["warnings"]}
