"""The rectified-flow objective: sigma sampling, noising, target and loss weights.

x_t = (1 - sigma) x0 + sigma noise, target = noise - x0 (the velocity every family's Euler sampler
integrates). Sigmas are drawn as diffusers' training utilities draw them (same RNG calls, so the same
seed gives the same values), then shifted as the family's scheduler shifts its sampling sigmas.
"""

from __future__ import annotations

import math

from lorakit.errors import UnknownNameError
from lorakit.models.base import resolution_mu

METHODS = ("uniform", "logit_normal", "shift", "resolution_shift", "sigmoid", "mode")


def sample_sigmas(n: int, method: str = "uniform", generator=None, *, shift: float = 3.0, logit_mean: float = 0.0,
                  logit_std: float = 1.0, image_seq_len: int | None = None, scheduler_config: dict | None = None,
                  scale: float = 1.0, mu: float | None = None):
    """n training sigmas in (0, 1).

    Args:
        method: uniform | logit_normal | shift (fixed `shift`) | resolution_shift (the scheduler's own rule:
            its dynamic exponential shift for `image_seq_len` tokens, or its fixed `shift`) | sigmoid
            (sigmoid(scale * N(0, 1)): logit-normal about 0.5, wider as `scale` grows) | mode (SD3's mode
            sampling with heavy tails: 1 - u - scale * (cos²(pi u / 2) - 1 + u), u uniform; scale 0 is
            uniform, larger puts more weight mid-way; -1 <= scale <= 2 / (pi - 2)).
        mu: the dynamic shift the family's pipeline uses for these tokens (`Adapter.shift_mu`; None: the
            scheduler's linear rule).
    """
    import torch

    if method not in METHODS:
        raise UnknownNameError("timestep sampling", method, list(METHODS))
    if method == "logit_normal":
        u = torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(n,), generator=generator))
    elif method == "sigmoid":
        return torch.sigmoid(scale * torch.randn((n,), generator=generator))
    else:
        u = torch.rand(size=(n,), generator=generator)
    if method == "mode":
        return 1 - u - scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    if method == "shift":
        return shift * u / (1 + (shift - 1) * u)
    if method == "resolution_shift":
        cfg = scheduler_config or {}
        if cfg.get("use_dynamic_shifting"):
            if mu is None and image_seq_len is None:
                raise ValueError("resolution_shift needs image_seq_len")
            mu = resolution_mu(image_seq_len, cfg) if mu is None else mu
            if cfg.get("time_shift_type", "exponential") == "linear":
                return mu / (mu + (1 / u - 1))
            return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        s = float(cfg.get("shift", 1.0))
        return s * u / (1 + (s - 1) * u)
    return u


def in_range(draw, n: int, lo: float, hi: float, rounds: int = 64):
    """n sigmas from `draw(k)` (k new sigmas) restricted to [lo, hi) ([lo, 1] when hi is 1): those outside are
    drawn again, so the method's distribution is kept within the range (an expert's part of the trajectory);
    after `rounds` draws the few still outside are clamped into it."""
    import torch

    def inside(s):
        return (s >= lo) & ((s < hi) if hi < 1.0 else torch.ones_like(s, dtype=torch.bool))

    s = draw(n)
    for _ in range(rounds):
        bad = ~inside(s)
        k = int(bad.sum())
        if not k:
            return s
        s = s.clone()
        s[bad] = draw(k)
    return s.clamp(lo, hi - 1e-6 if hi < 1.0 else 1.0)


def noisy(x0, noise, sigmas):
    """(x_t, target) for latents x0 (B, ...) and per-item sigmas (B,)."""
    s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise, noise - x0


def loss_weight(sigmas, scheme: str = "none"):
    """Per-item loss weights (as diffusers' compute_loss_weighting_for_sd3)."""
    import torch

    if scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)
