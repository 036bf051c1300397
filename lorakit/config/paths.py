"""Every path problem of a run at once: the model folder, the datasets, the output and cache folders."""

from __future__ import annotations

import os
from pathlib import Path

from lorakit.config.schema import Config
from lorakit.errors import ConfigError


def _writable_dir_problem(key: str, path: Path) -> str | None:
    if path.exists() and not path.is_dir():
        return f"{key}: {path} is a file, not a folder"
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not os.access(p, os.W_OK | os.X_OK):
        return f"{key}: cannot create or write {path} (no write permission on {p})"
    return None


def check_paths(cfg: Config, model: bool = True, data: bool = True) -> None:
    """Every path problem of a run at once: the model folder, each dataset folder, the output and cache folders.

    Raises:
        ConfigError: listing them all.
    """
    problems = []
    if model:
        mp = cfg.model.path
        if mp is None:
            problems.append("model.path: required (the diffusers model folder)")
        elif not mp.exists():
            problems.append(f"model.path: no such folder: {mp}")
        elif not mp.is_dir():
            problems.append(f"model.path: {mp} is a file; lorakit takes the diffusers model folder "
                            "(model_index.json inside), as downloaded from the hub")
        elif not (mp / "model_index.json").is_file():
            problems.append(f"model.path: {mp} has no model_index.json (not a diffusers pipeline folder)")
    if data:
        if not cfg.data.dirs and not cfg.data.datasets:
            problems.append("data.dirs: no dataset folder given")
        named = [("data.dirs", d) for d in cfg.data.dirs] + \
                [(f"data.datasets[{k}].dir", d.dir) for k, d in enumerate(cfg.data.datasets)]
        for key, d in named:
            if not d.exists():
                problems.append(f"{key}: no such folder: {d}")
            elif not d.is_dir():
                problems.append(f"{key}: {d} is a file, not a dataset folder")
        for k, c in enumerate(cfg.sampling.controls if cfg.sampling.enabled else ()):
            for p in [c] if isinstance(c, Path) else c:
                if not p.is_file():
                    problems.append(f"sampling.controls[{k}]: no such image file: {p}")
    for key, path in (("output.dir", cfg.output.dir), ("data.cache_dir", cfg.data.cache_dir)):
        why = _writable_dir_problem(key, Path(path)) if path is not None else None
        if why:
            problems.append(why)
    if problems:
        raise ConfigError(problems, hint="fix the paths (all are listed); --set model.path=... data.dirs=[...]")
