"""The read-ahead of a model's files (lorakit.io.prefetch): reads them all, in order, within its memory budget,
stops when told, and never raises (the load names a file's problem)."""

from __future__ import annotations

import os

import pytest

from lorakit.io import prefetch
from lorakit.io.prefetch import Prefetch, available_bytes


def _files(tmp_path, sizes):
    out = []
    for i, n in enumerate(sizes):
        f = tmp_path / f"model-{i:05d}.safetensors"
        f.write_bytes(os.urandom(n))
        out.append(f)
    return out


def _waited(monkeypatch):
    """The one-byte reads that wait for each window, as (file size, offset) in order."""
    seen = []
    real = os.pread

    def pread(fd, n, off):
        seen.append((os.fstat(fd).st_size, off))
        return real(fd, n, off)

    monkeypatch.setattr(prefetch.os, "pread", pread)
    return seen


def test_every_file_is_read_in_order_window_by_window(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WINDOW", 1000)
    files = _files(tmp_path, [2500, 700])
    seen = _waited(monkeypatch)
    p = Prefetch(files, budget=None)
    facts = p.stop(finish=True)
    assert p.done == p.total == 3200 and not p.limited and p.error is None
    assert seen == [(2500, 999), (2500, 1999), (2500, 2499), (700, 699)]  # each window's last byte, in load order
    assert facts["read_ahead"].startswith("0.0 of 0.0 MiB in ")
    assert "stopped" not in facts["read_ahead"] and "rest" not in facts["read_ahead"]


def test_without_posix_fadvise_the_windows_are_read_into_one_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WINDOW", 1000)
    monkeypatch.delattr(prefetch.os, "posix_fadvise", raising=False)
    files = _files(tmp_path, [2500])
    reads = []
    real = os.preadv

    def preadv(fd, bufs, off):
        reads.append((off, len(bufs[0])))
        return real(fd, bufs, off)

    monkeypatch.setattr(prefetch.os, "preadv", preadv)
    p = Prefetch(files, budget=None)
    p.stop(finish=True)
    assert reads == [(0, 1000), (1000, 1000), (2000, 500)] and p.done == 2500


def test_it_stops_at_its_memory_budget_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WINDOW", 1000)
    files = _files(tmp_path, [2500, 2500])
    p = Prefetch(files, budget=3000)
    facts = p.stop(finish=True)
    assert p.limited and p.done <= 3000 and p.done == 2500  # the second file's first window would pass it
    assert facts["read_ahead"].endswith("stopped at the memory the machine had available")


def test_stop_ends_the_reading_and_what_is_left_is_the_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WINDOW", 1000)
    files = _files(tmp_path, [50_000])
    gate = __import__("threading").Event()
    real = os.pread

    def slow(fd, n, off):  # the disk delivers one window, then the run stops the reading
        gate.wait(5)
        return real(fd, n, off)

    monkeypatch.setattr(prefetch.os, "pread", slow)
    p = Prefetch(files, budget=None)
    p._stop.set()
    gate.set()
    facts = p.stop()
    assert not p.running and p.done < p.total
    assert facts["read_ahead"].endswith("the load read the rest")


def test_a_file_that_cannot_be_read_is_said_not_raised(tmp_path):
    files = _files(tmp_path, [100])
    missing = tmp_path / "gone.safetensors"
    p = Prefetch([missing, *files], budget=None)
    facts = p.stop(finish=True)
    assert "gone.safetensors" in facts["read_ahead"] and "stopped" in facts["read_ahead"]


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")
def test_the_budget_leaves_the_run_a_reserve():
    got = available_bytes()
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    assert got is not None and 0 <= got <= info["MemAvailable"] - prefetch.RESERVE_MIN
