"""A stop request (SIGINT/SIGTERM) during training: the run stops after the current step on every rank, then saves
a checkpoint (train/loop.py)."""

from __future__ import annotations

import contextlib
import signal

from lorakit.errors import STOP


class StopFlag:
    """Set by SIGINT/SIGTERM: the run stops after the current step (and then saves a checkpoint).

    `requested` is this rank's: the signal handler sets it at any moment. `agreed` is what every rank holds after
    the same exchange (`share`, before the first step and after each): the loop tests only that one. A loop that
    tested its own rank's flag stopped rank 0 alone when a SIGTERM reached it between the exchange and the loop's
    test — rank 0 waited in the checkpoint's barrier, rank 1 in the next step's all-gather, forever (CI, 2026-11-27,
    seen with py-spy; tests/unit/train/test_stop.py, tests/unit/test_dist.py::
    test_a_signal_to_one_rank_after_the_exchange_stops_every_rank_after_the_same_step)."""

    def __init__(self):
        self.requested = False
        self.agreed = False

    def share(self, dist, ready: bool = True) -> bool:
        """A stop asked on any rank stops them all, after the same step. The handler never writes `agreed`, and
        `requested` is never cleared: a signal whose handler runs while the ranks exchange the flag (after it was
        read) is agreed at the next exchange instead of lost (a SIGTERM sent just after a step's record was written
        was lost that way once and the run trained on; CI, 2026-11-26).

        The same exchange carries `ready`; returns whether every rank said it (the loop takes the compiled blocks'
        graphs from the cache at the same step on every rank: `train.loop`)."""
        stop, unready = dist.totals([float(self.requested), float(not ready)])
        if stop > 0:
            self.agreed = True
        return unready == 0


@contextlib.contextmanager
def stop_on_signals(flag: StopFlag):
    """SIGINT/SIGTERM set `flag` for the duration. A SIGTERM that came before (its interrupt swallowed where Python
    ignores exceptions: `errors.STOP`) stops the run here, before its first step: exit 130, nothing saved."""
    old = {}

    def _stop(signum, frame):
        flag.requested = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            old[sig] = signal.signal(sig, _stop)
    try:
        if STOP["asked"]:
            raise KeyboardInterrupt
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
