"""The run folders under a root, read as `lorakit ui` shows them: what `lorakit train` writes (config.resolved.yaml,
metrics.jsonl, phases.jsonl, samples/, checkpoints/, lora.safetensors, the folder lock) — nothing else is needed, so
a run started from a terminal, a scheduler or the UI looks the same.

Status: **running** (a process holds the run's folder lock), **finished** (checkpoints/final), **interrupted** (not
running, step checkpoints but no final: `--resume latest` continues it), **failed** (not running, nothing saved).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from lorakit.errors import InputError
from lorakit.events import PHASES
from lorakit.io.lock import holder
from lorakit.ui.confine import confined, inside, is_dir, is_file, read_text

CONFIG = "config.resolved.yaml"
MAX_DEPTH = 3  # run folders are looked for this deep under the root
SKIP = {"cache", "checkpoints", "samples", "tensorboard", "data", ".git", "node_modules"}


def find_runs(root: Path) -> list[Path]:
    """Every run folder (one holding config.resolved.yaml and metrics or checkpoints) under root, newest first."""
    root = Path(root)
    found = []

    def walk(d: Path, depth: int):
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        names = {e.name for e in entries}
        if CONFIG in names and ({"metrics.jsonl", "checkpoints", ".lorakit.lock"} & names):
            found.append(d)
        if depth >= MAX_DEPTH:
            return
        for e in entries:
            if e.is_dir(follow_symlinks=False) and e.name not in SKIP and not e.name.startswith("."):
                walk(Path(e.path), depth + 1)

    walk(root, 0)
    return sorted(found, key=_mtime, reverse=True)


def _mtime(run: Path) -> float:
    """When the run last wrote (its metrics, else its config; 0 when neither can be read inside the folder)."""
    for f in ("metrics.jsonl", CONFIG):
        try:
            return inside(run, run / f).stat().st_mtime
        except (OSError, InputError):
            continue
    return 0.0


def read_lines(run: Path, name: str, since: int = 0) -> list[dict]:
    """A JSON-lines file of the run (metrics.jsonl, phases.jsonl) from line `since` on: a line being written is left
    for the next read, one that is not a JSON object is {} (the line count kept; the page skips it); none when the
    file is missing, unreadable or a link out of the run folder."""
    try:
        lines = read_text(run, run / name).splitlines(keepends=True)
    except (OSError, InputError):
        return []
    out = []
    for line in lines[since:]:
        if not line.endswith("\n"):
            break
        try:
            got = json.loads(line)
        except ValueError:
            got = None
        out.append(got if isinstance(got, dict) else {})
    return out


def read_metrics(run: Path, since: int = 0) -> list[dict]:
    """metrics.jsonl's records from line `since` on (`read_lines`)."""
    return read_lines(run, "metrics.jsonl", since)


def run_config(run: Path) -> dict:
    """The run's resolved config as a mapping; InputError when it cannot be read as one."""
    import yaml

    try:
        got = yaml.safe_load(read_text(run, run / CONFIG)) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise InputError(f"{run / CONFIG}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
            from None
    if not isinstance(got, dict) or not all(isinstance(got.get(k, {}), dict) for k in ("model", "schedule")):
        raise InputError(f"{run / CONFIG}: not a lorakit config (a mapping with model: and schedule: sections)")
    return got


def status(run: Path) -> str:
    if holder(run) is not None:
        return "running"
    ck = run / "checkpoints"
    if is_dir(run, ck / "final"):
        return "finished"
    if resumable(run):
        return "interrupted"
    return "failed"


def resumable(run: Path) -> bool:
    """A step checkpoint inside the run folder: `--resume latest` can continue from it."""
    ck = run / "checkpoints"
    try:
        return is_dir(run, ck) and any(p.name.startswith("step-") and is_dir(run, p) for p in ck.iterdir())
    except OSError:
        return False


def summary(run: Path, root: Path) -> dict:
    """One row of the run list: a folder whose config cannot be read is listed as "unreadable" with the reason."""
    name = str(run.relative_to(root)) if run != root else "."
    try:
        return _summary(run, name)
    except (InputError, OSError, TypeError, ValueError, AttributeError) as e:
        why = e.message if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
        return {"name": name, "status": "unreadable", "error": why, "family": None, "step": 0, "steps": None,
                "loss": None, "val_loss": None, "s_per_step": None, "eta_s": None, "updated": None, "holder": None}


def _summary(run: Path, name: str) -> dict:
    cfg = run_config(run)
    rows = [m for m in read_metrics(run) if "loss" in m]
    total = (cfg.get("schedule") or {}).get("steps")
    step = rows[-1].get("step", 0) if rows else 0
    # the pace of the last 20 intervals; the first step record (the compile, the first allocations) is its own figure
    recent = [m["s_per_step"] for m in rows[1:][-20:] if isinstance(m.get("s_per_step"), (int, float))]
    sps = statistics.median(recent) if recent else None
    st = status(run)
    val = [m["val_loss"] for m in rows if isinstance(m.get("val_loss"), (int, float))]
    return {"name": name, "status": st,
            "family": (cfg.get("model") or {}).get("family"), "step": step, "steps": total,
            "loss": rows[-1].get("loss") if rows else None, "val_loss": val[-1] if val else None,
            "s_per_step": sps, "eta_s": (total - step) * sps if st == "running" and sps and total else None,
            "updated": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_mtime(run))), "holder": holder(run)}


def detail(run: Path, root: Path) -> dict:
    """The run page: its summary, resolved config, sample grids (oldest first), checkpoints and files."""
    out = summary(run, root)
    name = out["name"]
    ck = run / "checkpoints"
    try:
        out["config"] = read_text(run, run / CONFIG)
    except (OSError, InputError) as e:
        out["config"] = f"# unreadable: {e}"
    out["samples"] = [f"{name}/samples/{p.name}" for p in samples(run)]
    out["checkpoints"] = [{"name": c.name, "files": [f"{name}/checkpoints/{c.name}/{f.name}"
                                                     for f in sorted(c.iterdir()) if is_file(run, f)]}
                          for c in sorted(ck.iterdir()) if is_dir(run, c)] if is_dir(run, ck) else []
    out["files"] = [f"{name}/{f}" for f in ("lora.safetensors", "loss_curve.png", "metrics.jsonl", PHASES, CONFIG)
                    if is_file(run, run / f)]
    out["prompts"] = prompts(run)
    out["path"] = str(run)
    return out


def read_phases(run: Path, since: int = 0) -> list[dict]:
    """phases.jsonl's lines (the run's phases, infos and warnings as they happened) from line `since` on."""
    return read_lines(run, PHASES, since)


def prompts(run: Path) -> list[str]:
    """The sampling prompts of the run's resolved config (the rows of its sample grids, in order)."""
    try:
        got = (run_config(run).get("sampling") or {}).get("prompts") or []
    except InputError:
        return []
    return [p if isinstance(p, str) else str((p or {}).get("prompt", p)) for p in got]


def samples(run: Path) -> list[Path]:
    """The run's sample grids (PNG files inside the run folder), oldest name first."""
    folder = run / "samples"
    if not is_dir(run, folder):
        return []
    return [p for p in sorted(folder.glob("*.png")) if is_file(run, p)]


def run_folder(root: Path, name: str) -> Path:
    """The run folder a name in the list stands for (confined to root; InputError when it is not a run)."""
    run = confined(root, name)
    if not is_file(run, run / CONFIG):
        raise InputError(f"{name}: not a run folder")
    return run
