"""Optimizers and learning-rate schedules.

Full fine-tuning keeps the weights in bf16 (a 20 B model: 41 GB of weights instead of 82). Plain AdamW on bf16
weights loses every update smaller than half a bf16 step (lr 1e-5 on weights of 0.02 is 400x below it), so
`AdamWBf16` does the arithmetic in fp32 and rounds the new weight to bf16 stochastically (unbiased: small
updates land with the right probability). Its moments are bf16 too: 8 bytes per parameter in all. Its update is
one pass over each parameter's memory (`train.adam_kernel`).
FSDP-sharded parameters are DTensors; the optimizers here work on each rank's local shard.
"""

from __future__ import annotations

import functools
import math

import torch

from lorakit.errors import InputError
from lorakit.train import adam_kernel


def local(t):
    """The rank-local tensor of a DTensor (shares storage), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def flat_offset(p) -> int:
    """Where a parameter's rank-local part starts in the whole parameter, in elements (0 unless sharded)."""
    if not hasattr(p, "to_local"):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, at = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    stride, offset = 1, 0
    for size, first in zip(reversed(p.shape), reversed(at), strict=True):
        offset, stride = offset + first * stride, stride * size
    return offset


def clip_grad_norm(params, max_norm: float) -> None:
    """torch's clip_grad_norm_ (the L2 norm of all gradients, scaled to max_norm where larger); FSDP-sharded
    gradients are clipped on each rank's local shards, their squared norms summed in one all-reduce, instead of
    through DTensor's dispatch, operation by operation, for every gradient tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not all(hasattr(g, "to_local") for g in grads):  # (a replicated one would count once per rank)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    import torch.distributed as td

    shards = [local(g) for g in grads]
    squared = torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float32)).square().sum()
    td.all_reduce(squared)
    scale = (max_norm / (squared.sqrt() + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(shards, scale)


class AdamWBf16(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam for bf16 weights: fp32 math, bf16 moments, stochastic rounding — one kernel per
    parameter on a GPU (`adam_kernel`). The rounding noise is a hash of (seed, step, parameter number, element):
    a resumed run, on any number of ranks, rounds exactly as the uninterrupted one."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, seed=0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._seed = seed
        self._offsets: dict = {}

    @torch.no_grad()
    def step(self, closure=None):
        number = 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                number += 1
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    # shaped (and sharded) like the parameter, so FSDP state dicts gather them
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                st["step"] += 1
                t = int(st["step"])
                if id(p) not in self._offsets:
                    self._offsets[id(p)] = flat_offset(p)
                tensors = local(p), local(p.grad), local(st["exp_avg"]), local(st["exp_avg_sq"])
                update = adam_kernel.update if adam_kernel.usable(*tensors) else adam_kernel.update_reference
                update(*tensors, lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                       step=t, key=adam_kernel.noise_key(self._seed, t, number), offset=self._offsets[id(p)])


def on_default_streams(devices) -> bool:
    """Is every CUDA device of these working on its default stream (where bitsandbytes' kernels run)?"""
    return all(torch.cuda.current_stream(d) == torch.cuda.default_stream(d) for d in devices if d.type == "cuda")


@functools.cache
def adamw8bit_class():
    """bitsandbytes' AdamW8bit without its wait for the whole device after each parameter (a class built on first
    use: bitsandbytes imports lazily).

    bitsandbytes (0.50) calls torch.cuda.synchronize() after every parameter's update, so the host cannot queue
    the next one before the GPU has finished the last: 1,680 waits per step for Qwen-Image's 840 LoRA modules.
    Without them the rtx4090 profile's step took 0.671 s instead of 0.714 (median, one H100, same run, 2026-11-26;
    p90 0.740 instead of 0.865). Its kernels run on the
    default stream, in order with the gradients that the backward pass made there, so nothing needs the wait;
    the same kernels run with the same arguments in the same order (the same bits). Paged state, or a run on
    another stream, takes bitsandbytes' own step."""
    import bitsandbytes as bnb

    class AdamW8bit(bnb.optim.AdamW8bit):
        devices = None

        @torch.no_grad()
        def step(self, closure=None):
            if self.devices is None:  # the parameters' devices, once (not every step: 1,680 tensors for Qwen-Image)
                self.devices = {p.device for g in self.param_groups for p in g["params"]}
            if self.is_paged or not on_default_streams(self.devices):
                return super().step(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self.initialized:  # as bitsandbytes' step does once
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if not self.state[p]:
                        self.init_state(group, p, gi, pi)
                    self.update_step(group, p, gi, pi)
            return loss

    return AdamW8bit


def from_bitsandbytes(opt) -> bool:
    """Is this optimizer bitsandbytes' (8-bit moments; lorakit's subclasses of it too)?"""
    return any(c.__module__.startswith("bitsandbytes") for c in type(opt).__mro__)


def ShardedAdamW8bit(params, **kw):  # noqa: N802 - a class built on first use (bitsandbytes imports lazily)
    """bitsandbytes AdamW8bit over FSDP-sharded weights: its kernels run on each rank's local shard (plain
    parameters sharing the shards' storage), so every rank keeps 8-bit moments of its own part only. The state
    is per rank: a checkpoint holds one file per rank and resumes on the same number of GPUs."""
    class _Opt(adamw8bit_class()):  # its step without per-parameter waits
        local_shards = True

        def __init__(self):
            self.sharded = list(params)
            self.shards = [torch.nn.Parameter(local(p).detach(), requires_grad=True) for p in self.sharded]
            super().__init__(self.shards, **kw)

        @torch.no_grad()
        def step(self, closure=None):
            for sp, lp in zip(self.sharded, self.shards, strict=True):
                lp.grad = None if sp.grad is None else local(sp.grad)
            return super().step(closure)

        def zero_grad(self, set_to_none: bool = True):
            super().zero_grad(set_to_none)
            for sp in self.sharded:
                sp.grad = None

    return _Opt()


def make_optimizer(params, cfg, device: str, full: bool = False):
    """The configured optimizer. `full`: the weights themselves train (bf16 weights get AdamWBf16)."""
    o = cfg.optim
    params = list(params)
    eight_bit = o.name == "adamw8bit" or (o.name == "adamw" and cfg.memory.optimizer_8bit
                                          and device.startswith("cuda"))
    if o.name == "adamw" and not eight_bit:
        if full and cfg.model.dtype == "bf16":
            return AdamWBf16(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, seed=cfg.seed)
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                 fused=device.startswith("cuda"))
    if eight_bit and any(hasattr(p, "to_local") for p in params):
        return ShardedAdamW8bit(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if eight_bit:
        return adamw8bit_class()(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=o.lr, relative_step=False, scale_parameter=False, warmup_init=False,
                         weight_decay=o.weight_decay)
    try:
        from prodigyopt import Prodigy
    except ImportError:
        raise InputError("optim.name=prodigy needs the prodigyopt package", "pip install prodigyopt") from None
    return Prodigy(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


def lr_lambda(cfg):
    s = cfg.schedule

    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        rest = max(s.steps - s.warmup_steps, 1)
        p = min(max(step - s.warmup_steps, 0) / rest, 1.0)
        if s.lr_schedule == "linear":
            return 1.0 - p
        if s.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * p))
        return 1.0

    return f
