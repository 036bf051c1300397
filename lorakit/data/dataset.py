"""Dataset discovery and validation: every problem found in one pass, each with its file.

Layouts:
- `flat`:  name.{png,jpg,jpeg,webp} + name.txt
- `edit`:  images/ (targets + captions) and one or more control folders (control/, control_2/, ...)
           holding images with the same stems
- `video`: clips/<name>/ frame folders or clips/<name>.mp4, each with clips/<name>.txt
Extensions are matched case-insensitively. Images are opened with their EXIF orientation applied
and converted to RGB (transparency composited on white).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.errors import InputError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_EXTS = (".mp4",)
LAYOUTS = ("auto", "flat", "edit", "video")


@dataclass
class Item:
    stem: str
    target: Path  # image file, frame folder, or video file
    caption: str
    controls: list[Path] = field(default_factory=list)
    size: tuple[int, int] | None = None  # (width, height) after EXIF orientation
    frames: int | None = None


@dataclass
class Problem:
    path: str
    code: str  # missing-caption, empty-caption, unreadable, too-small, no-target, no-control, duplicate-stem, ...
    message: str


@dataclass
class Scan:
    root: Path
    layout: str
    items: list[Item] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"root": str(self.root), "layout": self.layout, "items": len(self.items),
                "problems": [p.__dict__ for p in self.problems]}


def open_image(path: Path):
    """An RGB PIL image with EXIF orientation applied (alpha composited on white)."""
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        im.load()
        if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
            im = im.convert("RGBA")
            bg = Image.new("RGB", im.size, (255, 255, 255))
            bg.paste(im, mask=im.getchannel("A"))
            return bg
        return im.convert("RGB")


def _check_image(path: Path, min_side: int, problems: list[Problem]) -> tuple[int, int] | None:
    try:
        im = open_image(path)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a problem of that file
        problems.append(Problem(str(path), "unreadable", f"cannot decode ({type(e).__name__}: {str(e)[:80]})"))
        return None
    w, h = im.size
    if min(w, h) < min_side:
        problems.append(Problem(str(path), "too-small",
                                f"{w}x{h} is smaller than the smallest bucket side {min_side}"))
        return None
    return w, h


def _media(folder: Path, exts) -> tuple[dict[str, Path], list[Problem]]:
    """stem -> file for files with the given extensions; duplicate stems are problems."""
    by_stem: dict[str, list[Path]] = defaultdict(list)
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if p.is_file() and p.suffix.lower() in exts:
            by_stem[p.stem].append(p)
    out, problems = {}, []
    for stem, paths in by_stem.items():
        if len(paths) > 1:
            problems.append(Problem(str(paths[0]), "duplicate-stem",
                                    f"{', '.join(p.name for p in paths)} share the stem {stem!r}: keep one"))
        else:
            out[stem] = paths[0]
    return out, problems


def _caption(path: Path, ext: str, problems: list[Problem], trigger: str | None) -> str | None:
    cap = path.with_suffix(ext) if path.is_file() else path.parent / (path.name + ext)
    if not cap.is_file():
        problems.append(Problem(str(path), "missing-caption", f"no caption file {cap.name}"))
        return None
    try:
        text = cap.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        problems.append(Problem(str(cap), "unreadable", f"caption not UTF-8 text ({type(e).__name__})"))
        return None
    if not text:
        problems.append(Problem(str(cap), "empty-caption", "caption file is empty"))
        return None
    return f"{trigger} {text}" if trigger else text


def detect_layout(root: Path) -> str:
    if (root / "images").is_dir():
        return "edit"
    if (root / "clips").is_dir():
        return "video"
    return "flat"


def scan(root, layout: str = "auto", control_dirs=("control",), caption_ext: str = ".txt", min_side: int = 256,
         trigger: str | None = None, check_images: bool = True) -> Scan:
    """Find items and every problem (never stops at the first)."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"dataset folder not found: {root}")
    if layout not in LAYOUTS:
        raise InputError(f"unknown dataset layout {layout!r}", "valid: " + ", ".join(LAYOUTS))
    layout = detect_layout(root) if layout == "auto" else layout
    s = Scan(root=root, layout=layout)
    if layout == "flat":
        media, probs = _media(root, IMAGE_EXTS)
        s.problems += probs
        _items(s, media, {}, caption_ext, min_side, trigger, check_images)
    elif layout == "edit":
        media, probs = _media(root / "images", IMAGE_EXTS)
        s.problems += probs
        if not (root / "images").is_dir():
            s.problems.append(Problem(str(root / "images"), "no-target", "edit datasets need an images/ folder"))
        controls = {}
        for name in control_dirs:
            cdir = root / name
            if not cdir.is_dir():
                s.problems.append(Problem(str(cdir), "no-control", f"control folder {name}/ is missing"))
                continue
            cmedia, cprobs = _media(cdir, IMAGE_EXTS)
            s.problems += cprobs
            for stem in sorted(set(cmedia) - set(media)):
                s.problems.append(Problem(str(cmedia[stem]), "no-target", "control without a target in images/"))
            controls[name] = cmedia
        _items(s, media, controls, caption_ext, min_side, trigger, check_images)
    else:
        _video_items(s, root / "clips", caption_ext, min_side, trigger, check_images)
    if not s.items and not s.problems:
        s.problems.append(Problem(str(root), "empty", f"no {layout} items found"))
    return s


def _items(s: Scan, media: dict, controls: dict, ext: str, min_side: int, trigger, check: bool) -> None:
    for stem, path in media.items():
        before = len(s.problems)
        caption = _caption(path, ext, s.problems, trigger)
        size = _check_image(path, min_side, s.problems) if check else None
        ctrl = []
        for name, cmedia in controls.items():
            if stem not in cmedia:
                s.problems.append(Problem(str(path), "no-control", f"target without a control in {name}/"))
            else:
                ctrl.append(cmedia[stem])
                if check:
                    _check_image(cmedia[stem], min_side, s.problems)
        if len(s.problems) == before:
            s.items.append(Item(stem, path, caption, ctrl, size))


def _video_items(s: Scan, clips: Path, ext: str, min_side: int, trigger, check: bool) -> None:
    if not clips.is_dir():
        s.problems.append(Problem(str(clips), "no-target", "video datasets need a clips/ folder"))
        return
    files, probs = _media(clips, VIDEO_EXTS)
    s.problems += probs
    folders = {p.name: p for p in sorted(clips.iterdir()) if p.is_dir()}
    for stem in sorted(set(files) & set(folders)):
        s.problems.append(Problem(str(folders[stem]), "duplicate-stem", f"{stem}.mp4 and {stem}/ are both clips"))
    for stem, path in sorted({**files, **folders}.items()):
        before = len(s.problems)
        caption = _caption(path, ext, s.problems, trigger)
        frames, size = None, None
        if path.is_dir():
            frame_files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTS)
            if not frame_files:
                s.problems.append(Problem(str(path), "unreadable", "frame folder holds no images"))
            elif check:
                sizes = {_check_image(f, min_side, s.problems) for f in frame_files}
                if len(sizes - {None}) > 1:
                    s.problems.append(Problem(str(path), "frame-sizes", f"frames differ in size: {sorted(sizes - {None})}"))
                size = next(iter(sizes - {None}), None)
            frames = len(frame_files)
        elif path.stat().st_size == 0:
            s.problems.append(Problem(str(path), "unreadable", "empty video file"))
        if len(s.problems) == before:
            s.items.append(Item(stem, path, caption, [], size, frames))
