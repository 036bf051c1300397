"""An exponential moving average of the trained weights.

After optimizer step s (1-based): ema = theta for s <= start_step, else ema = decay * ema + (1 - decay) * theta,
kept in fp32 on the GPU or the CPU. Samples and the LoRA files are written with the average in place (`applied`);
resume restores it exactly (state.pt holds it beside the raw weights, which training continues from).
"""

from __future__ import annotations

import contextlib

from lorakit.errors import InputError


class EMA:
    def __init__(self, params: list, decay: float, start_step: int = 0, device: str | None = None):
        import torch

        self.decay, self.start_step = decay, start_step
        self.device = device
        with torch.no_grad():
            self.shadow = [p.detach().to(device or p.device, torch.float32, copy=True) for p in params]

    def update(self, params: list, step: int) -> None:
        """Fold in the weights after optimizer step `step`."""
        import torch

        with torch.no_grad():
            now = [p.detach().to(s.device, torch.float32) for p, s in zip(params, self.shadow, strict=True)]
            if step <= self.start_step:
                torch._foreach_copy_(self.shadow, now)
            else:
                torch._foreach_lerp_(self.shadow, now, 1.0 - self.decay)

    @contextlib.contextmanager
    def applied(self, params: list):
        """The average in the model's weights for the duration (the trained weights restored after)."""
        import torch

        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, s in zip(params, self.shadow, strict=True):
                p.copy_(s.to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "start_step": self.start_step, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict, where: str) -> None:
        shadow = state.get("shadow") or []
        same = len(shadow) == len(self.shadow) and all(a.shape == b.shape
                                                        for a, b in zip(shadow, self.shadow, strict=True))
        if not same:
            raise InputError(f"{where}: its EMA weights do not match this run's LoRA",
                             "resume with the lora settings the checkpoint was written with")
        for s, v in zip(self.shadow, shadow, strict=True):
            s.copy_(v)
