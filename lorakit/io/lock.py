"""One writer per folder: a training run holds its output folder, a cache build its cache folder, for as long as it
writes there. A second one is refused (bad input: exit 2) with who holds the folder — process, host, command,
since when — instead of both running and one overwriting the other's result.

The lock is the kernel's (`flock` on `<folder>/.lorakit.lock`): it goes with the process that held it, so a run
killed with kill -9 or by a power cut leaves no stale lock behind; the file itself stays, holding the last owner's
description. On file systems without `flock` (some network mounts) a second process is not stopped; the lock says
so once instead of failing.

The lock file is opened without following links and must be a regular file: a `.lorakit.lock` that is a link (to
a file outside the folder, which writing the owner's description would overwrite), a folder, a FIFO or a device is
refused by name, never written through.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from lorakit.errors import InputError, environment_fault

LOCK_NAME = ".lorakit.lock"


class FolderLock:
    """`with FolderLock(folder, "training run"):` — held while the block runs; raises InputError if another process
    holds it."""

    def __init__(self, folder, what: str, hint: str = "wait for it to finish, or choose another folder"):
        self.folder, self.what, self.hint = Path(folder), what, hint
        self.fd: int | None = None
        self.unsupported: str | None = None  # why the file system could not lock (the run goes on)

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    def __enter__(self) -> FolderLock:
        import fcntl

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise environment_fault(e, self.folder) or e from None
        self.fd = open_lock_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(self.fd)
            os.close(self.fd)
            self.fd = None
            raise _in_use(self.folder, self.what, owner, self.hint) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise environment_fault(e, self.path) or e from None
            self.unsupported = f"{self.folder}: this file system cannot lock files ({e.strerror}); nothing stops " \
                               f"a second run from writing there at the same time"
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(["lorakit", *sys.argv[1:]])[:300]}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(info).encode(), 0)
        return self

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock; the description stays for whoever looks
            self.fd = None
        return False


def open_lock_file(path: Path, flags: int) -> int:
    """A lock file's descriptor, opened without following a link and without blocking on a FIFO; InputError naming
    the path when it is not a regular file (a link, a folder, a FIFO, a device), EnvironmentFault for the machine's
    refusals (permissions, a read-only disk)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise InputError(*_not_regular(path)) from None
        raise environment_fault(e, path) or e from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(*_not_regular(path))
    os.set_blocking(fd, True)
    return fd


def _not_regular(path: Path) -> tuple[str, str]:
    kind = ("a symbolic link" if path.is_symlink() else "a folder" if path.is_dir() else
            "a FIFO" if path.is_fifo() else "not a regular file")
    return (f"{path}: the folder's lock file is {kind}; lorakit does not write through it",
            f"remove it (rm {'-r ' if kind == 'a folder' else ''}'{path}'): lorakit writes a new one")


def _owner(fd: int) -> str:
    """" (pid N on host H since T: command)" from the lock file, or "" when it says nothing readable."""
    try:
        return owner_text(json.loads(os.pread(fd, 4096, 0).decode("utf-8")))
    except (OSError, ValueError):
        return ""


def owner_text(info) -> str:
    """" (pid N on host H since T: command)" from a lock file's description (`holder`), "" where it has none."""
    try:
        return f" (pid {info['pid']} on {info['host']} since {info['since']}: {info['command']})"
    except (KeyError, TypeError):
        return ""


def refuse_held(folder, what: str, hint: str) -> None:
    """InputError where another process holds `folder`'s lock now, worded as `FolderLock` words it: what a check
    made before taking the lock (a dry run) says first — the folder's other contents are that process's, not an
    earlier run's."""
    info = holder(folder)
    if info is not None:
        raise _in_use(folder, what, owner_text(info), hint)


def _in_use(folder, what: str, owner: str, hint: str) -> InputError:
    """What a folder another lorakit process holds is refused with (by `FolderLock` and `refuse_held` alike)."""
    return InputError(f"{folder} is in use by another lorakit {what}{owner}", hint)


def holder(folder) -> dict | None:
    """Who holds a folder's lock now (the lock file's description), or None when nobody does — read without
    taking it from anyone (a shared, non-blocking try that is released at once)."""
    import fcntl

    path = Path(folder) / LOCK_NAME
    try:
        fd = open_lock_file(path, os.O_RDONLY)
    except (OSError, InputError):  # missing, or not a lock file anyone could hold
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        except (OSError, ValueError):
            return {}
    except OSError:
        return None  # a file system without locks: nothing to tell
    finally:
        os.close(fd)
