"""Where lorakit keeps what it caches between runs (LORAKIT_CACHE, else ~/.cache/lorakit)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LORAKIT_CACHE"


def cache_root() -> Path:
    """The lorakit cache folder: measured machine facts, attention self-tests, library trials, tiny models."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lorakit")
    return Path(base)
