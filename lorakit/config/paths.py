"""Every path problem of a run at once: the model folder, the datasets, the output and cache folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lorakit.config.schema import Config
from lorakit.errors import ConfigError, EnvironmentFault
from lorakit.models.registry import FAMILIES, family_of_pipeline
from lorakit.models.sources import repo_of_snapshot


def _writable_dir_problem(key: str, path: Path) -> tuple[str, str] | None:
    """("input" | "machine", problem) for an output folder that cannot be used, None when it can."""
    if path.exists() and not path.is_dir():
        return "input", f"{key}: {path} is a file, not a folder"
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not os.access(p, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "a read-only file system" if read_only else f"no write permission on {p}"
        return "machine", f"{key}: cannot create or write {path} ({why})"
    return None


def _same_folders(named: list[tuple[str, Path]]) -> list[str]:
    """One problem per dataset folder listed more than once (its items would be cached and trained twice, each time
    with other settings)."""
    seen: dict[Path, str] = {}
    out = []
    for key, d in named:
        try:
            real = Path(d).resolve()
        except OSError:
            continue
        if real in seen:
            out.append(f"{key}: {d} is the folder {seen[real]} already names (list it once: in data.dirs, or in "
                       "data.datasets with its own settings)")
        else:
            seen[real] = key
    return out


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def model_folder_problems(folder: Path, key: str = "model.path", family: str | None = None) -> list[str]:
    """What keeps a diffusers model folder from loading as `family`: another pipeline than the family's (what the
    run's loader refuses), or what it lacks of the components its model_index.json names — a missing or empty
    component folder, a model component without weight files, a sharded one missing shards its index lists (what an
    interrupted download, a hub snapshot holding only model_index.json, or copy leaves). The download command when
    the folder is a Hugging Face cache snapshot."""
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return [f"{key}: {folder / 'model_index.json'} is unreadable ({e})"]
    if not isinstance(index, dict):
        return [f"{key}: {folder / 'model_index.json'} is not a diffusers model index (a JSON object)"]
    want = FAMILIES[family].pipeline_class if family in FAMILIES else None
    if want and index.get("_class_name") != want:
        got = index.get("_class_name")
        theirs = family_of_pipeline(got) if isinstance(got, str) else None
        return [f"{key}: {folder} holds a {got}, not the {want} that model.family {family} needs"
                + (f" (the folder is a {theirs} model: set model.family: {theirs}, or give a {family} model)"
                   if theirs else "")]
    if want and FAMILIES[family].index_marks:  # one pipeline class, several families (Wan 2.1 / 2.2 A14B / TI2V-5B)
        theirs = family_of_pipeline(want, index)
        if theirs != family:
            marks = ", ".join(f"{k} {'set' if v else 'unset'}" for k, v in FAMILIES[family].index_marks)
            return [f"{key}: {folder} is not a {family} model (its model_index.json lacks: {marks})"
                    + (f"; it is a {theirs} model: set model.family: {theirs}, or give a {family} model"
                       if theirs else "")]
    lacking = []
    for name, spec in index.items():
        if name.startswith("_") or not (isinstance(spec, list) and len(spec) == 2 and all(spec)):
            continue  # metadata, or a component the pipeline leaves out ([null, null])
        d = folder / name
        if not d.is_dir() or not any(d.iterdir()):
            lacking.append(f"{name}/")
            continue
        if (d / "config.json").is_file() and not any(next(d.glob(g), None) for g in _WEIGHTS):
            lacking.append(f"{name}/ weights")
            continue
        for idx in d.glob("*.index.json"):
            try:
                shards = set(json.loads(idx.read_text(encoding="utf-8")).get("weight_map", {}).values())
            except (OSError, ValueError, AttributeError):
                lacking.append(f"{name}/{idx.name} (unreadable)")
                continue
            gone = sorted(s for s in shards if not (d / s).is_file())
            if gone:
                lacking.append(f"{name}/{gone[0]}" + (f" and {len(gone) - 1} more shard(s)" if len(gone) > 1 else ""))
    if not lacking:
        return []
    hub = repo_of_snapshot(folder)
    how = (f"complete the download: hf download {hub} --include 'model_index.json' '*/*'"
           if hub else "an interrupted download or copy? copy or download the model folder again")
    return [f"{key}: {folder} lacks {', '.join(lacking)} of the components its model_index.json names ({how})"]


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
            problems.append(f"model.path: {mp} is a {mp.suffix or 'plain'} file; lorakit takes a diffusers model "
                            "folder (model_index.json inside), a Hugging Face repo id, or a single-file .safetensors "
                            "checkpoint with model.base" + (" (GGUF files are quantised for inference engines: give "
                                                           "the .safetensors file)" if mp.suffix == ".gguf" else ""))
        elif not (mp / "model_index.json").is_file():
            problems.append(f"model.path: {mp} has no model_index.json (not a diffusers pipeline folder)")
        else:
            problems += model_folder_problems(mp, family=cfg.model.family)
    if data:
        if not cfg.data.dirs and not cfg.data.datasets:
            problems.append("data.dirs: no dataset folder given")
        named = [("data.dirs", d) for d in cfg.data.dirs] + \
                [(f"data.datasets[{k}].dir", d.dir) for k, d in enumerate(cfg.data.datasets)]
        indexed = [(f"data.dirs[{k}]", d) for k, d in enumerate(cfg.data.dirs)] + named[len(cfg.data.dirs):]
        problems += _same_folders(indexed)
        for key, d in named:
            if not d.exists():
                problems.append(f"{key}: no such folder: {d}")
            elif not d.is_dir():
                problems.append(f"{key}: {d} is a file, not a dataset folder")
        for k, c in enumerate(cfg.sampling.controls if cfg.sampling.enabled else ()):
            for p in [c] if isinstance(c, Path) else c:
                if not p.is_file():
                    problems.append(f"sampling.controls[{k}]: no such image file: {p}")
    machine = []
    for key, path in (("output.dir", cfg.output.dir), ("data.cache_dir", cfg.data.cache_dir)):
        found = _writable_dir_problem(key, Path(path)) if path is not None else None
        if found:
            (problems if found[0] == "input" else machine).append(found[1])
    if problems:
        raise ConfigError(problems, hint="fix the paths (all are listed); --set model.path=... data.dirs=[...]")
    if machine:  # the input is right, the machine refuses it: exit 1, as a full disk is
        raise EnvironmentFault("; ".join(machine), "choose a folder you can write (--set output.dir=... "
                                                   "data.cache_dir=...), or fix its permissions")
