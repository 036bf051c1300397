"""The one rule for every file the dashboard reads or writes: its real path (symbolic links followed, `..` resolved)
lies inside the folder it belongs to — the runs folder, a run folder, the datasets folder. A link inside a run folder
that points at `~/.ssh/id_rsa` is refused exactly as `../../.ssh/id_rsa` in a URL is.

Names that come from a request are checked first: a NUL byte, a lone surrogate (a URL's undecodable bytes) or an
absurd length is refused as bad input, never passed on to the operating system."""

from __future__ import annotations

import os
from pathlib import Path

from lorakit.errors import InputError

MAX_NAME = 1024  # characters of a relative name a request may give


def clean(rel: str, what: str = "path") -> str:
    """`rel` when it is a name the file system can be asked about; InputError otherwise."""
    if len(rel) > MAX_NAME:
        raise InputError(f"{what} of {len(rel)} characters (at most {MAX_NAME})")
    if "\x00" in rel:
        raise InputError(f"{what} {rel[:80]!r}: contains a NUL byte")
    try:
        parts = [len(x.encode("utf-8")) for x in rel.split("/")]
    except UnicodeEncodeError:
        raise InputError(f"{what} {rel[:80].encode('utf-8', 'replace').decode()!r}: not valid UTF-8") from None
    if max(parts, default=0) > 255:
        raise InputError(f"{what} {rel[:80]!r}...: a name longer than a file system allows (255 bytes)")
    return rel


def inside(root: Path, path: Path | str, what: str = "the runs folder") -> Path:
    """The real path of `path` (absolute, or relative to root), refused (InputError) unless it lies inside root's
    real path. The path need not exist; an existing link is followed to judge it."""
    real_root = Path(os.path.realpath(root))
    p = Path(os.path.realpath(Path(root) / clean(str(path))))
    if p != real_root and real_root not in p.parents:
        raise InputError(f"{path}: outside {what}")
    return p


def confined(root: Path, rel: str, what: str = "the runs folder") -> Path:
    """root / rel from a request (InputError when it leaves root by '..', an absolute path or a link)."""
    return inside(root, clean(rel), what)


def read_text(root: Path, path: Path, limit: int | None = None) -> str:
    """A text file inside root (its last `limit` bytes when given); OSError as open() raises it, InputError when the
    file lies outside root."""
    p = inside(root, path, f"its folder {root}")
    with open(p, "rb") as f:
        if limit is not None:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
        return f.read().decode("utf-8", errors="replace")


def is_file(root: Path, path: Path) -> bool:
    """A regular file inside root (a link out of it is not)."""
    try:
        return inside(root, path).is_file()
    except (InputError, OSError):
        return False


def is_dir(root: Path, path: Path) -> bool:
    """A folder inside root (a link out of it is not)."""
    try:
        return inside(root, path).is_dir()
    except (InputError, OSError):
        return False
