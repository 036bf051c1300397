"""Dataset discovery and validation: every problem found in one pass, each with its file.

Layouts:
- `flat`:  name.{png,jpg,jpeg,webp,bmp,tif,tiff,gif} + name.txt
- `edit`:  images/ (targets + captions) and one or more control folders (control/, control_2/, ...)
           holding images with the same stems
- `video`: clips/<name>.{mp4,webm,mov,mkv,avi,m4v,gif,webp} or clips/<name>/ frame folders, each with
           clips/<name>.txt (clips are probed here: `lorakit.data.video`); or the same side by side in the
           dataset folder itself (name.mp4 + name.txt, as peer trainers take them)
Extensions (of images and captions) are matched case-insensitively. Every file and folder in a dataset is
either used or reported by name: captions without an image, files of other kinds, broken links, folders
named like images, hidden files (one line per folder). Images are opened with their EXIF orientation applied
and converted to 8-bit RGB: 16-bit pixels are scaled (not clipped), float pixels in 0..1 are scaled, pixel
data whose scale cannot be known (negative, HDR, 32-bit integers beyond 16 bits) is refused with the reason;
transparency is composited on white; an animated GIF/WebP is not an image (it is a clip).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.config.base import MAX_TEXT_CHARS
from lorakit.data.images import IMAGE_EXTS, PixelError, has_alpha, open_image
from lorakit.data.video import CLIP_EXTS, CONTAINER_EXTS, ClipError, ClipInfo, frame_files, probe
from lorakit.errors import InputError

VIDEO_EXTS = CLIP_EXTS
LAYOUTS = ("auto", "flat", "edit", "video")


@dataclass
class Item:
    stem: str
    target: Path  # image file, frame folder, or video file
    caption: str
    controls: list[Path] = field(default_factory=list)
    size: tuple[int, int] | None = None  # (width, height) after EXIF orientation (clips: as displayed)
    frames: int | None = None
    control_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) of each control
    clip: ClipInfo | None = None  # frame times (video layout)
    mask: Path | None = None  # loss mask (masks/<stem>.*): white trains, black is ignored
    mask_alpha: bool = False  # the mask is `mask`'s alpha channel (data.alpha_mask: the target's own)


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
    default_caption: str | None = None  # for items without a caption file (data.default_caption)
    uncaptioned: list[str] = field(default_factory=list)  # the items that took it

    def to_dict(self) -> dict:
        return {"root": str(self.root), "layout": self.layout, "items": len(self.items),
                "problems": [p.__dict__ for p in self.problems]}


def _check_image(path: Path, min_side: int, problems: list[Problem]) -> tuple[int, int] | None:
    try:
        im = open_image(path)
    except PixelError as e:
        problems.append(Problem(str(path), "unsupported-pixels", e.message.removeprefix(f"{path}: ")
                                + (f" ({e.hint})" if e.hint else "")))
        return None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a problem of that file
        problems.append(Problem(str(path), "unreadable", f"cannot decode ({type(e).__name__}: {str(e)[:80]})"))
        return None
    w, h = im.size
    if min(w, h) < min_side:
        problems.append(Problem(str(path), "too-small",
                                f"{w}x{h} is smaller than the smallest bucket side {min_side}"))
        return None
    return w, h


@dataclass
class _Listing:
    """One folder's entries, sorted into what a layout uses and what it reports."""

    media: dict[str, Path] = field(default_factory=dict)  # stem -> file
    captions: dict[str, Path] = field(default_factory=dict)  # stem -> caption file
    folders: dict[str, Path] = field(default_factory=dict)
    other: list[Path] = field(default_factory=list)
    hidden: list[Path] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    duplicates: set[str] = field(default_factory=set)  # stems of several media files (reported as such)


def _list(folder: Path, exts, caption_ext: str | None) -> _Listing:
    out = _Listing()
    if not folder.is_dir():
        return out
    by_stem: dict[str, list[Path]] = defaultdict(list)
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            out.hidden.append(p)
        elif p.is_symlink() and not p.exists():
            out.problems.append(Problem(str(p), "broken-link", "a symbolic link to something that does not exist"))
        elif p.is_dir():
            if p.suffix.lower() in exts:
                out.problems.append(Problem(str(p), "not-a-file", f"a folder named like a {p.suffix} file"))
            else:
                out.folders[p.name] = p
        elif not p.is_file():
            out.problems.append(Problem(str(p), "not-a-file", "not a regular file (a pipe, socket or device)"))
        elif p.suffix.lower() in exts:
            by_stem[p.stem].append(p)
        elif caption_ext and p.suffix.lower() == caption_ext.lower():
            if p.stem in out.captions:  # a.txt and a.TXT
                out.problems.append(Problem(str(p), "duplicate-stem",
                                            f"{out.captions[p.stem].name} and {p.name} both caption {p.stem!r}"))
            else:
                out.captions[p.stem] = p
        else:
            out.other.append(p)
    for stem, paths in by_stem.items():
        if len(paths) > 1:
            out.duplicates.add(stem)
            out.problems.append(Problem(str(paths[0]), "duplicate-stem",
                                        f"{', '.join(p.name for p in paths)} share the stem {stem!r}: keep one"))
        else:
            out.media[stem] = paths[0]
    return out


def _report_unused(s: Scan, listing: _Listing, used_captions: set[str], folders_used=(), what="") -> None:
    """Everything in a folder that the layout did not use, by name."""
    s.problems += listing.problems
    for stem, cap in listing.captions.items():
        if stem not in used_captions and stem not in listing.duplicates:
            s.problems.append(Problem(str(cap), "orphan-caption", f"a caption without a{what} file named {stem!r}"))
    for p in listing.other:
        s.problems.append(Problem(str(p), "unused-file", f"lorakit does not use {p.suffix or 'extension-less'} "
                                                         f"files here"))
    for name, p in listing.folders.items():
        if name not in folders_used:
            s.problems.append(Problem(str(p), "unused-folder", "a sub-folder this layout does not read"))
    if listing.hidden:
        names = ", ".join(p.name for p in listing.hidden[:3]) + (" ..." if len(listing.hidden) > 3 else "")
        s.problems.append(Problem(str(listing.hidden[0].parent), "hidden-files",
                                  f"{len(listing.hidden)} hidden file(s) not used ({names})"))


class _TooLong(Exception):
    def __init__(self, size: int):
        self.size = size


def _caption(path: Path, listing: _Listing, s: Scan, trigger: str | None, ext: str) -> str | None:
    stem = path.stem if path.is_file() else path.name
    cap = listing.captions.get(stem)
    problems = s.problems
    if cap is None and s.default_caption is not None:
        text = " ".join(t for t in (trigger, s.default_caption) if t)
        if text:
            s.uncaptioned.append(path.name)
            return text
    if cap is None:
        problems.append(Problem(str(path), "missing-caption", f"no caption file {stem}{ext}"
                                + ("" if s.default_caption is not None else " (data.default_caption gives such "
                                                                             "items a caption)")))
        return None
    try:
        with open(cap, "rb") as f:  # read no more than a caption can be
            raw = f.read(4 * MAX_TEXT_CHARS + 1)
        if len(raw) > 4 * MAX_TEXT_CHARS:
            raise _TooLong(cap.stat().st_size)
        text = raw.decode("utf-8").strip()
        if len(text) > MAX_TEXT_CHARS:
            raise _TooLong(len(raw))
    except _TooLong as e:
        problems.append(Problem(str(cap), "caption-too-long", f"caption of {e.size / 1024:.0f} KiB; lorakit takes "
                                f"captions up to {MAX_TEXT_CHARS} characters (the text encoders read at most 512 to "
                                "1024 tokens)"))
        return None
    except (OSError, UnicodeDecodeError) as e:
        problems.append(Problem(str(cap), "unreadable", f"caption not UTF-8 text ({type(e).__name__})"))
        return None
    if not text:
        problems.append(Problem(str(cap), "empty-caption", "caption file is empty"))
        return None
    return f"{trigger} {text}" if trigger else text


def detect_layout(root: Path) -> str:
    """edit (an images/ folder), video (a clips/ folder, or video files beside their captions as peer trainers
    take them), else flat."""
    if (root / "images").is_dir():
        return "edit"
    if (root / "clips").is_dir():
        return "video"
    if any(p.suffix.lower() in CONTAINER_EXTS for p in root.iterdir() if p.is_file()):
        return "video"
    return "flat"


def scan(root, layout: str = "auto", control_dirs=("control",), caption_ext: str = ".txt", min_side: int = 256,
         trigger: str | None = None, check_images: bool = True, alpha_mask: bool = False,
         default_caption: str | None = None) -> Scan:
    """Find items and every problem (never stops at the first); every entry is used or reported."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"dataset folder not found: {root}")
    if layout not in LAYOUTS:
        raise InputError(f"unknown dataset layout {layout!r}", "valid: " + ", ".join(LAYOUTS))
    layout = detect_layout(root) if layout == "auto" else layout
    s = Scan(root=root, layout=layout, default_caption=default_caption)
    if layout == "flat":
        listing = _list(root, IMAGE_EXTS, caption_ext)
        masks = _masks(s, root, listing)
        used = _items(s, listing, {}, caption_ext, min_side, trigger, check_images, masks, alpha_mask)
        _report_unused(s, listing, used, what="n image", folders_used={"masks"})
    elif layout == "edit":
        top = _list(root, (), None)
        if not (root / "images").is_dir():
            s.problems.append(Problem(str(root / "images"), "no-target", "edit datasets need an images/ folder"))
        listing = _list(root / "images", IMAGE_EXTS, caption_ext)
        controls = {}
        for name in control_dirs:
            cdir = root / name
            if not cdir.is_dir():
                s.problems.append(Problem(str(cdir), "no-control", f"control folder {name}/ is missing"))
                continue
            clist = _list(cdir, IMAGE_EXTS, None)
            _report_unused(s, clist, set())
            for stem in sorted(set(clist.media) - set(listing.media)):
                s.problems.append(Problem(str(clist.media[stem]), "no-target", "control without a target in images/"))
            controls[name] = clist.media
        masks = _masks(s, root, listing)
        used = _items(s, listing, controls, caption_ext, min_side, trigger, check_images, masks, alpha_mask)
        _report_unused(s, listing, used, what="n image")
        _report_unused(s, top, set(), folders_used={"images", "masks", *control_dirs})
    elif (root / "clips").is_dir():
        _report_unused(s, _list(root, (), None), set(), folders_used={"clips"})
        _video_items(s, root / "clips", caption_ext, min_side, trigger, check_images)
    else:  # name.mp4 + name.txt side by side (frame folders beside them are clips too)
        _video_items(s, root, caption_ext, min_side, trigger, check_images)
    if not s.items and not s.problems:
        s.problems.append(Problem(str(root), "empty", f"no {layout} items found"))
    return s


def _masks(s: Scan, root: Path, targets: _Listing) -> dict | None:
    """masks/<stem>.<image ext> beside the targets (None when there is no masks/ folder); a mask without a
    target and anything else there is reported."""
    if not (root / "masks").is_dir():
        return None
    listing = _list(root / "masks", IMAGE_EXTS, None)
    _report_unused(s, listing, set())
    for stem in sorted(set(listing.media) - set(targets.media)):
        s.problems.append(Problem(str(listing.media[stem]), "no-target", "mask without a target image"))
    return listing.media


def _items(s: Scan, listing: _Listing, controls: dict, ext: str, min_side: int, trigger, check: bool,
           masks: dict | None = None, alpha_mask: bool = False) -> set[str]:
    """Items from a listing's media; returns the stems whose captions were used."""
    used = set()
    for stem, path in listing.media.items():
        before = len(s.problems)
        used.add(stem)
        caption = _caption(path, listing, s, trigger, ext)
        size = _check_image(path, min_side, s.problems) if check else None
        ctrl, sizes = [], []
        for name, cmedia in controls.items():
            if stem not in cmedia:
                s.problems.append(Problem(str(path), "no-control", f"target without a control in {name}/"))
            else:
                ctrl.append(cmedia[stem])
                if check:
                    sizes.append(_check_image(cmedia[stem], min_side, s.problems))
        mask, alpha = None, False
        if masks is None and alpha_mask and size:  # data.alpha_mask: the image's own transparency
            if has_alpha(path):
                mask, alpha = path, True
            else:
                s.problems.append(Problem(str(path), "no-alpha", "data.alpha_mask is on but this image has no "
                                                                 "alpha channel (give it one, or a masks/ file)"))
        elif masks is not None:
            mask = masks.get(stem)
            if mask is None:
                s.problems.append(Problem(str(path), "no-mask", "target without a mask in masks/ (every item "
                                                                "needs one when the folder exists)"))
            elif check and size:
                msize = _check_image(mask, 1, s.problems)
                if msize and msize != size:
                    s.problems.append(Problem(str(mask), "mask-size", f"mask is {msize[0]}x{msize[1]}, its image "
                                                                      f"{size[0]}x{size[1]}"))
        if len(s.problems) == before:
            s.items.append(Item(stem, path, caption, ctrl, size, control_sizes=sizes, mask=mask, mask_alpha=alpha))
    return used


def _video_items(s: Scan, clips: Path, ext: str, min_side: int, trigger, check: bool) -> None:
    if not clips.is_dir():
        s.problems.append(Problem(str(clips), "no-target", "video datasets need a clips/ folder, or the clips "
                                                           "beside their captions"))
        return
    listing = _list(clips, VIDEO_EXTS, ext)
    folders = listing.folders
    for stem in sorted(set(listing.media) & set(folders)):
        s.problems.append(Problem(str(folders[stem]), "duplicate-stem",
                                  f"{listing.media[stem].name} and {stem}/ are both clips"))
    used = set()
    for stem, path in sorted({**listing.media, **folders}.items()):
        before = len(s.problems)
        used.add(stem)
        caption = _caption(path, listing, s, trigger, ext)
        if path.is_dir():
            flist = _list(path, IMAGE_EXTS, None)
            _report_unused(s, flist, set())
            if check and len(frame_files(path)) > 1:
                sizes = {_check_image(f, min_side, s.problems) for f in frame_files(path)} - {None}
                if len(sizes) > 1:
                    s.problems.append(Problem(str(path), "frame-sizes", f"frames differ in size: {sorted(sizes)}"))
        elif path.stat().st_size == 0:
            s.problems.append(Problem(str(path), "unreadable", "empty video file"))
        clip = None
        if check and len(s.problems) == before:
            try:
                clip = probe(path)
            except ClipError as e:
                s.problems.append(Problem(str(path), "unreadable", e.message.removeprefix(f"{path}: ")))
            else:
                if min(clip.size) < min_side:
                    s.problems.append(Problem(str(path), "too-small", f"{clip.size[0]}x{clip.size[1]} is smaller "
                                                                      f"than the smallest bucket side {min_side}"))
        if len(s.problems) == before:
            s.items.append(Item(stem, path, caption, [], clip.size if clip else None,
                                clip.frames if clip else None, clip=clip))
    listing.folders = {}  # every folder in clips/ is a clip (used or reported above)
    _report_unused(s, listing, used, what=" clip")
