"""A dataset seeded with one of each defect gets one report listing all of them."""

from PIL import Image

from lorakit.data.dataset import scan
from lorakit.data.demo import make_demo_dataset
from lorakit.data.images import open_image


def img(path, size=(64, 64), **kw):
    Image.new("RGB", size, (200, 30, 30)).save(path, **kw)


def item(path, caption, **kw):
    img(path, **kw)
    path.with_suffix(".txt").write_text(caption)


def test_clean_demo_datasets_have_no_problems(tmp_path):
    for layout, kw in (("flat", {}), ("edit", {}), ("edit-plus", {"control_dirs": ("control", "control_2")}),
                       ("video", {})):
        root = make_demo_dataset(tmp_path / layout, layout, count=3, size=64)
        s = scan(root, min_side=32, **kw)
        assert s.problems == [] and len(s.items) == 3, (layout, s.problems)
    s = scan(tmp_path / "edit-plus", control_dirs=("control", "control_2"), min_side=32)
    assert s.layout == "edit" and all(len(i.controls) == 2 for i in s.items)
    assert scan(tmp_path / "video", min_side=32).items[0].frames == 5


def test_flat_dataset_with_every_defect_reports_all_at_once(tmp_path):
    d = tmp_path
    item(d / "good.png", "a red square")
    img(d / "UPPER.JPG", format="JPEG")
    (d / "UPPER.txt").write_text("upper-case extension")
    img(d / "nocap.png")
    item(d / "empty.png", "  \n")
    (d / "broken.png").write_bytes(Image.new("RGB", (64, 64)).tobytes()[:100])
    (d / "broken.txt").write_text("x")
    good = (d / "good.png").read_bytes()
    (d / "truncated.png").write_bytes(good[: len(good) // 2])
    (d / "truncated.txt").write_text("x")
    item(d / "tiny.png", "x", size=(16, 16))
    item(d / "dup.png", "x")
    img(d / "dup.jpg", format="JPEG")
    s = scan(d, min_side=32)
    codes = sorted((p.code, p.path.rsplit("/", 1)[-1]) for p in s.problems)
    assert codes == [("duplicate-stem", "dup.jpg"), ("empty-caption", "empty.txt"), ("missing-caption", "nocap.png"),
                     ("too-small", "tiny.png"), ("unreadable", "broken.png"), ("unreadable", "truncated.png")]
    assert sorted(i.stem for i in s.items) == ["UPPER", "good"]  # bad items skipped, none silently dropped


def test_edit_pairs_report_both_directions(tmp_path):
    for sub in ("images", "control"):
        (tmp_path / sub).mkdir()
    item(tmp_path / "images" / "a.png", "make it blue")
    img(tmp_path / "control" / "a.png")
    item(tmp_path / "images" / "b.png", "x")  # no control
    img(tmp_path / "control" / "c.png")  # no target
    s = scan(tmp_path, min_side=32)
    assert s.layout == "edit"
    assert sorted((p.code, p.path.rsplit("/", 1)[-1]) for p in s.problems) == [("no-control", "b.png"),
                                                                              ("no-target", "c.png")]
    assert [i.stem for i in s.items] == ["a"]


def test_exif_orientation_and_modes(tmp_path):
    im = Image.new("RGB", (80, 40), (0, 0, 255))
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90° on display
    im.save(tmp_path / "rot.jpg", exif=exif.tobytes())
    assert open_image(tmp_path / "rot.jpg").size == (40, 80)
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    assert open_image(tmp_path / "clear.png").getpixel((0, 0)) == (255, 255, 255)
    Image.new("L", (8, 8), 7).save(tmp_path / "gray.png")
    assert open_image(tmp_path / "gray.png").mode == "RGB"


def test_trigger_word_prefixes_captions(tmp_path):
    item(tmp_path / "a.png", "a dog")
    assert scan(tmp_path, min_side=32, trigger="sks").items[0].caption == "sks a dog"


def test_clips_beside_their_captions_are_a_video_dataset_as_peers_take_them(tmp_path):
    import shutil

    from lorakit.data.dataset import detect_layout, scan
    from lorakit.data.demo import make_demo_dataset

    made = make_demo_dataset(tmp_path / "made", "video", count=2, size=64, frames=6)
    flat = tmp_path / "flat"
    shutil.copytree(made / "clips", flat)  # name.mp4 + name.txt, no clips/ folder
    (flat / "notes.md").write_text("mine")
    assert detect_layout(flat) == "video"
    s = scan(flat, min_side=32)
    assert len(s.items) == 2 and all(it.clip is not None and it.caption for it in s.items)
    assert [(p.code, p.path.rsplit("/", 1)[-1]) for p in s.problems] == [("unused-file", "notes.md")]  # named
