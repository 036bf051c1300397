"""What the CUDA caching allocator had to do during each step, for the step's metrics record.

A steady step reuses the blocks the allocator already holds: it asks the driver for nothing. Two counts say when
that is not so: `alloc_retries` (a request the cache could not meet until it gave its free blocks back to the
driver, which waits for the whole device: the sign of a run at its card's edge, and a step that takes longer) and
`cuda_mallocs` (new device memory asked for, as the run grows or after a retry freed the cache). Each is the
step's own count and is recorded only where it is not zero.
"""

from __future__ import annotations

from collections.abc import Callable

COUNTS = {"alloc_retries": "num_alloc_retries", "cuda_mallocs": "num_device_alloc"}


class AllocWatch:
    """`take()` after each step: the counts since the last take (an empty dict where nothing happened or there is
    no CUDA device). `stats`: the allocator's counters by name (torch's nested form, whose counts are at its top:
    read as they are, not flattened and sorted as torch.cuda.memory_stats does twice a step; tests inject it)."""

    def __init__(self, cuda: bool, stats: Callable[[], dict] | None = None):
        if stats is None and cuda:
            import torch

            stats = torch.cuda.memory_stats_as_nested_dict
        self.stats = stats if cuda else None
        self.last = self._now()

    def _now(self) -> dict:
        if self.stats is None:
            return {}
        s = self.stats()
        return {k: int(s.get(name, 0)) for k, name in COUNTS.items()}

    def take(self) -> dict:
        now = self._now()
        out = {k: v - self.last.get(k, 0) for k, v in now.items() if v - self.last.get(k, 0)}
        self.last = now
        return out


class PeakWatch:
    """The GPU memory peak (the allocator's, in GiB) of each part of the run, and the run's own: `take()` returns
    the peak since the last take and starts a new one (torch's peak counter is reset after each read); `run` is the
    largest so far, what the whole run needed. The loop takes it after each step, after the other bucket shapes'
    compile and after the step-0 grid, so a record says which of them came nearest the card's edge (on a 24 GiB
    card the step's own peak is not the only one that must fit). `read` and `reset`: tests inject them."""

    def __init__(self, cuda: bool, read: Callable[[], int] | None = None, reset: Callable[[], None] | None = None):
        if cuda and read is None:
            import torch

            def read() -> int:  # the allocator's counter as it is (max_memory_allocated flattens and sorts them all)
                return int(torch.cuda.memory_stats_as_nested_dict().get("allocated_bytes", {}).get("all", {})
                           .get("peak", 0))

            reset = torch.cuda.reset_peak_memory_stats
        self.read, self.reset = (read, reset) if cuda else (None, None)
        self.run = 0.0

    def take(self) -> float | None:
        if self.read is None:
            return None
        gib = round(self.read() / 2**30, 2)
        self.reset()
        self.run = max(self.run, gib)
        return gib

    def whole(self) -> float:
        """The run's peak, up to now (what the last take left out included)."""
        self.take()
        return self.run
