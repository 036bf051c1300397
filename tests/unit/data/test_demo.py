import hashlib

import numpy as np
import pytest
from PIL import Image

from lorakit.data.demo import COLORS, Scene, demo_layout_for, draw, make_demo_dataset
from lorakit.errors import InputError


def digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def test_flat_layout_every_extension_and_caption(tmp_path):
    d = make_demo_dataset(tmp_path / "flat", "flat", count=8, size=48, seed=3)
    images = sorted(p for p in d.iterdir() if p.suffix != ".txt")
    assert {p.suffix for p in images} == {".png", ".jpg", ".jpeg", ".webp"}
    for p in images:
        cap = p.with_suffix(".txt").read_text().strip()
        assert cap.startswith("a ") and "background" in cap
        with Image.open(p) as im:
            assert im.size == (48, 48) and im.mode == "RGB"


def test_caption_describes_the_picture():
    s = Scene("square", "red", "blue", "top", "left", 0.3)
    img = draw(s, 96)
    assert img.getpixel((16, 16)) == COLORS["red"]  # the top-left cell holds the shape
    assert img.getpixel((80, 80)) == COLORS["blue"]
    assert s.caption() == "a red square at the top left on a blue background"


def test_edit_pairs_are_a_recolour(tmp_path):
    d = make_demo_dataset(tmp_path / "e", "edit", count=3, size=48, seed=0)
    stems = sorted(p.stem for p in (d / "images").glob("*.png"))
    assert stems == sorted(p.stem for p in (d / "control").glob("*.png"))
    for stem in stems:
        cap = (d / "images" / f"{stem}.txt").read_text().strip()
        new_color = cap.split()[-1]
        assert cap.startswith("make the ") and new_color in COLORS
        target = Image.open(d / "images" / f"{stem}.png").convert("RGB")
        control = Image.open(d / "control" / f"{stem}.png").convert("RGB")
        assert COLORS[new_color] in {c for _, c in target.getcolors(4096)}
        assert COLORS[new_color] not in {c for _, c in control.getcolors(4096)}


def test_edit_plus_has_two_controls(tmp_path):
    d = make_demo_dataset(tmp_path / "p", "edit-plus", count=2, size=32)
    assert len(list((d / "control_2").glob("*.png"))) == 2 == len(list((d / "control").glob("*.png")))


def test_video_frames_move(tmp_path):
    from lorakit.data.video import Window, probe, read_window

    d = make_demo_dataset(tmp_path / "v", "video", count=2, size=32, frames=4, clip_format="frames")
    clip = d / "clips" / "clip_000"
    frames = sorted(clip.glob("*.png"))
    assert len(frames) == 4 and (d / "clips" / "clip_000.txt").read_text().strip().endswith("background")
    assert Image.open(frames[0]).tobytes() != Image.open(frames[-1]).tobytes()
    m = make_demo_dataset(tmp_path / "m", "video", count=2, size=32, frames=4)  # the default: .mp4 clips
    mp4 = m / "clips" / "clip_000.mp4"
    assert probe(mp4).frames == 4 and probe(mp4).size == (32, 32)
    decoded = read_window(mp4, Window(0.0, (0, 3)))
    for got, want in zip(decoded, (frames[0], frames[-1]), strict=True):  # H.264 at crf 1: near-lossless
        a, b = np.asarray(got, dtype=float), np.asarray(Image.open(want).convert("RGB"), dtype=float)
        assert np.abs(a - b).mean() < 4


def test_deterministic_by_seed(tmp_path):
    a = make_demo_dataset(tmp_path / "a", "edit", count=4, seed=7)
    b = make_demo_dataset(tmp_path / "b", "edit", count=4, seed=7)
    c = make_demo_dataset(tmp_path / "c", "edit", count=4, seed=8)
    assert digest(a) == digest(b) != digest(c)


def test_bad_arguments(tmp_path):
    with pytest.raises(InputError, match="layout"):
        make_demo_dataset(tmp_path, "grid")
    with pytest.raises(InputError):
        make_demo_dataset(tmp_path, "flat", count=0)


def test_layout_per_family():
    assert demo_layout_for("qwen-image-edit-plus") == "edit-plus"
    assert demo_layout_for("kandinsky5-t2v") == "video"
    assert demo_layout_for("flux") == "flat"
