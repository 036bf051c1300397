"""The base of every config section: unknown keys refused, assignments validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _suggest_multiple(value: int, m: int) -> str:
    lo, hi = (value // m) * m, (value // m + 1) * m
    opts = [str(x) for x in (hi, lo) if x > 0]
    return " or ".join(opts)
