"""A model's weight files read into the page cache ahead of their load, while the run does other things.

`lorakit train` spends its first seconds on work that leaves the disk idle: imports, checking the config and the
machine (on a first run, the attention self-test), loading the text encoders and encoding. Reading a 22-38 GB
transformer from a cold disk then takes 17-41 s on its own (H100 machine: 1.39 GB/s). `Prefetch` reads the files
in a background thread from the moment the run knows them, so the load later finds them in the page cache.

How: the kernel is asked to read each window (`posix_fadvise(WILLNEED)`: readahead without copying the bytes to
Python), a few windows ahead, and a one-byte read at each window's end waits for it, so the thread knows how far
the disk has got (where posix_fadvise is missing, the windows are read into one reused buffer). Nothing is held by
the process: the pages are the kernel's cache, dropped under memory pressure like any other. So that they are not
dropped before the load uses them, the thread reads at most what the machine's available memory leaves beside a
reserve for the run's own memory (`budget`), in load order (the files as given, each from its start). Reads fail
quietly: the load reads the file itself and names any error there.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

WINDOW = 64 * 2**20  # bytes asked of the kernel at once
AHEAD = 4  # windows in flight: the disk's queue stays full
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
        self._asked = 0  # bytes asked of the kernel (delivered or in flight)
        self.total = sum(_size(f) for f in self.files)
        self.limited = False  # stopped at the budget with files left
        self.error: str | None = None
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="lorakit-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for f in self.files:
                if not self._file(f):
                    break
        except OSError as e:  # the load reads the file itself and says what is wrong
            self.error = f"{e.filename or ''}: {e.strerror or e}"
        finally:
            self._seconds = time.perf_counter() - self._started

    def _file(self, path: Path) -> bool:
        """Read one file's windows; False once stopped or at the budget."""
        size = _size(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            advise = getattr(os, "posix_fadvise", None)
            buf = None if advise else bytearray(WINDOW)
            pending: deque = deque()
            off = 0
            while off < size:
                if self._stop.is_set():
                    return False
                n = min(WINDOW, size - off)
                if self.budget is not None and self._asked + n > self.budget:
                    self.limited = True
                    break
                self._asked += n
                if advise:
                    advise(fd, off, n, os.POSIX_FADV_WILLNEED)
                    pending.append((off, n))
                    if len(pending) > AHEAD:
                        self._arrived(fd, *pending.popleft())
                else:
                    os.preadv(fd, [memoryview(buf)[:n]], off)
                    self.done += n
                off += n
            while pending:
                self._arrived(fd, *pending.popleft())
            return not self.limited
        finally:
            os.close(fd)

    def _arrived(self, fd: int, off: int, n: int) -> None:
        os.pread(fd, 1, off + n - 1)  # waits for the window's last page
        self.done += n

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
