"""Validate a run's datasets (what `lorakit cache --check` prints)."""

from __future__ import annotations

from lorakit.data.plan import plan_data


def check(cfg) -> dict:
    """Scan every dataset folder of a config; returns a JSON-able report (entries: what will be trained on:
    an image, or a window of a clip). The paths were checked when the config was resolved."""
    p = plan_data(cfg)
    return {"family": cfg.model.family, "datasets": p.datasets, "problems": p.problems, "buckets": p.buckets(),
            "items": sum(d["items"] for d in p.datasets), "entries": len(p.entries)}
