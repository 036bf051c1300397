"""Everything a training run changes as it goes, in one object: the step, the optimizer and learning-rate schedule,
the RNG that LoRA dropout draws from, the average of the weights (EMA) and the best step so far. A checkpoint's
state.pt is `state_dict()` (plus the trained tensors, which live in the model); resuming is `load_state_dict`.
Nothing else in a run changes between steps, so nothing else needs saving."""

from __future__ import annotations

from dataclasses import dataclass

from lorakit.errors import InputError


@dataclass
class TrainState:
    opt: object  # the optimizer (its moments)
    sched: object  # the LR schedule
    step: int = 0  # optimizer steps done
    ema: object | None = None  # train.ema.EMA, when ema.enabled
    best: object | None = None  # train.validation.Best, when the run keeps its best step

    def advance(self, params) -> None:
        """After an optimizer step: the schedule moves on, the step counts, the average folds the weights in."""
        self.sched.step()
        self.step += 1
        if self.ema:
            self.ema.update(params, self.step)

    def state_dict(self, optimizer_state: dict | None) -> dict:
        """What state.pt holds of the run (the optimizer's state as the caller gathered it: whole, or None where
        each rank saves its own)."""
        import torch

        out = {"step": self.step, "optimizer": optimizer_state, "scheduler": self.sched.state_dict(),
               "torch_rng": torch.get_rng_state()}
        if self.ema:
            out["ema"] = self.ema.state_dict()
        if self.best:
            out["best"] = self.best.state()
        return out

    def load_state_dict(self, state: dict, where: str, params) -> list[str]:
        """Continue from state.pt's contents (the optimizer's state is loaded by the caller, which knows how it was
        saved). Returns notes on what could not continue as it was.

        Raises:
            InputError: the checkpoint's schedule or EMA do not fit this run.
        """
        import torch

        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])
        notes = []
        if self.ema and "ema" in state:
            self.ema.load_state_dict(state["ema"], where)
        elif self.ema:  # the checkpoint was written without EMA: the average starts from its weights
            self.ema.update(params, 0)
            notes.append("ema: the checkpoint has no average; it starts from the checkpoint's weights")
        elif "ema" in state:
            notes.append("ema: the checkpoint has an average, this run has ema.enabled false; it is not used")
        if self.best and "best" in state:
            self.best.load(state["best"])
        if self.step < 0:
            raise InputError(f"{where}: step {self.step} is not a step")
        return notes
