"""Where lorakit keeps what it caches between runs (LORAKIT_CACHE, else ~/.cache/lorakit)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LORAKIT_CACHE"


def cache_root() -> Path:
    """The lorakit cache folder: measured machine facts, attention self-tests, library trials, tiny models."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lorakit")
    return Path(base)


def write_whole(path: Path, write) -> bool:
    """A cache file written whole: `write(tmp)` fills a temporary sibling, which is renamed over `path`. A machine
    fault (disk full, read-only cache) or an interrupt leaves neither half a file nor the temporary one behind (an
    unwritable cache only costs recomputing it). Returns whether `path` was written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
        return True
    except OSError:
        return False
    finally:
        try:
            tmp.unlink(missing_ok=True)  # gone after the rename; what a failed or interrupted write left
        except OSError:
            pass
