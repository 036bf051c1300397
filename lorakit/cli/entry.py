"""The `lorakit` command's first code: SIGTERM is made an interrupt before anything else is imported (torch, typer,
rich take a second or more), so a command stopped in its first moments exits 130 saying so — never a bare -15 —
and the CLI's own handler (`cli.app`) takes over from there."""

from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    """Console-script entry point (and `python -m lorakit`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        from lorakit.cli.app import main as cli_main
    except KeyboardInterrupt:
        said()
        sys.exit(130)
    cli_main()


def said() -> None:
    """The interrupt said on stderr's descriptor itself: an interrupt in the middle of an import may leave Python's
    stderr object with its buffer unwritten at exit (seen under load: exit 130, nothing said)."""
    try:
        os.write(2, b"interrupted before anything could be saved (exit 130)\n")
    except OSError:
        pass
