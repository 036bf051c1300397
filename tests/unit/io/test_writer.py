"""`io.link_or_copy`: another name of a file where the filesystem links, a copy where it refuses; `io.atomic_path`:
the target whole or as it was, and no temporary file left, whenever an interrupt arrives."""

import os
import stat

import pytest

from lorakit.io import atomic_path, link_or_copy
from lorakit.io import writer as writer_mod


def test_a_file_is_linked_where_the_filesystem_links_and_copied_where_it_refuses(tmp_path, monkeypatch):
    src = tmp_path / "a.bin"
    src.write_bytes(b"weights")
    link_or_copy(src, tmp_path / "linked.bin")
    assert (tmp_path / "linked.bin").stat().st_ino == src.stat().st_ino and src.stat().st_nlink == 2

    def refused(a, b):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refused)
    link_or_copy(src, tmp_path / "copied.bin")
    got = tmp_path / "copied.bin"
    assert got.read_bytes() == b"weights" and got.stat().st_ino != src.stat().st_ino


@pytest.mark.parametrize("where", ["open", "fsync", "replace"])
def test_an_interrupt_anywhere_in_an_atomic_write_leaves_the_target_as_it_was_and_no_temporary_file(
        tmp_path, monkeypatch, where):
    """SIGTERM during a run's start reaches `atomic_path` as an interrupt (train.stop): seen in CI as a
    `.config.resolved.yaml.<random>.tmp` left behind when it came just after the temporary file was made."""
    target = tmp_path / "config.resolved.yaml"
    target.write_text("before")
    real = {"open": os.open, "fsync": os.fsync, "replace": os.replace}[where]

    def then_interrupted(*a, **kw):
        real(*a, **kw)  # the call itself done (the file made, synced or renamed), the interrupt right after
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_mod.os, where, then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("after")
    monkeypatch.undo()
    assert target.read_text() == ("after" if where == "replace" else "before")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.resolved.yaml"]


def test_an_atomic_write_makes_a_file_readable_as_any_other(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "a.txt") as tmp:
            assert tmp.name.startswith(".a.txt.") and tmp.name.endswith(".tmp")
            tmp.write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
