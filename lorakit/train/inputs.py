"""What one micro-step trains on: the batch, its sigmas and noise — drawn, and moved to the GPU, ahead of time.

Everything here is a pure function of (seed, step, micro-step): the batch order (`data.batch_at`), caption
dropout, the tag ordering, sigmas and noise all come from the step's own generator. So the trainer can draw
the next micro-step's inputs while the GPU still runs this one's backward pass, and copy them to the device
from pinned memory without waiting — the GPU then finds the next forward's inputs in place instead of idling
while the host samples noise and copies tensors — and a resumed run still sees exactly the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lorakit.train import flow_matching as fm


@dataclass
class StepInputs:
    key: tuple[int, int]  # (step, micro-step) they were drawn for
    batch: object  # train.data.Batch: this rank's items
    sigmas: object  # (items,)
    noise: object  # like batch.latents
    weight: float  # 0.0: a rank with no item of its own runs one at weight 0 (collectives stay in step)
    n: int  # items in the global micro-batch


def generator(seed: int, step: int, micro: int):
    import torch

    return torch.Generator().manual_seed((seed * 1_000_003 + step * 1009 + micro) % 2**63)


def draw(tr, step: int, micro: int) -> StepInputs:
    """The inputs of (step, micro) for this rank, on the CPU, as the trainer's config and data define them."""
    import torch

    s, d, cfg = tr.cfg.schedule, tr.dist, tr.cfg
    g = generator(cfg.seed, step, micro)
    keys = tr.data.batch_at(step * s.grad_accum + micro)  # the global micro-batch
    n = len(keys)
    drop = (torch.rand(n, generator=g) < cfg.data.caption_dropout).tolist()
    idx, weight = d.share(range(n)), 1.0
    if not idx:
        idx, weight = [0], 0.0
    variants = None
    if cfg.data.caption_shuffle:  # one of the item's cached tag orderings
        v = torch.randint(cfg.data.caption_variants, (n,), generator=g).tolist()
        variants = [v[i] for i in idx]
    batch = tr.data.load([keys[i] for i in idx], [drop[i] for i in idx], variants)
    seq = tr.adapter.image_seq_len(batch.latents.shape)
    mu = tr.adapter.shift_mu(seq, tr.sched_cfg)

    def sigmas_of(k: int):
        return fm.sample_sigmas(k, s.timesteps, g, shift=s.shift, logit_mean=s.logit_mean, logit_std=s.logit_std,
                                image_seq_len=seq, scheduler_config=tr.sched_cfg, scale=s.scale, mu=mu)

    lo, hi = tr.adapter.sigma_range(cfg.model.expert)  # an expert trains on its own part of the trajectory only
    sigmas = sigmas_of(n) if (lo, hi) == (0.0, 1.0) else fm.in_range(sigmas_of, n, lo, hi)
    noise = torch.randn((n, *batch.latents.shape[1:]), generator=g)
    if idx != list(range(n)):
        sigmas, noise = sigmas[idx], noise[idx]
    return StepInputs((step, micro), batch, sigmas, noise, weight, n)


def to_device(inp: StepInputs, device: str) -> StepInputs:
    """The same inputs on `device`, copied from pinned memory without blocking the host (CUDA); values and
    dtypes unchanged (the loss casts on the device, as it would from the CPU)."""
    if not device.startswith("cuda"):
        return inp

    def mv(t):
        if t is None or t.device.type != "cpu":
            return t
        return t.pin_memory().to(device, non_blocking=True)

    b = inp.batch
    batch = replace(b, latents=mv(b.latents), text={k: mv(v) for k, v in b.text.items()},
                    controls=[mv(c) for c in b.controls], mask=mv(b.mask), weights=mv(b.weights))
    return replace(inp, batch=batch, sigmas=mv(inp.sigmas), noise=mv(inp.noise))


class Ahead:
    """At most one micro-step's inputs drawn (and on their way to the device) before they are needed."""

    def __init__(self, tr):
        self.tr, self.held = tr, None

    def next_key(self, step: int, micro: int) -> tuple[int, int]:
        return (step, micro + 1) if micro + 1 < self.tr.cfg.schedule.grad_accum else (step + 1, 0)

    def prepare(self, step: int, micro: int) -> None:
        """Draw (step, micro) now; a failure is left for `take` to raise where the step needs them."""
        try:
            self.held = to_device(draw(self.tr, step, micro), self.tr.device)
        except Exception:  # noqa: BLE001 - the same draw runs again in take() and raises there, in its step
            self.held = None

    def take(self, step: int, micro: int) -> StepInputs:
        held, self.held = self.held, None
        if held is not None and held.key == (step, micro):
            return held
        return to_device(draw(self.tr, step, micro), self.tr.device)
