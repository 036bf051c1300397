"""What the data plan says before anything is encoded: images cut to another shape because the buckets cannot hold
their aspect ratio, and loss masks that mask everything."""

from PIL import Image

from lorakit.config import validate
from lorakit.data.demo import make_demo_dataset
from lorakit.data.plan import plan_data


def _cfg(tmp_path, data, **data_over):
    return validate({"profile": "cpu", "model": {"family": "flux", "path": str(tmp_path)},
                     "data": {"dirs": [str(data)], **data_over}, "output": {"dir": str(tmp_path / "o")}})


def test_buckets_that_collapse_every_aspect_ratio_are_said_with_a_setting_that_keeps_them(tmp_path):
    data = make_demo_dataset(tmp_path / "d", "flat", count=3, size=[(384, 256), (256, 384), (256, 256)])
    plan = plan_data(_cfg(tmp_path, data, resolution=256, bucket_min_side=256))
    assert set(plan.buckets()) == {"256x256"}
    (note,) = plan.notes
    assert note.startswith("2 of 3 images are cropped to a much different shape (e.g. ")
    assert "384x256 -> 256x256" in note or "256x384 -> 256x256" in note
    assert "bucket_min_side 256" in note and "data.bucket_min_side (e.g. 128)" in note
    kept = plan_data(_cfg(tmp_path, data, resolution=256, bucket_min_side=128))
    assert kept.notes == [] and len(kept.buckets()) == 3


def test_a_black_loss_mask_is_said_to_train_nothing(tmp_path):
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    (data / "masks").mkdir()
    stems = sorted(p.stem for p in data.iterdir() if p.suffix in (".png", ".jpg"))
    Image.new("L", (64, 64), 0).save(data / "masks" / f"{stems[0]}.png")
    Image.new("L", (64, 64), 255).save(data / "masks" / f"{stems[1]}.png")
    plan = plan_data(_cfg(tmp_path, data, resolution=64, bucket_min_side=32, bucket_max_side=128))
    (note,) = plan.notes
    assert note.startswith("1 loss mask(s) are black everywhere, so their items train nothing (loss 0), e.g. ")
    assert f"{stems[0]}.png" in note


def test_uncaptioned_images_train_with_the_default_caption_when_asked_and_are_named_otherwise(tmp_path):
    data = make_demo_dataset(tmp_path / "d", "flat", count=3, size=64)
    bare = sorted(data.glob("*.txt"))[0]
    bare.unlink()
    skipped = plan_data(_cfg(tmp_path, data, resolution=64, bucket_min_side=32, bucket_max_side=128))
    assert len(skipped.entries) == 2
    (p,) = skipped.problems
    assert p["code"] == "missing-caption" and "data.default_caption gives such items a caption" in p["message"]
    asked = plan_data(_cfg(tmp_path, data, resolution=64, bucket_min_side=32, bucket_max_side=128,
                           trigger="sks", default_caption=""))
    assert len(asked.entries) == 3 and not asked.problems
    assert {e.item.caption for e in asked.entries if e.item.stem == bare.stem} == {"sks"}
    assert any(n.startswith(f"1 item(s) in {data} have no caption file and train with data.default_caption")
               for n in asked.notes)
