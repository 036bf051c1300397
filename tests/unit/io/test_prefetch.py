"""The read-ahead of a model's files (lorakit.io.prefetch): reads them all, in order, within its memory budget,
stops when told, never raises (the load names a file's problem) — and the files are in the page cache after it."""

from __future__ import annotations

import os
import threading

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


def _reads(monkeypatch, before=None):
    """The reads, as (file size, offset, length) in the order they were asked for."""
    seen, lock = [], threading.Lock()
    real = os.preadv

    def preadv(fd, bufs, off):
        with lock:
            seen.append((os.fstat(fd).st_size, off, len(bufs[0])))
        if before:
            before()
        return real(fd, bufs, off)

    monkeypatch.setattr(prefetch.os, "preadv", preadv)
    return seen


def test_every_file_is_read_in_order_window_by_window(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WINDOW", 1000)
    monkeypatch.setattr(prefetch, "THREADS", 1)
    files = _files(tmp_path, [2500, 700])
    seen = _reads(monkeypatch)
    p = Prefetch(files, budget=None)
    facts = p.stop(finish=True)
    assert p.done == p.total == 3200 and not p.limited and p.error is None
    assert seen == [(2500, 0, 1000), (2500, 1000, 1000), (2500, 2000, 500), (700, 0, 700)]  # in load order
    assert facts["read_ahead"].startswith("0.0 of 0.0 MiB in ")
    assert "stopped" not in facts["read_ahead"] and "rest" not in facts["read_ahead"]


def test_several_readers_read_each_window_once(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WINDOW", 1000)
    files = _files(tmp_path, [9500, 3000, 1])
    seen = _reads(monkeypatch)
    p = Prefetch(files, budget=None)
    p.stop(finish=True)
    want = [(9500, o, min(1000, 9500 - o)) for o in range(0, 9500, 1000)] + \
        [(3000, o, 1000) for o in range(0, 3000, 1000)] + [(1, 0, 1)]
    assert sorted(seen) == sorted(want) and len(seen) == len(want) and p.done == p.total == 12501


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="evicting a file needs posix_fadvise")
def test_the_files_are_in_the_page_cache_afterwards(tmp_path):
    # the kernel's own readahead (posix_fadvise WILLNEED) reads at most its limit per call: 8 MiB of a 64 MiB
    # window here, so a read-ahead that only asked the kernel left most of a model on the disk
    from lorakit.bench.load import drop_cache

    f = _files(tmp_path, [48 * 2**20])[0]
    drop_cache([f])
    if _resident(f) > 0.05:
        pytest.skip("this file system keeps the file in memory (tmpfs): nothing to read ahead")
    Prefetch([f], budget=None).stop(finish=True)
    assert _resident(f) > 0.99


def _resident(path) -> float:
    """The fraction of the file's pages in the page cache (mincore over a private mapping of it)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            view = ctypes.c_char.from_buffer(m)
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec)
            del view
        finally:
            m.close()
    if rc != 0:
        pytest.skip("mincore is not available")
    return sum(v & 1 for v in vec) / pages


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
    gate = threading.Event()
    _reads(monkeypatch, before=lambda: gate.wait(5))  # the disk delivers, then the run stops the reading
    p = Prefetch(files, budget=None)
    p._stop.set()
    gate.set()
    facts = p.stop()
    assert not p.running and p.done < p.total
    assert facts["read_ahead"].endswith("the load read the rest")


def test_a_file_that_cannot_be_read_is_said_not_raised(tmp_path, monkeypatch):
    files = _files(tmp_path, [100])
    missing = tmp_path / "gone.safetensors"
    p = Prefetch([missing, *files], budget=None)
    facts = p.stop(finish=True)
    assert "gone.safetensors" in facts["read_ahead"] and "stopped" in facts["read_ahead"]

    def failing(fd, bufs, off):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(prefetch.os, "preadv", failing)
    p = Prefetch(files, budget=None)
    facts = p.stop(finish=True)
    assert facts["read_ahead"].endswith(f"stopped: {files[0]}: Input/output error") and p.done == 0


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")
def test_the_budget_leaves_the_run_a_reserve():
    def mem_available() -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

    # read before and after: other processes (the suite's other worker) allocate and free meanwhile (a fresh
    # clone's CI, 2026-11-30: 151 KB less available a moment after the budget was taken)
    before = mem_available()
    got = available_bytes()
    most = max(before, mem_available())
    assert got is not None and 0 <= got <= most - prefetch.RESERVE_MIN
