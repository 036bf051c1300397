"""Validate a run's datasets (what `lorakit cache --check` prints)."""

from __future__ import annotations

from pathlib import Path

from lorakit.models.base import family_adapter


def control_dirs_for(cfg, root: Path) -> list[str]:
    """The control folders of a dataset. A family that takes several control images (Edit-Plus), left at the
    default setting, uses every control folder present (control/, control_2/, ...) up to its maximum."""
    dirs = list(cfg.data.control_dirs)
    most = family_adapter(cfg.model.family).max_controls
    if most > 1 and dirs == ["control"] and root.is_dir():
        found = sorted((p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("control")),
                       key=lambda n: (len(n), n))
        return found[:most] or dirs
    return dirs


def check(cfg) -> dict:
    """Scan every dataset folder of a config; returns a JSON-able report (entries: what will be trained on:
    an image, or a window of a clip)."""
    from lorakit.config import check_paths
    from lorakit.data.plan import plan_data

    check_paths(cfg, model=False, data=True)
    p = plan_data(cfg)
    return {"family": cfg.model.family, "datasets": p.datasets, "problems": p.problems, "buckets": p.buckets(),
            "items": sum(d["items"] for d in p.datasets), "entries": len(p.entries)}
