"""Dataset folders under a root, for the dashboard: their images and clips with captions (editable in place) and the
problems `lorakit cache --check` finds in them for a family."""

from __future__ import annotations

import os
from pathlib import Path

from lorakit.config import validate
from lorakit.config.base import MAX_TEXT_CHARS
from lorakit.data.check import check as check_data
from lorakit.data.images import IMAGE_EXTS
from lorakit.data.video import ANIMATED_EXTS, CLIP_EXTS
from lorakit.errors import InputError, LorakitError
from lorakit.io import atomic_path
from lorakit.ui import runs as R
from lorakit.ui.confine import confined, is_file, read_text

MEDIA = tuple(IMAGE_EXTS) + tuple(CLIP_EXTS)
SKIP = {"cache", "checkpoints", "samples", "tensorboard", ".git"}
RUN_MARK = "config.resolved.yaml"  # a run folder: what lorakit wrote, never a dataset (nor anything inside it)
OUTSIDE = "@"  # the names of data folders outside the runs folder begin with it
REPORT_MARK = "demo.json"  # a demo's report folder: its own images are outputs (its data/ folder is a dataset)


def media(folder: Path) -> list[Path]:
    """The folder's images and clips (a link to a file outside the folder is not one of them)."""
    try:
        return sorted(p for p in folder.iterdir() if p.suffix.lower() in MEDIA and is_file(folder, p))
    except OSError:
        return []


def find_datasets(root: Path, depth: int = 2) -> list[dict]:
    """Folders holding images or clips, up to `depth` below root: name (relative) and item count. Run folders
    (and what is inside them) and a demo report's own images are lorakit's outputs, not datasets."""
    root = Path(root)
    out = []

    def walk(d: Path, level: int):
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        names = {e.name for e in entries}
        if RUN_MARK in names:  # a run folder (its sample grids and loss curve are not training images)
            return
        items = [] if REPORT_MARK in names else media(d)
        if items:
            out.append({"name": str(d.relative_to(root)) if d != root else ".", "items": len(items)})
        if level >= depth:
            return
        for e in entries:
            if e.is_dir(follow_symlinks=False) and e.name not in SKIP and not e.name.startswith("."):
                walk(Path(e.path), level + 1)

    walk(root, 0)
    return out


def runs_data(runs_root: Path) -> dict[str, dict]:
    """The data folders the runs under `runs_root` train on (each that exists and holds images or clips): name ->
    {"folder", "runs" (newest first), "config" (the newest run's resolved config)}. A folder inside the runs folder
    is named by its path there, one outside by "@" and its absolute path without the first "/" (a name that stays
    one in a URL)."""
    out: dict[str, dict] = {}
    for run in R.find_runs(runs_root):  # newest first
        try:
            cfg = R.run_config(run)
        except InputError:
            continue
        dirs = (cfg.get("data") or {}).get("dirs") or []
        for d in dirs:
            if not isinstance(d, str):
                continue
            folder = (run / d if not os.path.isabs(d) else Path(d)).resolve()
            if not folder.is_dir() or not media(folder):
                continue
            name = str(folder.relative_to(runs_root)) if folder.is_relative_to(runs_root) else \
                OUTSIDE + str(folder).lstrip("/")
            entry = out.setdefault(name, {"folder": folder, "runs": [], "config": cfg})
            entry["runs"].append(str(run.relative_to(runs_root)) if run != runs_root else ".")
    return out


def dataset_folder(root: Path, name: str) -> Path:
    folder = confined(root, name, "the datasets folder")
    if not folder.is_dir() or not media(folder):
        raise InputError(f"{name}: not a dataset folder (no images or clips)")
    return folder


def kind(path: Path) -> str:
    """"clip" or "image", as training reads the file in a flat dataset: a .gif or .webp of one frame is an image."""
    if path.suffix.lower() not in CLIP_EXTS:
        return "image"
    if path.suffix.lower() in ANIMATED_EXTS:
        from PIL import Image

        try:
            with Image.open(path) as im:
                return "clip" if getattr(im, "n_frames", 1) > 1 else "image"
        except (OSError, ValueError, Image.DecompressionBombError):
            return "image"  # the dataset check names what is wrong with it
    return "clip"


def items(folder: Path, name: str) -> list[dict]:
    """Each image or clip with its caption as training reads it (stripped; None when it has no .txt beside it)."""
    out = []
    for p in media(folder):
        cap = p.with_suffix(".txt")
        text = read_text(folder, cap).strip() if is_file(folder, cap) else None
        out.append({"stem": p.stem, "file": f"{name}/{p.name}", "kind": kind(p), "caption": text})
    return out


def set_caption(folder: Path, stem: str, text: str) -> Path:
    """Write an item's caption (atomically, beside its file). InputError for an unknown item or a caption longer
    than lorakit reads."""
    match = [p for p in media(folder) if p.stem == stem]
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


def run_using(folder: Path, known: dict[str, dict]) -> tuple[str, dict] | None:
    """The newest run that trains on `folder`, from `runs_data`'s answer: its name and resolved config. None when
    no run does."""
    want = folder.resolve()
    for entry in known.values():
        if entry["folder"] == want:
            return entry["runs"][0], entry["config"]
    return None


SIZES = ("resolution", "bucket_min_side", "bucket_max_side")  # what a form may set for the check


def check(folder: Path, family: str | None = None, used: tuple[str, dict] | None = None,
          sizes: dict | None = None) -> dict:
    """`lorakit cache --check` for this one folder: with the settings of `used`, the newest run that trains on it
    (`run_using`: its family, resolution and bucket sizes), else with the family's defaults; says which. Its
    problems, or the config problem that stopped the check. `sizes`: the form's data sizes (`SIZES`), instead of the
    run's or the defaults."""
    sizes = {k: v for k, v in (sizes or {}).items() if k in SIZES and v}
    used = None if sizes else used
    if used and (family is None or family == (used[1].get("model") or {}).get("family")):
        name, cfg = used
        raw = {"model": cfg.get("model"), "data": {**(cfg.get("data") or {}), "dirs": [str(folder)]}}
        settings = f"the settings of run {name}"
    else:
        raw = {"model": {"family": family}, "data": {"dirs": [str(folder)], **sizes}}
        settings = f"the defaults of {family}" + (" with " + ", ".join(f"{k} {v}" for k, v in sizes.items())
                                                   if sizes else "")
    try:
        report = check_data(validate(raw))
    except LorakitError as e:
        return {"problems": [], "error": e.message, "hint": getattr(e, "hint", None), "settings": settings}
    root = str(folder).rstrip("/") + "/"
    return {"problems": [{**p, "path": p["path"].removeprefix(root)} for p in report["problems"]],
            "items": report["items"], "buckets": report["buckets"], "warnings": report["warnings"],
            "settings": settings}
