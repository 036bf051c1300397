"""The peak of a reading polled on a thread while a block runs (process RSS in `bench load`, GPU memory in the
peer-trainer comparison)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Peak:
    """`with Peak(read, every_s) as p: ...` -> p.start, p.peak (read once before, every `every_s`, once after)."""

    def __init__(self, read: Callable[[], int], every_s: float):
        self._read, self._every = read, every_s
        self.start = self.peak = read()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._read())
