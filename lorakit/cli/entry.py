"""The `lorakit` command's first code: SIGTERM is made an interrupt before anything else is imported (torch, typer,
rich take a second or more), so a command stopped in its first moments exits 130 saying so — never a bare -15 —
and the CLI's own handler (`cli.app`) takes over from there."""

from __future__ import annotations

import signal
import threading

from lorakit.cli import STOP, gone, interrupt


def main() -> None:
    """Console-script entry point (and `python -m lorakit`)."""
    STOP["entry"] = True  # a process of its own: an interrupted command ends at once (`cli.gone`)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
    try:
        from lorakit.cli.app import main as cli_main
    except KeyboardInterrupt:
        gone()
    if STOP["asked"]:  # the interrupt was raised where Python swallows it (an import lock's callback, seen once)
        gone()
    cli_main()
