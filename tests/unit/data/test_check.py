"""`lorakit cache --check`: every dataset folder scanned with the family's layout, every problem listed."""

import pytest

from lorakit.config import validate
from lorakit.data.check import check
from lorakit.data.demo import make_demo_dataset
from lorakit.data.plan import control_dirs_for
from lorakit.plan.resolve import resolve


def cfg(family, *dirs, **data):
    return validate({"model": {"family": family}, "data": {"dirs": [str(d) for d in dirs], "resolution": 64,
                                                           "bucket_min_side": 32, "bucket_max_side": 128, **data}})


def test_layout_comes_from_the_family(tmp_path):
    flat = make_demo_dataset(tmp_path / "f", "flat", count=3, size=64)
    video = make_demo_dataset(tmp_path / "v", "video", count=2, size=64)
    assert check(cfg("flux", flat))["datasets"][0]["layout"] == "flat"
    assert check(cfg("kandinsky5-t2v", video))["items"] == 2
    r = check(cfg("flux-kontext", flat))  # an edit family given a flat folder: no images/, no control/
    assert r["items"] == 0 and {p["code"] for p in r["problems"]} >= {"no-target", "no-control"}


def test_several_controls_are_found_for_families_that_take_them(tmp_path):
    ds = make_demo_dataset(tmp_path / "e", "edit-plus", count=2, size=64)
    (ds / "control_3").mkdir()  # an empty third control folder is still a control folder: its items lack one
    assert control_dirs_for(cfg("qwen-image-edit-plus", ds), ds) == ["control", "control_2", "control_3"]
    assert control_dirs_for(cfg("qwen-image-edit", ds), ds) == ["control"]  # one control: the default folder
    r = check(cfg("qwen-image-edit-plus", ds))
    assert r["items"] == 0 and [p["code"] for p in r["problems"]] == ["no-control", "no-control"]
    explicit = cfg("qwen-image-edit-plus", ds, control_dirs=["control_2"])
    assert control_dirs_for(explicit, ds) == ["control_2"] and check(explicit)["items"] == 2


def test_buckets_are_counted_and_a_missing_folder_is_reported(tmp_path):
    flat = make_demo_dataset(tmp_path / "f", "flat", count=3, size=64)
    r = check(cfg("flux", flat))
    assert r["buckets"] == {"64x64": 3}
    from lorakit.errors import InputError

    with pytest.raises(InputError, match="data.dirs: no such folder"):  # resolving checks every path once
        check(resolve(cfg("flux", tmp_path / "nope"), paths=("data",), train=False).cfg)
