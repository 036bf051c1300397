"""The `lorakit` command line: thin commands over library functions."""

import os
import time

# a SIGTERM arrived: known even where Python swallowed the interrupt it raised
from lorakit.errors import STOP

STARTED = time.monotonic()  # when the command began (its log lines count from here)
__all__ = ["STARTED", "STOP", "gone", "interrupt", "said"]


def _mid_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def interrupt(signum, frame) -> None:
    """SIGTERM's handler until a training run puts in its own (a scheduler's stop, `kill`, ends a command as Ctrl-C
    does): a KeyboardInterrupt at once, except in the middle of an import. There the signal can land in Python code
    that a C++ extension's initialisation is calling (torch's operator registrations, through pybind11), where an
    exception ends the process with an abort — exit -6 instead of 130 (CI under load, 2026-11-29,
    `tests/integration/test_reliability.py::test_sigterm_during_startup_is_an_interrupt_130_not_a_bare_143`, the
    stack pybind11 prints as it terminates). So mid-import it is asked again 0.05 s later (SIGALRM), until the
    import is done."""
    import signal

    STOP["asked"] = True
    if _mid_import(frame):
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        return
    raise KeyboardInterrupt


def _disarm() -> None:
    """No interrupt asked again from here on: where SIGALRM is `interrupt`'s (set mid-import), its timer is stopped
    and the signal ignored should it be due already; a timer of anyone else's (a host program's) is left alone.
    Only the main thread may change a handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGALRM) is not interrupt:
        return
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)


def said() -> None:
    """The interrupt said (once) on stderr's descriptor itself: an interrupt in the middle of an import may leave
    Python's stderr object with its buffer unwritten at exit (seen under load: exit 130, nothing said)."""
    if STOP.get("said"):
        return
    STOP["said"] = True
    try:
        os.write(2, b"interrupted before anything could be saved (exit 130)\n")
    except OSError:
        pass


def gone() -> None:
    """Exit 130 now, having said so. A command interrupted before anything was saved has unwound its own
    `finally` blocks (temporary files removed, locks released) by the time this runs; the interpreter's shutdown
    after it, over modules an interrupt left half imported and torch's threads mid-call, ended such a process with
    SIGINT's -2 or an abort's -6 instead of 130 now and then (CI under load, 2026-11-27,
    tests/integration/test_reliability.py), so it is skipped: the standard streams are flushed and the process
    ends here. Only where the console script's entry point runs the command (`cli.entry`). An interrupt asked
    again after an import (`interrupt`'s SIGALRM) is disarmed first: it landed in this exit once and its
    KeyboardInterrupt ended the process with -2 after it had said 130 (CI, 2026-12-02,
    `test_sigterm_in_the_first_moments_is_130_never_a_bare_minus_15`)."""
    import sys

    _disarm()
    said()
    if not STOP.get("entry"):  # the CLI run in-process (typer's test runner, a host program): exit as a command
        raise SystemExit(130)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - a stream the interrupt left broken: the exit code still stands
            pass
    os._exit(130)
