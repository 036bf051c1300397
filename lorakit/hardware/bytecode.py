"""Does this Python compile the big libraries from source in every process?

Python keeps a module's compiled bytecode beside its source (`__pycache__`, or under `sys.pycache_prefix`) and
reads it back in the next process. `pip install` writes it at install time; an environment made without it (uv
without `--compile-bytecode`, an image whose `__pycache__` folders were removed) gets it written at the first import,
unless Python may not write it (PYTHONDONTWRITEBYTECODE, a common container setting, or a read-only folder). Then
every process compiles torch, transformers, diffusers and peft from source again: on one H200 (2026-12-01, such an
image) `lorakit train`'s "check config and machine" compiled 3,805 modules in 6.6 s (cProfile), and importing torch,
diffusers, transformers, peft and Inductor took 16.9 s, 12.0 s after `python -m compileall` of five of them. A run
starts several Python processes (the attention self-test's, the compile processes and their compile workers), and
each pays it. `lorakit doctor` and `lorakit train` say so, with the one command that ends it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers", "diffusers", "peft")  # what every lorakit run imports, the largest first


def _writable(path: Path) -> bool:
    """Could this process create `path` (its nearest existing folder writable)?"""
    for p in (path, *path.parents):
        if p.exists():
            return os.access(p, os.W_OK)
    return False


def _folder(spec) -> Path:
    """The folder a package or module is installed in (site-packages, typically)."""
    origin = Path(spec.origin)
    return origin.parents[1] if spec.submodule_search_locations is not None else origin.parent


def uncached(packages=None, dont_write: bool | None = None) -> list[str]:
    """The installed `packages` that this Python compiles from source in every process: no bytecode for this Python
    beside their `__init__.py` (or under `sys.pycache_prefix`), and none will be written (`dont_write`, default
    `sys.dont_write_bytecode`, or the folder not writable). Found without importing them. Default: `PACKAGES`."""
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    out = []
    for name in PACKAGES if packages is None else packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        cached = Path(importlib.util.cache_from_source(spec.origin))
        if not cached.exists() and (dont_write or not _writable(cached.parent)):
            out.append(name)
    return out


def problem(packages=None, dont_write: bool | None = None) -> dict | None:
    """Where `uncached` names packages: {"names", "why", "fix"} (None: nothing to say)."""
    names = uncached(packages, dont_write)
    if not names:
        return None
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    why = ("PYTHONDONTWRITEBYTECODE is set" if dont_write and os.environ.get("PYTHONDONTWRITEBYTECODE")
           else "this Python does not write bytecode (-B)" if dont_write else "their folders are not writable")
    folders = sorted({str(_folder(importlib.util.find_spec(n))) for n in names})
    return {"names": names, "why": why,
            "fix": f"once, as the folders' owner: python -m compileall -q -j 0 {' '.join(folders)} (or install with "
                   "pip, or with uv's --compile-bytecode)"}


def note(packages=None, dont_write: bool | None = None) -> str | None:
    """What `lorakit train` tells the user where `problem` finds one (None: nothing to say)."""
    p = problem(packages, dont_write)
    if p is None:
        return None
    return (f"Python compiles {', '.join(p['names'])} from source in every process here: no cached bytecode, and "
            f"{p['why']} (each lorakit process and its helper processes pay it: 6.6 s of a run's start on one H200, "
            f"2026-12-01); {p['fix']}")
