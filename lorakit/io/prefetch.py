"""A model's weight files read into the page cache ahead of their load, while the run does other things.

`lorakit train` spends its first seconds on work that leaves the disk idle: imports, checking the config and the
machine (on a first run, the attention self-test), loading the text encoders and encoding. Reading a 22-38 GB
transformer from a cold disk then takes 17-41 s on its own (H100 machine: 1.39 GB/s). `Prefetch` reads the files
in a background thread from the moment the run knows them, so the load later finds them in the page cache.

How: a few threads read the files window by window into buffers of their own (`os.preadv`, which waits for the
disk; the bytes are dropped), in load order, a window per thread in flight so the disk's queue stays full. Asking
the kernel instead (`posix_fadvise(WILLNEED)`, `readahead(2)`) reads at most its readahead limit per call (8 MiB on
the CI machine, often 128 KiB: the rest of a 64 MiB window was never read) and says nothing of when the pages
arrive. Nothing is held by the process: the pages are the kernel's cache, dropped under memory pressure like any
other. So that they are not dropped before the load uses them, the threads read at most what the machine's
available memory leaves beside a reserve for the run's own memory (`budget`). Reads fail quietly: the load reads
the file itself and names any error there.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

WINDOW = 16 * 2**20  # bytes one read asks for
THREADS = 4  # reads in flight: the disk's queue stays full
RESERVE_FRACTION, RESERVE_MIN = 0.25, 8 * 2**30  # memory left to the run itself (a 32 GB desktop: 8 GiB)


def available_bytes() -> int | None:
    """MemAvailable and MemTotal of /proc/meminfo -> what may be read ahead: available minus a reserve for the
    run (a quarter of the machine, at least 8 GiB). None where the machine does not say (read nothing ahead)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in info or "MemTotal" not in info:
        return None
    return max(0, info["MemAvailable"] - max(RESERVE_MIN, int(info["MemTotal"] * RESERVE_FRACTION)))


class Prefetch:
    """Read `files` (in order) into the page cache in a daemon thread, at most `budget` bytes (default:
    `available_bytes()`). `stop()` ends it and returns what it did."""

    def __init__(self, files: list[Path], budget: int | None = None):
        self.files = [Path(f) for f in files]
        self.budget = available_bytes() if budget is None else budget
        self.done = 0  # bytes the disk has delivered
        self._asked = 0  # bytes handed to the reading threads (read or in flight)
        self.total = sum(_size(f) for f in self.files)
        self.limited = False  # stopped at the budget with files left
        self.error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="lorakit-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fds: list[int] = []
        try:
            windows = self._windows(fds)
            readers = [threading.Thread(target=self._read, args=(windows,), name=f"lorakit-prefetch-{i}",
                                        daemon=True) for i in range(THREADS)]
            for t in readers:
                t.start()
            for t in readers:
                t.join()
        finally:
            for fd in fds:
                os.close(fd)
            self._seconds = time.perf_counter() - self._started

    def _windows(self, fds: list[int]):
        """(path, fd, offset, length) of every window, in load order, until stopped, at the budget or at a file that
        cannot be opened (taken by the readers under the lock)."""
        for path in self.files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:  # the load reads the file itself and says what is wrong
                self.error = f"{e.filename or path}: {e.strerror or e}"
                return
            fds.append(fd)
            size, off = _size(path), 0
            while off < size:
                n = min(WINDOW, size - off)
                if self._stop.is_set():
                    return
                if self.budget is not None and self._asked + n > self.budget:
                    self.limited = True
                    return
                self._asked += n
                yield path, fd, off, n
                off += n

    def _read(self, windows) -> None:
        buf = bytearray(WINDOW)
        while True:
            with self._lock:
                item = next(windows, None)
            if item is None:
                return
            path, fd, off, n = item
            try:
                got = os.preadv(fd, [memoryview(buf)[:n]], off)  # the GIL is released while the disk reads
            except OSError as e:
                with self._lock:
                    self.error = self.error or f"{path}: {e.strerror or e}"
                self._stop.set()
                return
            with self._lock:
                self.done += got

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, finish: bool = False) -> dict:
        """End the reading (the windows in flight finish; `finish`: wait until it has read what it would) and say
        what was read ahead, as a phase's fact: {"read_ahead": "20.1 of 22.2 GiB in 15.3 s (1.41 GB/s), ..."}."""
        if not finish:
            self._stop.set()
        self._thread.join()
        secs = self._seconds or 0.0
        unit, scale = ("GiB", 2**30) if self.total >= 2**30 else ("MiB", 2**20)
        text = f"{self.done / scale:.1f} of {self.total / scale:.1f} {unit} in {secs:.1f} s"
        if secs > 0 and self.done:
            text += f" ({self.done / 1e9 / secs:.2f} GB/s)"
        if self.error:
            text += f", stopped: {self.error}"
        elif self.limited:
            text += ", stopped at the memory the machine had available"
        elif self.done < self.total:
            text += ", the load read the rest"
        return {"read_ahead": text}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
