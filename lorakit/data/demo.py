"""Procedurally drawn demo datasets in the layouts users have. Deterministic by seed.

- `flat`:      name.{png,jpg,jpeg,webp} + name.txt          (text-to-image)
- `edit`:      images/ + control/ (same stems); the edit is a recolour, captioned as an instruction
- `edit-plus`: images/ + control/ + control_2/ (the shape, and a swatch of the colour to paint it)
- `video`:     clips/<name>/000.png ... + clips/<name>.txt   (a shape moving across the frame)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from lorakit.data.video import write_clip
from lorakit.errors import InputError
from lorakit.models.base import family_adapter

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
    "orange": (240, 140, 30), "purple": (140, 60, 190), "white": (245, 245, 245), "black": (20, 20, 20),
    "gray": (128, 128, 128), "pink": (240, 130, 180), "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle", "ring", "cross")
ROWS = ("top", "middle", "bottom")
COLS = ("left", "center", "right")
LAYOUTS = ("flat", "edit", "edit-plus", "video")
_EXTS = ("png", "jpg", "jpeg", "webp")


@dataclass(frozen=True)
class Scene:
    shape: str
    color: str
    background: str
    row: str
    col: str
    scale: float  # shape size as a fraction of the image side

    def caption(self) -> str:
        where = "in the center" if (self.row, self.col) == ("middle", "center") else f"at the {self.row} {self.col}"
        return f"a {self.color} {self.shape} {where} on a {self.background} background"


def random_scene(rng: random.Random) -> Scene:
    color, background = rng.sample(sorted(COLORS), 2)
    return Scene(shape=rng.choice(SHAPES), color=color, background=background, row=rng.choice(ROWS),
                 col=rng.choice(COLS), scale=rng.uniform(0.25, 0.4))


def draw(scene: Scene, size: int | tuple[int, int], center: tuple[float, float] | None = None) -> Image.Image:
    """Render a scene. `center` (fractions of width/height) overrides the row/column placement."""
    w, h = (size, size) if isinstance(size, int) else size
    img = Image.new("RGB", (w, h), COLORS[scene.background])
    d = ImageDraw.Draw(img)
    if center is None:
        center = ((COLS.index(scene.col) + 0.5) / 3, (ROWS.index(scene.row) + 0.5) / 3)
    cx, cy = center[0] * w, center[1] * h
    r = scene.scale * min(w, h) / 2
    fill = COLORS[scene.color]
    box = [cx - r, cy - r, cx + r, cy + r]
    if scene.shape == "circle":
        d.ellipse(box, fill=fill)
    elif scene.shape == "square":
        d.rectangle(box, fill=fill)
    elif scene.shape == "triangle":
        d.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    elif scene.shape == "ring":
        d.ellipse(box, outline=fill, width=max(2, int(r / 3)))
    elif scene.shape == "cross":
        t = r / 3
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
    return img


def _save(img: Image.Image, path: Path) -> None:
    fmt = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}[path.suffix[1:].lower()]
    kw = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
    img.save(path, format=fmt, **kw)


def make_demo_dataset(out_dir: str | Path, layout: str = "flat", count: int = 8,
                      size: int | tuple[int, int] | list[tuple[int, int]] = 64, seed: int = 0, frames: int = 5,
                      clip_format: str = "mp4") -> Path:
    """Write a demo dataset.

    Args:
        out_dir: target folder (created; existing demo files with the same names are overwritten).
        layout: one of `LAYOUTS`.
        count: number of items (clips for `video`).
        size: image side in pixels, a (width, height), or a list of sides and (width, height) pairs (item k
            takes the k-th, cycling: datasets in several aspect ratios).
        seed: same seed, same files.
        frames: frames per clip (`video`).
        clip_format: `video` clips as "mp4" files (H.264, 8 fps) or "frames" (a folder of PNGs per clip).

    Returns:
        The dataset folder.
    """
    if layout not in LAYOUTS:
        raise InputError(f"unknown demo layout {layout!r}", "valid: " + ", ".join(LAYOUTS))
    if clip_format not in ("frames", "mp4", "webm", "mov", "mkv", "gif", "webp"):
        raise InputError(f"unknown clip format {clip_format!r}", "valid: frames, mp4, webm, mov, mkv, gif, webp")
    sides = [size] if isinstance(size, int) or (isinstance(size, tuple) and isinstance(size[0], int)) else list(size)
    sizes = [(s, s) if isinstance(s, int) else tuple(s) for s in sides]
    if count < 1 or min(min(s) for s in sizes) < 16:
        raise InputError(f"demo dataset needs count >= 1 and sides >= 16, got count={count} size={size}")
    out = Path(out_dir)
    rng = random.Random(seed)
    if layout == "flat":
        out.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            s = random_scene(rng)
            stem = f"item_{i:03d}"
            _save(draw(s, sizes[i % len(sizes)]), out / f"{stem}.{_EXTS[i % len(_EXTS)]}")
            (out / f"{stem}.txt").write_text(s.caption() + "\n", encoding="utf-8")
    elif layout in ("edit", "edit-plus"):
        dirs = {n: out / n for n in ("images", "control") + (("control_2",) if layout == "edit-plus" else ())}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            s = random_scene(rng)
            new = rng.choice([c for c in sorted(COLORS) if c not in (s.color, s.background)])
            target = Scene(s.shape, new, s.background, s.row, s.col, s.scale)
            stem = f"edit_{i:03d}"
            wh = sizes[i % len(sizes)]
            _save(draw(target, wh), dirs["images"] / f"{stem}.png")
            _save(draw(s, wh), dirs["control"] / f"{stem}.png")
            if layout == "edit":
                caption = f"make the {s.shape} {new}"
            else:
                _save(Image.new("RGB", wh, COLORS[new]), dirs["control_2"] / f"{stem}.png")
                caption = f"paint the {s.shape} of picture 1 with the color of picture 2"
            (dirs["images"] / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
    else:  # video
        clips = out / "clips"
        clips.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            s = random_scene(rng)
            stem = f"clip_{i:03d}"
            y = (ROWS.index(s.row) + 0.5) / 3
            images = [draw(s, sizes[i % len(sizes)], center=(0.2 + 0.6 * f / max(frames - 1, 1), y))
                      for f in range(frames)]
            if clip_format == "frames":
                (clips / stem).mkdir(exist_ok=True)
                for f, im in enumerate(images):
                    _save(im, clips / stem / f"{f:03d}.png")
            else:
                write_clip(clips / f"{stem}.{clip_format}", images, fps=8)
            (clips / f"{stem}.txt").write_text(
                f"a {s.color} {s.shape} moving from left to right on a {s.background} background\n",
                encoding="utf-8")
    return out


def demo_layout_for(family: str) -> str:
    """The demo dataset layout a family trains on (its adapter's layout; several controls: edit-plus)."""
    a = family_adapter(family)
    return "edit-plus" if a.layout == "edit" and a.max_controls > 1 else a.layout
