"""The installed packages' import name -> distribution map, kept between processes.

diffusers and transformers each call `importlib.metadata.packages_distributions()` when they are imported. It reads
the file list of every installed distribution and checks that each file exists: on a machine with many packages,
seconds in every process (the H100 image measured on 2026-11-24: 158 distributions, 53,870 files checked, two calls, ~2.8 s of each
`lorakit train`'s start). The map changes only when a distribution is installed or removed, and that adds or
removes a `.dist-info` folder, which changes the modification time of the folder holding it: so the map is kept
under the lorakit cache, keyed by the import path's folders and their modification times, and the standard function
answers from it. A map that cannot be read or written is computed as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from lorakit.paths import cache_root, write_whole


def _key() -> str:
    """The import path's folders and their modification times (a distribution installed or removed changes one)."""
    seen = []
    for p in sys.path:
        try:
            seen.append((os.path.abspath(p or "."), os.stat(p or ".").st_mtime_ns))
        except OSError:
            seen.append((p, None))
    raw = json.dumps([sys.version, seen])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def use_cached_package_map() -> None:
    """From now on `importlib.metadata.packages_distributions()` answers from the kept map (computed and kept at its
    first call when there is none for this import path). Idempotent."""
    import importlib.metadata as md

    if getattr(md.packages_distributions, "lorakit_cached", False):
        return
    computed = md.packages_distributions
    path = cache_root() / "packages" / f"{_key()}.json"
    state: dict = {}

    def packages_distributions() -> dict[str, list[str]]:
        if "map" not in state:
            try:
                state["map"] = json.loads(path.read_text())
            except (OSError, ValueError):
                state["map"] = {k: list(v) for k, v in computed().items()}
                _keep(path, state["map"])
        return {k: list(v) for k, v in state["map"].items()}  # the caller's own copy, as the standard one gives

    packages_distributions.__doc__ = computed.__doc__
    packages_distributions.lorakit_cached = True
    packages_distributions.computed = computed
    md.packages_distributions = packages_distributions


def _keep(path, mapping: dict) -> None:
    """Written whole (a reader never sees half a map); the maps of earlier import paths are removed."""
    text = json.dumps(mapping)
    if not write_whole(path, lambda tmp: tmp.write_text(text)):  # a read-only cache: computed in each process,
        return  # as without lorakit
    try:
        for old in path.parent.glob("*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass
