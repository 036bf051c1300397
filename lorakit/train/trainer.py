"""One training step for every family (the adapter supplies the family's conventions), validation loss, and the
run's state (`TrainState`).

Every random draw of a step (sigmas, noise, caption dropout) comes from a generator seeded by
(seed, step, micro-step), the batch order is a pure function of (seed, epoch), and LoRA dropout's global
RNG state is saved with each checkpoint — so a resumed run repeats the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from lorakit.dist import Dist
from lorakit.errors import InputError
from lorakit.train import checkpoint, shards
from lorakit.train import flow_matching as fm
from lorakit.train.ema import EMA
from lorakit.train.inputs import Ahead
from lorakit.train.optim import clip_grad_norm, from_bitsandbytes, lr_lambda, make_optimizer
from lorakit.train.prepare import prepare
from lorakit.train.state import TrainState
from lorakit.train.validation import Best
from lorakit.train.warm import pixels


def scheduler_config(model_path) -> dict:
    """The model's flow-matching scheduler config (its sigma shift), {} without a model folder."""
    f = Path(model_path or ".") / "scheduler" / "scheduler_config.json"
    cfg = json.loads(f.read_text()) if model_path and f.is_file() else {}
    if "flow_shift" in cfg and "shift" not in cfg:  # UniPC's name for the same shift (Wan's scheduler)
        cfg["shift"] = cfg["flow_shift"]
    return cfg


class Trainer:
    """One run's model, data and state (`TrainState`): `train_step` advances the state, `save` and `resume` write
    and read it whole (train/checkpoint.py)."""

    def __init__(self, cfg, adapter, transformer, data, out_dir: Path, device: str, dtype, dist=None):
        import torch

        self.cfg, self.adapter, self.data, self.out = cfg, adapter, data, out_dir
        self.device, self.dtype = device, dtype
        self.dist = dist or Dist()
        self.full = cfg.method == "full"
        p = prepare(cfg, adapter, transformer, device, dtype, self.dist)
        self.transformer, self.params, self.peft_config = p.transformer, p.params, p.peft_config
        self.quantized, self.swapper, self.sharded, self.compiled = p.quantized, p.swapper, p.sharded, p.compiled
        self.graphs, self.background = p.graphs, p.background
        t = time.perf_counter()
        opt = make_optimizer(self.params, cfg, device, full=self.full)
        self.took = p.took | {"optimizer": round(time.perf_counter() - t, 1)}  # the prepare phase's parts
        # 8-bit (bitsandbytes) moments are saved per rank as they are, not gathered by parameter name
        self.per_rank_state = self.full and (getattr(opt, "local_shards", False) or from_bitsandbytes(opt))
        ema = EMA(self.params, cfg.ema.decay, cfg.ema.start_step, ema_device(cfg, device)) if cfg.ema.enabled \
            else None  # an average of the trained weights (train/ema.py)
        keeps_best = data is not None and getattr(data, "validation", None) and (cfg.validation.best
                                                                                 or cfg.validation.patience)
        best = Best(cfg.validation.patience, cfg.validation.min_delta) if keeps_best else None
        self.state = TrainState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)), ema=ema, best=best)
        self.sched_cfg = scheduler_config(cfg.model.path)
        self.ahead = Ahead(self)  # the next micro-step's inputs, drawn while the GPU works (train/inputs.py)
        self.last_check = None  # the last saved LoRA as each consumer reads it (`save`)
        self.save_took: dict = {}  # seconds of each part of the last save (`checkpoint.save`)
        self.last_size = None  # "WxH" (xF frames) of the last batch: what a compile for a new shape was for
        self.pending = None  # a sharded checkpoint being written in the background (checkpoint.py)
        self.step_saved = None  # (step, folder) of the last step checkpoint: the run's end reuses it (checkpoint.py)
        self.staging_wait_s = 0.0  # seconds the updates waited for a background save's copy (shards.staged)
        self.wait_s = 0.0  # the last step's wait of the host for the GPU, for the loss (train/pace.py)

    # the run's state, read here; it changes only through train_step and resume
    opt = property(lambda self: self.state.opt)
    sched = property(lambda self: self.state.sched)
    step = property(lambda self: self.state.step)
    ema = property(lambda self: self.state.ema)
    best = property(lambda self: self.state.best)

    def loss_on(self, batch, sigmas, noise, reduce: str = "mean"):
        """Weighted flow-matching loss of one batch at given sigmas and noise (mean, or sum over items)."""
        import torch

        x0 = batch.latents.to(self.device, self.dtype)
        xt, target = fm.noisy(x0, noise.to(self.device, self.dtype), sigmas.to(self.device))
        text = {k: v.to(self.device) for k, v in batch.text.items()}
        text = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in text.items()}
        with torch.autocast(self.device.split(":")[0], dtype=self.dtype, enabled=self.dtype != torch.float32):
            v = self.adapter.predict(self.transformer, xt, sigmas.to(self.device), text,
                                     guidance=1.0, controls=[c.to(self.device, self.dtype) for c in batch.controls])
        err = (v.float() - target.float()) ** 2
        if batch.mask is None:
            per = err.flatten(1).mean(1)
        else:  # the mean over what the mask keeps (a masked-out latent adds nothing, and gets no gradient)
            m = batch.mask.to(self.device, torch.float32).expand_as(err)
            per = (err * m).flatten(1).sum(1) / m.flatten(1).sum(1).clamp_min(1e-6)
        w = fm.loss_weight(sigmas.to(self.device), self.cfg.schedule.loss_weighting).float()
        if batch.weights is not None:  # the item's dataset loss_weight (prior preservation)
            w = w * batch.weights.to(self.device)
        return (per * w).mean() if reduce == "mean" else (per * w).sum()

    def train_step(self) -> float:
        """One optimizer step over the global batch (this rank's share of it); returns the global loss.

        The host waits for the GPU once per step, for the loss. Before it waits it has already queued the
        optimizer update (`update_before_check`) and drawn the next micro-step's inputs onto the device, so the GPU
        goes from this backward pass to the next forward pass without waiting for the host. Other optimizers, and
        FSDP's sharded one, update after the loss is known to be finite; data parallel ranks have queued the
        loss's and the gradients' sums before that wait all the same.
        """
        import torch

        s, d = self.cfg.schedule, self.dist
        fsdp = d.world if self.sharded else 1  # FSDP averages gradients over ranks: each share is x world
        mine = None  # this rank's loss, summed on the device over the micro-steps
        for micro in range(s.grad_accum):
            inp = self.ahead.take(self.step, micro)
            self.last_size = self._pixels(inp.batch.latents.shape)
            # this rank's share of the global mean
            loss = self.loss_on(inp.batch, inp.sigmas, inp.noise, reduce="sum") * (
                inp.weight * fsdp / (inp.n * s.grad_accum))
            loss.backward()
            mine = loss.detach() if mine is None else mine + loss.detach()
            self.ahead.prepare(*self.ahead.next_key(self.step, micro))
        if self.swapper:
            self.swapper.settle()
        early, replicated = self.update_before_check, d.enabled and not self.sharded
        if replicated:  # data parallel: the loss's and the gradients' sums are queued before the host waits
            mine = d.summed(mine)  # every rank's, summed where it is (NCCL: no wait for the host)
            d.sum_grads(self.params)
        if early and self.skips_on_device:  # queued now; the device skips it if the global loss is not finite
            self.opt.found_inf = (~torch.isfinite(mine)).float()
            try:
                self._update()
            finally:  # never left for a later opt.step() outside this step
                del self.opt.found_inf
        elif early:  # queued now; a non-finite loss ends the run below, before anything is saved
            self._update()
        waited = time.perf_counter()
        total = float(mine) if early or replicated else d.total(float(mine) / fsdp)
        self.wait_s = time.perf_counter() - waited
        if not math.isfinite(total):
            raise InputError(f"the loss became {total} at step {self.step + 1}",
                             "lower optim.lr, or check memory.attention with `lorakit doctor`")
        if not early:
            self._update()
        self.opt.zero_grad(set_to_none=True)
        self.state.advance(self.params)
        return total

    def _pixels(self, shape) -> str:
        return pixels(self.adapter, shape)

    def _update(self) -> None:
        shards.staged(self)  # a background save's copy of the weights is taken before they change
        if self.cfg.optim.max_grad_norm:
            clip_grad_norm(self.params, self.cfg.optim.max_grad_norm)
        self.opt.step()

    @property
    def skips_on_device(self) -> bool:
        """Does the optimizer skip its update on the device when the loss is not finite? torch's fused Adam/AdamW
        (its `found_inf` input, as AMP's grad scaler uses)."""
        import torch

        return (isinstance(self.opt, (torch.optim.Adam, torch.optim.AdamW))
                and all(g.get("fused") for g in self.opt.param_groups))

    @property
    def update_before_check(self) -> bool:
        """Is the optimizer step queued before the host waits for the loss? The update queued before the wait
        keeps the GPU busy while the host launches it (the gradients' all-reduce included); after it, the GPU
        idles while the host launches it — one kernel per LoRA tensor for 8-bit AdamW: 20-35 ms of a 0.45 s
        Qwen-Image step at 24 GiB (960 tensors, one H200, 2026-12-02).

        torch's fused Adam/AdamW skips on the device when the loss is not finite (`skips_on_device`): the weights
        and moments stay exactly as they were, and data parallel processes skip alike on the loss summed over
        every rank on the device (`dist.summed`). lorakit's 8-bit AdamW (bitsandbytes' kernels, no such input)
        is queued before the wait as well: a non-finite loss ends the run at this step (`InputError`), before any
        checkpoint, sample or LoRA file is written, so the weights it changed are never kept — the last
        checkpoint is the one to resume from. FSDP's sharded optimizer checks first."""
        if self.sharded:
            return False
        return self.skips_on_device or from_bitsandbytes(self.opt)

    def averaged(self):
        """A context with the EMA weights in place (samples, validation, LoRA files); nothing when EMA is off."""
        import contextlib

        return self.ema.applied(self.params) if self.ema else contextlib.nullcontext()

    def eval_loss(self, keys: list[str], sigmas=(0.25, 0.5, 0.75), seed: int = 1234) -> float:
        """Loss on items at fixed sigmas and fixed noise (what overfitting should lower)."""
        import torch

        was = self.transformer.training
        self.transformer.eval()
        out = []
        with torch.no_grad(), self.averaged():
            for k in keys:
                b = self.data.load([k])
                noise = torch.randn(b.latents.shape, generator=torch.Generator().manual_seed(seed))
                out += [float(self.loss_on(b, torch.tensor([s]), noise)) for s in sigmas]
        self.transformer.train(was)
        return sum(out) / len(out)

    @property
    def global_batch(self) -> int:
        s = self.cfg.schedule
        return s.batch_size * self.dist.world * s.grad_accum

    def save(self, final: bool = False, name: str | None = None, background: bool = False) -> Path:
        """Write a checkpoint; returns its folder. `last_check`: the saved LoRA read back as each consumer reads it
        (diffusers, ComfyUI), against what was trained. `background`: see checkpoint.save."""
        ck, check = checkpoint.save(self, final, name, background)
        self.last_check = check or self.last_check
        return ck

    def resume(self, ck: Path) -> dict:
        return checkpoint.resume(self, ck)


def ema_device(cfg, device: str) -> str:
    """ema.device: auto keeps the average beside the weights, except where the profile saves GPU memory."""
    if cfg.ema.device == "cpu" or str(device) == "cpu":
        return "cpu"
    if cfg.ema.device == "gpu":
        return device
    tight = cfg.memory.blocks_to_swap or cfg.memory.base_quant != "none" or cfg.memory.unified_memory
    return "cpu" if tight else device
