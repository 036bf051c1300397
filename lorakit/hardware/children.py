"""Child processes a measurement runs in, watched from the parent: a line read with a deadline, a child stopped
whatever state it is in (a kernel that hangs or takes the CUDA context down costs that child, not doctor)."""

from __future__ import annotations

import subprocess


def read_line(p: subprocess.Popen, timeout: float) -> str | None:
    """The child's next stdout line, or None after `timeout` seconds (or at its end)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return None
        return p.stdout.readline() or None
    finally:
        sel.close()


def close(p: subprocess.Popen) -> None:
    """Stop a child (killed if it still runs) and close its pipes."""
    if p.poll() is None:
        p.kill()
    p.wait()
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:
                pass
