"""`io.link_or_copy`: another name of a file where the filesystem links, a copy where it refuses."""

import os

from lorakit.io import link_or_copy


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
