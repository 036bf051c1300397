"""Validate a run's datasets (what `lorakit cache --check` prints)."""

from __future__ import annotations

from lorakit.data.plan import plan_data
from lorakit.errors import InputError


def strict_refusal(problems: list[dict], hint: str) -> InputError:
    """--strict and dataset problems: one line naming the first file and what is wrong with it."""
    first = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return InputError(f"--strict: {first['path']}: {first['code']}: {first['message']}{more}", hint,
                      details={"problems": problems})


def check(cfg) -> dict:
    """Scan every dataset folder of a config; returns a JSON-able report (entries: what will be trained on:
    an image, or a window of a clip). The paths were checked when the config was resolved."""
    p = plan_data(cfg)
    return {"family": cfg.model.family, "datasets": p.datasets, "problems": p.problems, "buckets": p.buckets(),
            "items": sum(d["items"] for d in p.datasets), "entries": len(p.entries), "warnings": p.notes}
