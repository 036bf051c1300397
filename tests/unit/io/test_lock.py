"""The folder lock's file: never written through a link, and anything but a regular file refused by name."""

import os

import pytest

from lorakit.errors import InputError
from lorakit.io.lock import LOCK_NAME, FolderLock, holder


def test_a_linked_lock_file_is_refused_and_its_target_left_alone(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's data")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(InputError, match="symbolic link") as e:
        with FolderLock(out, "training run"):
            pass
    assert str(out / LOCK_NAME) in e.value.message and "rm" in e.value.hint
    assert victim.read_text() == "the user's data"  # not truncated, not overwritten
    assert holder(out) is None


@pytest.mark.parametrize("kind", ["folder", "dangling link", "fifo"])
def test_a_lock_path_that_is_no_regular_file_is_refused_by_name(tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_NAME
    if kind == "folder":
        lock.mkdir()
    elif kind == "dangling link":
        lock.symlink_to(tmp_path / "nowhere")
    else:
        os.mkfifo(lock)  # opening it for writing would wait for a reader forever
    with pytest.raises(InputError, match="lock file is") as e:
        with FolderLock(out, "cache build"):
            pass
    assert str(lock) in e.value.message
    assert holder(out) is None
    assert not (tmp_path / "nowhere").exists()  # the dangling link was not followed to create its target


def test_train_refuses_a_linked_lock_with_exit_2(tmp_path, tiny):
    import yaml
    from typer.testing import CliRunner

    from lorakit.cli.app import app
    from lorakit.data.demo import make_demo_dataset

    data = make_demo_dataset(tmp_path / "data", "flat", count=2, size=64)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "victim").write_text("keep me")
    (out / LOCK_NAME).symlink_to(tmp_path / "victim")
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 1}, "sampling": {"enabled": False}, "output": {"dir": str(out)}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["train", str(tmp_path / "c.yaml")])
    assert r.exit_code == 2 and "symbolic link" in r.output and "bug" not in r.output, r.output
    assert (tmp_path / "victim").read_text() == "keep me"
