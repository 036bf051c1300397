"""Errors lorakit shows to people: one line saying what was wrong (naming the file involved), plus a hint.

Exit codes (the CLI's one error handler, `cli/app.py`):
- 2: bad input — config, paths, datasets, files (`InputError` and subclasses);
- 1: the machine — no space, permissions, memory, a missing library, a hung kernel (`EnvironmentFault`),
  or a capability this build or machine lacks (`NotAvailableError`); only errors lorakit cannot classify
  get the "this looks like a bug in lorakit" hint;
- 75: a training run that was interrupted (SIGINT/SIGTERM), saved a checkpoint and can be resumed;
- 130: interrupted before anything could be saved (Ctrl-C outside training).
"""

from __future__ import annotations

import errno
import os
import re

# A SIGTERM that arrived before a command's own handler took over (the CLI's handler sets it), kept below every
# layer: Python swallows an interrupt raised inside a finalizer or a callback ("Exception ignored in: 'Path'"), and
# the command would run on to exit 0 (seen once under load, 2026-11-27). The CLI looks before a command begins,
# a training run when it takes SIGINT/SIGTERM over (`train.stop.stop_on_signals`).
STOP = {"asked": False}

EXIT_INTERRUPTED_RESUMABLE = 75  # EX_TEMPFAIL: "temporary failure, the user is invited to retry"


class LorakitError(Exception):
    """An error with a one-line message and an optional hint for what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details or {}  # more for --json (e.g. every dataset problem)

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "message": self.message, "hint": self.hint, **self.details}


class InputError(LorakitError):
    """Something the user gave us is wrong (exit code 2)."""

    exit_code = 2


class ConfigError(InputError):
    """One or more config problems, all reported at once."""

    def __init__(self, problems: list[str], source: str | None = None, hint: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            msg = f"config{where}: {self.problems[0]}"
        else:
            msg = f"config{where}: {len(self.problems)} problems: " + "; ".join(self.problems)
        super().__init__(msg, hint)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["problems"] = self.problems
        return d


class UnknownNameError(InputError):
    """A name (family, profile, backend) that is not one of the valid ones."""

    def __init__(self, what: str, got: str, valid: list[str]):
        import difflib

        close = difflib.get_close_matches(got, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        hint += "valid: " + ", ".join(valid)
        super().__init__(f"unknown {what} {got!r}", hint)
        self.valid = valid


class FileFormatError(InputError):
    """A file on disk is malformed or not what it claims to be."""


class NotAvailableError(LorakitError):
    """A capability this build or this machine does not have."""


class EnvironmentFault(LorakitError):
    """The machine, not the input: disk full, permissions, out of memory, a missing library (exit code 1)."""


# --------------------------------------------------------------------------- classification

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_WRITE_FAILURES = ("unexpected pos", "basic_ios::clear", "iostream error", "file write failed",
                   "PytorchStreamWriter failed", "No space left")


def short(text: object, limit: int = 200) -> str:
    """The first line of a message, terminal colour codes removed, cut at a word boundary with an ellipsis."""
    line = next((ln.strip() for ln in _ANSI.sub("", str(text)).splitlines() if ln.strip()), "")
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0]
    return (cut if len(cut) > limit // 2 else line[:limit]).rstrip(" ,;:") + "…"


_SIZE = r"([\d.]+ (?:[KMGT]?i?B|bytes))"  # a size in PyTorch's out-of-memory message: "612.35 MiB", "0 bytes"


def _gib(figure: str) -> float:
    n, unit = figure.split()
    return float(n) * {"B": 2**-30, "bytes": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1, "TiB": 2**10}.get(unit, 1)


_OOM_FIGURES = (("asked for {}", rf"Tried to allocate {_SIZE}"),
                ("{} allocated by PyTorch", rf"{_SIZE} is allocated by PyTorch"),
                ("{} reserved but unallocated", rf"{_SIZE} is reserved by PyTorch but unallocated"))


def gpu_oom_summary(text: str) -> str:
    """PyTorch's out-of-memory message in a line: what was asked, what this process held, and the emulated card's
    size where LORAKIT_MEMORY_CAP_GIB holds the process to it (torch's own figures are the whole GPU's, so under a
    cap "53.8 GiB free" misleads), and what other processes held where the GPU itself was full (`others_gib`).
    Torch's first line where its figures are not found."""
    got = [fmt.format(m.group(1)) for fmt, rx in _OOM_FIGURES if (m := re.search(rx, text))]
    if not got:
        return short(text, 160)
    cap = os.environ.get("LORAKIT_MEMORY_CAP_GIB", "").strip()
    others = others_gib(text)
    return ", ".join(got) + (f" (this process held to {cap} GiB by LORAKIT_MEMORY_CAP_GIB)" if cap else "") + (
        f"; the GPU itself was full: other processes held {others:.1f} GiB of it" if others else "")


def others_gib(text: str) -> float | None:
    """GiB of the GPU that other processes held when PyTorch ran out, where the GPU itself had less free than was
    asked (not this process's cap) and they held a GiB or more — an H100, 2026-11-26: a 24 GiB cell beside three others on it
    ran out with 17.8 GiB allocated. None otherwise, or where torch's message does not say."""
    m = re.search(rf"total capacity of {_SIZE} of which {_SIZE} is free", text)
    mine = re.search(rf"this process has {_SIZE} memory in use", text)
    asked = re.search(rf"Tried to allocate {_SIZE}", text)
    if not (m and mine and asked):
        return None
    total, free = _gib(m.group(1)), _gib(m.group(2))
    others = total - free - _gib(mine.group(1))
    return others if free < _gib(asked.group(1)) and others >= 1 else None


def fragmented(text: str) -> str:
    """The hint's first words where PyTorch held a GiB or more that it could not hand out (its cached blocks
    were the wrong sizes) and expandable segments are off: Qwen-Image with 840 modules under 24 GiB ran out of memory
    with 2.37 GiB so held, and trains at 22.2 GiB with them on (H100, 2026-11-26)."""
    m = re.search(rf"{_SIZE} is reserved by PyTorch but unallocated", text)
    if not m or "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return ""
    return (f"{m.group(1)} were held in pieces too small to use: --set "
            "memory.expandable_segments=true lets PyTorch use them. ") if _gib(m.group(1)) >= 1 else ""


def free_bytes(path) -> int | None:
    """Free bytes on the disk holding a path (its nearest existing parent); None when unknown."""
    import shutil
    from pathlib import Path

    p = Path(path) if path else Path.cwd()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def disk_note(path) -> str:
    """'N MiB free there' for the disk holding a path."""
    free = free_bytes(path)
    if free is None:
        return "free space unknown"
    return f"{free / 2**20:.0f} MiB free there" if free < 2**30 else f"{free / 2**30:.1f} GiB free there"


# a collective whose peer died (gloo, NCCL): the other process's fault, reported by this one
_PEER_LOST = ("Connection reset by peer", "connectFullMesh failed", "Connection closed by peer",
              "remote process exited or there was a network error", "NCCL communicator was aborted")


def environment_fault(e: BaseException, path=None) -> EnvironmentFault | None:
    """The machine-level cause of an exception as a one-line `EnvironmentFault` naming the file (`path` when the
    exception does not carry one); None when it is not one lorakit recognises."""
    where = getattr(e, "filename", None) or path
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full and isinstance(e, RuntimeError) and path is not None and any(s in str(e) for s in _WRITE_FAILURES):
        free = free_bytes(path)  # torch.save reports a full disk as a stream error; the disk says what it was
        full = free is not None and free < 64 * 2**20
    if full:
        return EnvironmentFault(f"no space left on the device while writing {where or 'a file'} ({disk_note(where)})",
                                "free space there, or point output.dir / data.cache_dir at a larger disk")
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
        return EnvironmentFault(f"permission denied: {where or short(e)}",
                                "check the file's and folder's permissions, or choose another folder")
    if isinstance(e, OSError) and e.errno == errno.EROFS:
        return EnvironmentFault(f"read-only file system: cannot write {where or 'a file'}",
                                "choose a writable output.dir / data.cache_dir")
    if isinstance(e, OSError) and e.errno == errno.EIO:
        return EnvironmentFault(f"input/output error on {where or 'a file'}: the disk or network share failed",
                                "check the disk (dmesg), then run again")
    if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
        return EnvironmentFault("too many open files", "raise the limit (ulimit -n 65536) and run again")
    if isinstance(e, RuntimeError) and path is not None and any(s in str(e) for s in _WRITE_FAILURES):
        return EnvironmentFault(f"writing {path} failed: {short(e, 120)} ({disk_note(path)})",
                                "a full disk does this: free space there, or choose another folder")
    if isinstance(e, MemoryError):
        return EnvironmentFault("out of host memory (RAM)",
                                "close other programs, lower data.resolution or schedule.batch_size, or set "
                                "memory.cache_in_memory=false")
    if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e):
        others = others_gib(str(e))
        return EnvironmentFault(f"out of GPU memory: {gpu_oom_summary(str(e))}",
                                fragmented(str(e)) + (
                                    f"other processes hold {others:.1f} GiB of this GPU (nvidia-smi lists them): stop "
                                    "them or choose another GPU (CUDA_VISIBLE_DEVICES). " if others else
                                    "is another process using the GPU (nvidia-smi)? ") + "For training: "
                                "lower data.resolution or schedule.batch_size, or --set memory.blocks_to_swap=N "
                                "(`lorakit train CONFIG --dry-run` shows the estimate); for infer: --offload model | "
                                "fp8 | group")
    if isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_LOST):
        return EnvironmentFault(f"another process of this run stopped or cannot be reached: {short(e, 160)}",
                                "its own log says why; torchrun --max-restarts N restarts the group, which continues "
                                "from the latest checkpoint with --resume auto")
    if isinstance(e, ImportError):
        name = getattr(e, "name", None) or short(e, 80)
        return EnvironmentFault(f"a library lorakit needs is missing or broken: {name} ({short(e, 120)})",
                                "reinstall: pip install -e '.[quant]' (or `make setup`); `lorakit doctor` checks")
    return None
