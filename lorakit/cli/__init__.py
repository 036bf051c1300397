"""The `lorakit` command line: thin commands over library functions."""

import os
import time

from lorakit.errors import (
    STOP,  # a SIGTERM arrived: known even where Python swallowed the interrupt it raised
)

STARTED = time.monotonic()  # when the command began (its log lines count from here)
__all__ = ["STARTED", "STOP", "said"]


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
