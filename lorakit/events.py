"""What long work tells the person waiting: phases with their durations, training steps, warnings.

The library reports here and never prints; the CLI decides how it reads (a terminal's progress bar, one plain line
per event for a log file or a scheduler, JSON lines). `Events()` itself discards everything (tests, the Python API).
"""

from __future__ import annotations

import contextlib
import time


class Events:
    """The interface, and the quiet default. A renderer that draws (a progress bar) does so inside `with events:`."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def phase_start(self, name: str) -> None:
        """A phase began (a terminal names it while it runs)."""

    def phase_end(self, name: str, seconds: float, facts: dict) -> None:
        """A phase ended after `seconds`; `facts`: what it did (GiB, GB/s, items, ...)."""

    def phase_failed(self, name: str) -> None:
        """A phase ended by an error (the error itself is reported by whoever handles it)."""

    def progress(self, what: str, done: int, total: int, detail: str = "") -> None:
        """Counted work inside a phase (items encoded, images made)."""

    def step(self, step: int, total: int, rec: dict) -> None:
        """An optimizer step finished (`rec`: its metrics record)."""

    def info(self, msg: str) -> None:
        """A fact worth a line (the global batch, a resume)."""

    def warn(self, msg: str) -> None:
        """A warning."""

    @contextlib.contextmanager
    def phase(self, _name: str, /, **facts):
        """`with events.phase("load model") as facts: ...; facts["gib"] = 23.8` — timed, reported at the end (the
        block may add what it learned to `facts`)."""
        t0 = time.perf_counter()
        self.phase_start(_name)
        try:
            yield facts
        except BaseException:
            self.phase_failed(_name)
            raise
        self.phase_end(_name, time.perf_counter() - t0, facts)
