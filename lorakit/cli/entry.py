"""The `lorakit` command's first code: SIGTERM is made an interrupt before anything else is imported (torch, typer,
rich take a second or more), so a command stopped in its first moments exits 130 saying so — never a bare -15 —
and the CLI's own handler (`cli.app`) takes over from there. A rank of a run on several processes ends without the
interpreter's teardown, once its command is done (`leave`)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

from lorakit.cli import STOP, gone, interrupt


def main() -> None:
    """Console-script entry point (and `python -m lorakit`)."""
    STOP["entry"] = True  # a process of its own: an interrupted command ends at once (`cli.gone`)
    faulthandler.enable()  # a process that aborts in native code (SIGABRT, SIGSEGV) says where each thread was
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
    try:
        from lorakit.cli.app import main as cli_main

        if STOP["asked"]:  # the interrupt was raised where Python swallows it (an import lock's callback, seen once)
            gone()
    except KeyboardInterrupt:  # in the import, or asked again (`interrupt`'s SIGALRM) as it ended
        gone()
    try:
        cli_main()
    except SystemExit as e:
        if _a_rank():
            leave(e.code)
        raise
    if _a_rank():
        leave(0)


def _a_rank() -> bool:
    """Is this process one rank of several? Asked once the command is done: a launcher sets WORLD_SIZE before it
    starts, `srun lorakit train` while it runs (`dist.from_slurm`)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def leave(code) -> None:
    """End a rank of a multi-process run now that its command is done: its output flushed, without the interpreter's
    teardown. The process groups' Python objects outlive `destroy_process_group` (a 2-process sharded CPU run at its
    exit: 6 references to the default group besides the probe's own, most likely the model's device mesh and its
    parameters' specs, and 2 to the checkpoint's group), so they were freed, and their gloo threads ended, while the
    interpreter was torn down, where a thread still holding tensors aborts ("terminate called without an active
    exception", exit -6: the likely end of a rank in CI, 2026-11-29, `tests/unit/test_dist.py`'s late-signal run).
    A rank has nothing left to do here."""
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): said, as Python would
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more can be said
            pass
    os._exit(code)
