"""The base of every config section: unknown keys refused, numbers finite (`.inf` and `.nan` are YAML numbers, and
no setting means them), assignments validated."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

# the longest caption, prompt or trigger lorakit takes: the text encoders see at most 512 (T5) or 1024 (Qwen2.5-VL)
# tokens, a few thousand characters; past this a file is not a caption (and tokenizing 50 MB takes minutes)
MAX_TEXT_CHARS = 16384
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _suggest_multiple(value: int, m: int) -> str:
    lo, hi = (value // m) * m, (value // m + 1) * m
    opts = [str(x) for x in (hi, lo) if x > 0]
    return " or ".join(opts)
