"""The run folders under a root, read as `lorakit ui` shows them: what `lorakit train` writes (config.resolved.yaml,
metrics.jsonl, samples/, checkpoints/, lora.safetensors, the folder lock) — nothing else is needed, so a run started
from a terminal, a scheduler or the UI looks the same.

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
from lorakit.io.lock import holder

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
    m = run / "metrics.jsonl"
    return (m if m.exists() else run / CONFIG).stat().st_mtime


def confined(root: Path, rel: str) -> Path:
    """root / rel, refused (InputError) when it leaves root — by '..', an absolute path or a symlink pointing out."""
    root = Path(root).resolve()
    p = (root / rel).resolve()
    if p != root and root not in p.parents:
        raise InputError(f"{rel}: outside the runs folder")
    return p


def read_metrics(run: Path, since: int = 0) -> list[dict]:
    """metrics.jsonl lines from line `since` on (a line being written is left for the next read)."""
    try:
        with open(run / "metrics.jsonl", encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines[since:]:
        if not line.endswith("\n"):
            break
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({})  # keeps the line count; the chart skips it
    return out


def _config(run: Path) -> dict:
    import yaml

    try:
        return yaml.safe_load((run / CONFIG).read_text(encoding="utf-8")) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return {}


def status(run: Path) -> str:
    if holder(run) is not None:
        return "running"
    ck = run / "checkpoints"
    if (ck / "final").is_dir():
        return "finished"
    if ck.is_dir() and any(p.name.startswith("step-") for p in ck.iterdir()):
        return "interrupted"
    return "failed"


def summary(run: Path, root: Path) -> dict:
    """One row of the run list."""
    cfg = _config(run)
    rows = [m for m in read_metrics(run) if "loss" in m]
    total = (cfg.get("schedule") or {}).get("steps")
    step = rows[-1].get("step", 0) if rows else 0
    recent = [m["s_per_step"] for m in rows[-20:] if isinstance(m.get("s_per_step"), (int, float))]
    sps = statistics.median(recent) if recent else None
    st = status(run)
    val = [m["val_loss"] for m in rows if isinstance(m.get("val_loss"), (int, float))]
    return {"name": str(run.relative_to(root)) if run != root else ".", "status": st,
            "family": (cfg.get("model") or {}).get("family"), "step": step, "steps": total,
            "loss": rows[-1].get("loss") if rows else None, "val_loss": val[-1] if val else None,
            "s_per_step": sps, "eta_s": (total - step) * sps if st == "running" and sps and total else None,
            "updated": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_mtime(run))), "holder": holder(run)}


def detail(run: Path, root: Path) -> dict:
    """The run page: its summary, resolved config, sample grids (oldest first), checkpoints and files."""
    out = summary(run, root)
    name = out["name"]
    samples = sorted((run / "samples").glob("*.png")) if (run / "samples").is_dir() else []
    ck = run / "checkpoints"
    out["config"] = (run / CONFIG).read_text(encoding="utf-8", errors="replace")
    out["samples"] = [f"{name}/samples/{p.name}" for p in samples]
    out["checkpoints"] = [{"name": c.name, "files": [f"{name}/checkpoints/{c.name}/{f.name}"
                                                     for f in sorted(c.iterdir()) if f.is_file()]}
                          for c in sorted(ck.iterdir()) if c.is_dir()] if ck.is_dir() else []
    out["files"] = [f"{name}/{f}" for f in ("lora.safetensors", "loss_curve.png", "metrics.jsonl", CONFIG)
                    if (run / f).is_file()]
    return out


def run_folder(root: Path, name: str) -> Path:
    """The run folder a name in the list stands for (confined to root; InputError when it is not a run)."""
    run = confined(root, name)
    if not (run / CONFIG).is_file():
        raise InputError(f"{name}: not a run folder")
    return run
