"""Validate a run's datasets (what `lorakit cache --check` prints)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from lorakit.data.buckets import make_buckets, nearest_bucket
from lorakit.data.dataset import scan
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info


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
    """Scan every dataset folder of a config; returns a JSON-able report."""
    from lorakit.config import check_paths

    check_paths(cfg, model=False, data=True)
    layout = family_adapter(cfg.model.family).layout
    patch = family_info(cfg.model.family).patch
    buckets = make_buckets(cfg.data.resolution, patch, cfg.data.bucket_min_side, cfg.data.bucket_max_side)
    report = {"family": cfg.model.family, "datasets": [], "problems": [], "buckets": {}, "items": 0}
    hist: Counter = Counter()
    for root in cfg.data.dirs:
        root = Path(root)
        controls = control_dirs_for(cfg, root) if root.is_dir() else cfg.data.control_dirs
        s = scan(root, layout=layout, control_dirs=controls, caption_ext=cfg.data.caption_ext,
                 min_side=cfg.data.bucket_min_side, trigger=cfg.data.trigger)
        report["datasets"].append({"dir": str(root), "layout": s.layout, "items": len(s.items),
                                   "problems": len(s.problems), "controls": controls if layout == "edit" else []})
        report["problems"] += [p.__dict__ for p in s.problems]
        report["items"] += len(s.items)
        for it in s.items:
            if it.size:
                hist[nearest_bucket(it.size, buckets)] += 1
    report["buckets"] = {f"{w}x{h}": n for (w, h), n in sorted(hist.items())}
    return report
