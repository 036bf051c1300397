"""`paths.write_whole`: a cache file is written whole or not at all, and nothing else is left in the cache."""

import errno

import pytest

from lorakit.paths import write_whole


def test_a_cache_file_is_written_whole_with_nothing_beside_it(tmp_path):
    target = tmp_path / "sub" / "facts.json"
    assert write_whole(target, lambda tmp: tmp.write_text("{}"))
    assert target.read_text() == "{}" and [p.name for p in target.parent.iterdir()] == ["facts.json"]


def full_disk(tmp):
    tmp.write_text("half")  # some bytes got there, then the disk filled
    raise OSError(errno.ENOSPC, "No space left on device", str(tmp))


def interrupted(tmp):
    tmp.write_text("half")
    raise KeyboardInterrupt


@pytest.mark.parametrize("write", [full_disk, interrupted])
def test_a_full_disk_or_an_interrupt_leaves_the_old_file_and_no_temporary_one(tmp_path, write):
    target = tmp_path / "facts.json"
    target.write_text("old")
    if write is interrupted:
        with pytest.raises(KeyboardInterrupt):
            write_whole(target, write)
    else:
        assert write_whole(target, write) is False  # an unwritable cache only costs recomputing it
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["facts.json"]


def test_the_first_grid_kept_on_a_full_disk_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    import shutil

    from lorakit.train import first_grid

    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "cache"))
    grid = tmp_path / "grid.png"
    grid.write_bytes(b"png")

    def copy_then_full(src, dst):
        dst.write_bytes(b"p")
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(shutil, "copyfile", copy_then_full)
    first_grid.keep("k", grid)
    assert [p.name for p in first_grid.folder().iterdir()] == []
    monkeypatch.undo()
    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "cache"))
    first_grid.keep("k", grid)
    assert [p.name for p in first_grid.folder().iterdir()] == ["k.png"]
