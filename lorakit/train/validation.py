"""The best step by held-out loss: which step won, why, and when to stop early (validation.patience)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Best:
    patience: int = 0
    min_delta: float = 0.0
    step: int | None = None
    loss: float = math.inf
    checks: list = field(default_factory=list)  # (step, val_loss) of every check
    since: int = 0  # checks since the last new best

    def offer(self, step: int, loss: float) -> bool:
        """Record a check; True when it is a new best (lower than the best by more than min_delta)."""
        self.checks.append((step, loss))
        if loss < self.loss - self.min_delta:
            self.step, self.loss, self.since = step, loss, 0
            return True
        self.since += 1
        return False

    @property
    def stop(self) -> bool:
        return bool(self.patience) and self.since >= self.patience

    def state(self) -> dict:
        return {"step": self.step, "loss": self.loss, "checks": list(self.checks), "since": self.since}

    def load(self, state: dict) -> None:
        self.step, self.loss, self.since = state["step"], float(state["loss"]), int(state["since"])
        self.checks = [tuple(c) for c in state["checks"]]

    def report(self) -> dict:
        if self.step is None:
            return {"step": None, "why": "no val_loss was computed"}
        last_step, last = self.checks[-1]
        why = (f"lowest val_loss of {len(self.checks)} checks: {self.loss:.5g} at step {self.step}"
               + ("" if last_step == self.step else f" (last check {last:.5g} at step {last_step}, "
                  f"{(last / self.loss - 1) * 100:+.1f} %)"))
        return {"step": self.step, "val_loss": self.loss, "checks": len(self.checks), "why": why}
