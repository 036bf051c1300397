"""What long work tells the person waiting: phases with their durations, training steps, warnings.

The library reports here and never prints; the CLI decides how it reads (a terminal's progress bar, one plain line
per event for a log file or a scheduler, JSON lines). `Events()` itself discards everything (tests, the Python API).
"""

from __future__ import annotations

import contextlib
import time

PHASES = "phases.jsonl"  # in a run folder: its phases as they happened (`Recorded`)


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


class Recorded(Events):
    """Another `Events` (the CLI's), and each phase, info and warning appended to a JSON-lines file as it happens
    (a run's `phases.jsonl`: what the dashboard's run page shows while encoders load, the cache builds, the blocks
    compile and the first grid renders). A line: {"time", "event": "start" | "end" | "failed" | "info" | "warn",
    "name" | "message", "seconds", "facts"}. A file that cannot be written is said once and left alone."""

    def __init__(self, inner: Events, path):
        self.inner, self.path, self._broken, self._begun = inner, path, False, False

    def _write(self, rec: dict) -> None:
        import json

        if self._broken:
            return
        now = round(time.time(), 3)
        lines = [] if self._begun else [{"time": now, "event": "run"}]  # where this run's (or resume's) lines begin
        lines.append({"time": now, **rec})
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(x, default=str) + "\n" for x in lines))
            self._begun = True
        except OSError as e:
            self._broken = True
            self.inner.warn(f"{self.path}: the run's phases are not recorded ({e.strerror or e}); it trains on")

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        return self.inner.__exit__(*exc)

    def phase_start(self, name: str) -> None:
        self._write({"event": "start", "name": name})
        self.inner.phase_start(name)

    def phase_end(self, name: str, seconds: float, facts: dict) -> None:
        self._write({"event": "end", "name": name, "seconds": round(seconds, 2), "facts": facts})
        self.inner.phase_end(name, seconds, facts)

    def phase_failed(self, name: str) -> None:
        self._write({"event": "failed", "name": name})
        self.inner.phase_failed(name)

    def progress(self, what: str, done: int, total: int, detail: str = "") -> None:
        self.inner.progress(what, done, total, detail)

    def step(self, step: int, total: int, rec: dict) -> None:
        self.inner.step(step, total, rec)

    def info(self, msg: str) -> None:
        self._write({"event": "info", "message": msg})
        self.inner.info(msg)

    def warn(self, msg: str) -> None:
        self._write({"event": "warn", "message": msg})
        self.inner.warn(msg)
