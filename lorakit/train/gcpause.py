"""Python's garbage collector while the steps run: its full collections timed, and what the run keeps for good
(the model, the stack's modules, the compiled graphs) set aside so later collections do not walk it.

A full (generation 2) collection walks every object Python tracks; after the imports, the model and torch.compile's
graphs that is most of a million (CPU: 0.37 s for 760,000 objects after compiling the tiny Qwen-Image's blocks),
and it stops every thread, so the GPU runs dry for that long: one step in twenty that is a second slower (Qwen-Image
rtx4090, step 10 of three runs on the H100: 1.70 s against a 0.66 s median) is what a collection would look like.
After step 1 (once the other bucket shapes it compiles and the step-0 grid are done: their graphs stay too), after
each step that waited for the compiler, after each grid, and once the background compile is in use, what exists
is collected once and frozen (`gc.freeze`: never walked again); each step's record carries the seconds full
collections took during it (`gc_s`), so a pause left is seen. The run's end unfreezes (a process that trains
twice, the tests, collects the first run's objects)."""

from __future__ import annotations

import gc
import time


class Collector:
    """`take()`: seconds of full collections since the last take; `settle()`: collect once and freeze what is
    left; `close()` (or the end of a `with` block): stop timing and unfreeze."""

    def __init__(self):
        self.pause = 0.0
        self.frozen = False
        self._t: float | None = None
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.pause += time.perf_counter() - self._t
            self._t = None

    def take(self) -> float:
        pause, self.pause = self.pause, 0.0
        return pause

    def settle(self) -> float:
        """Collect, then freeze what survives; returns the seconds (not counted in the next step's pause)."""
        t = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.frozen = True
        self.take()
        return time.perf_counter() - t

    def close(self) -> None:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
