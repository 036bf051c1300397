"""Training: one step for every family (the adapter supplies the family's conventions), and `run`, the recipe.

Every random draw of a step (sigmas, noise, caption dropout) comes from a generator seeded by
(seed, step, micro-step), the batch order is a pure function of (seed, epoch), and LoRA dropout's global
RNG state is saved with each checkpoint — so a resumed run repeats the uninterrupted run's losses.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from lorakit.errors import InputError
from lorakit.train import checkpoint
from lorakit.train import dist as dist_mod
from lorakit.train import flow_matching as fm
from lorakit.train.inputs import Ahead
from lorakit.train.optim import lr_lambda, make_optimizer


class Trainer:
    """Holds the run's state; `train_step` advances it, `save`/`resume` persist it (train/checkpoint.py)."""

    def __init__(self, cfg, adapter, transformer, data, out_dir: Path, device: str, dtype, dist=None):
        import json

        import torch

        from lorakit.train.prepare import prepare

        self.cfg, self.adapter, self.data, self.out = cfg, adapter, data, out_dir
        self.device, self.dtype = device, dtype
        self.dist = dist or dist_mod.Dist()
        self.full = cfg.method == "full"
        p = prepare(cfg, adapter, transformer, device, dtype, self.dist)
        self.transformer, self.params, self.peft_config = p.transformer, p.params, p.peft_config
        self.quantized, self.swapper, self.sharded, self.compiled = p.quantized, p.swapper, p.sharded, p.compiled
        self.compile_note, self.graphs = p.compile_note, p.graphs
        self.opt = make_optimizer(self.params, cfg, device, full=self.full)
        # 8-bit (bitsandbytes) moments are saved per rank as they are, not gathered by parameter name
        self.per_rank_state = self.full and (getattr(self.opt, "local_shards", False)
                                             or type(self.opt).__module__.startswith("bitsandbytes"))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.step = 0
        sched_file = Path(cfg.model.path or ".") / "scheduler" / "scheduler_config.json"
        self.sched_cfg = json.loads(sched_file.read_text()) if cfg.model.path and sched_file.is_file() else {}
        self.stop_requested = False
        self.ema = None
        if cfg.ema.enabled:  # an average of the trained weights (train/ema.py)
            from lorakit.train.ema import EMA

            self.ema = EMA(self.params, cfg.ema.decay, cfg.ema.start_step, ema_device(cfg, device))
        self.best = None
        if data is not None and getattr(data, "validation", None) and (cfg.validation.best or cfg.validation.patience):
            from lorakit.train.validation import Best

            self.best = Best(cfg.validation.patience, cfg.validation.min_delta)
        self.consumer_check = None  # the last saved LoRA, read back by diffusers' and ComfyUI's rules
        self.ahead = Ahead(self)  # the next micro-step's inputs, drawn while the GPU works (train/inputs.py)

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
        optimizer update (torch's fused AdamW: skipped on the device when the loss is not finite, exactly as
        if it had not run) and drawn the next micro-step's inputs onto the device, so the GPU goes from this
        backward pass to the next forward pass without waiting for the host. Other optimizers update after
        the loss is known to be finite.
        """
        import torch

        s, d = self.cfg.schedule, self.dist
        fsdp = d.world if self.sharded else 1  # FSDP averages gradients over ranks: each share is x world
        mine = None  # this rank's loss, summed on the device over the micro-steps
        for micro in range(s.grad_accum):
            inp = self.ahead.take(self.step, micro)
            # this rank's share of the global mean
            loss = self.loss_on(inp.batch, inp.sigmas, inp.noise, reduce="sum") * (
                inp.weight * fsdp / (inp.n * s.grad_accum))
            loss.backward()
            mine = loss.detach() if mine is None else mine + loss.detach()
            self.ahead.prepare(*self.ahead.next_key(self.step, micro))
        if self.swapper:
            self.swapper.settle()
        early = self.update_before_check
        if early:  # queued now; the device skips it if the loss is not finite
            self.opt.found_inf = (~torch.isfinite(mine)).float()
            try:
                self._update()
            finally:  # never left for a later opt.step() outside this step
                del self.opt.found_inf
        total = d.total(float(mine) / fsdp)
        if not math.isfinite(total):
            raise InputError(f"the loss became {total} at step {self.step + 1}",
                             "lower optim.lr, or check memory.attention with `lorakit doctor`")
        if not early:
            self._update()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        if self.ema:
            self.ema.update(self.params, self.step)
        return total

    def _update(self) -> None:
        import torch

        if not self.sharded:
            self.dist.sum_grads(self.params)
        if self.cfg.optim.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
        self.opt.step()

    @property
    def update_before_check(self) -> bool:
        """Can the optimizer step be queued before the loss is checked? Only where the device itself skips it
        on a non-finite loss: torch's fused Adam/AdamW (its `found_inf` input, as AMP's grad scaler uses).
        Several processes: each would skip on its own share's loss alone, so they check first."""
        import torch

        return (isinstance(self.opt, (torch.optim.Adam, torch.optim.AdamW)) and not self.dist.enabled
                and all(g.get("fused") for g in self.opt.param_groups))

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

    def save(self, final: bool = False, name: str | None = None) -> Path:
        return checkpoint.save(self, final, name)

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


def run(cfg, prov: dict, resume: str | None = None, progress=None, stop_at: int | None = None, warn=None) -> dict:
    """Train per the config: cache (reused when built), LoRA, loop, checkpoints, metrics.

    Args:
        resume: "latest" (the newest checkpoint that reads back whole) or a checkpoint folder.
        stop_at: stop after this many steps (tests of interruption); the run's schedule is unchanged.
        warn: called with each warning as it happens (they are also in the result's "warnings").
    """
    import torch

    from lorakit.cache.builder import build, cache_dir_for
    from lorakit.cache.store import Store
    from lorakit.config import check_paths, device_and_dtype, dump_yaml
    from lorakit.io import atomic_path, clean_orphans
    from lorakit.models.base import load_adapter
    from lorakit.train import memory, sampling
    from lorakit.train.data import CachedData
    from lorakit.train.prepare import load_base
    from lorakit.train.report import MetricsLog, Notes, Timeline, doctor_summary, loss_curve, peak_rss_gib

    note = Notes(warn)  # the run's warnings, each also passed on as it happens
    mark = Timeline()  # seconds since run() began, by phase: how long a user waits, and on what
    check_paths(cfg, model=True, data=True)  # every path problem at once, before anything is loaded
    if cfg.logging.wandb:
        from lorakit.train.report import require_wandb

        require_wandb()
    device, dtype = device_and_dtype(cfg)
    if device.startswith("cuda") and cfg.memory.expandable_segments:
        memory.expandable_segments()
    d = dist_mod.init(device)
    device = d.device(device)
    cfg, estimate, memory_note = memory.fit_to_gpu(cfg, world=d.world)  # refuses before any weights load
    out = Path(cfg.output.dir)
    if d.main:
        gone = clean_orphans(out, recursive=True) + clean_orphans(cache_dir_for(cfg) / "items")
        if gone:  # a run killed mid-write leaves its temporary files; the finished files are whole
            note(f"removed {len(gone)} temporary file(s) an interrupted run left, e.g. {gone[0].name}")
        with atomic_path(out / "config.resolved.yaml") as tmp:
            tmp.write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.seed)
    adapter = load_adapter(cfg.model.family, cfg.model.path, device=device, dtype=dtype, backend=cfg.memory.loader)
    cache = build(cfg, adapter=adapter, dist=d)  # the ranks encode a share of the items each
    mark("cached")
    store = Store(cache_dir_for(cfg))
    data = CachedData(store, store.read_manifest(), cfg.schedule.batch_size * d.world, cfg.seed, cfg.data.repeats,
                      hold_out=cfg.validation.items, in_memory=cfg.memory.cache_in_memory,
                      datasets=cfg.data.all_datasets(), prior_ratio=cfg.data.prior_ratio)
    conds = sampling.conditions(cfg, adapter, data) if cfg.sampling.enabled else None  # encoded now, once
    if conds and cfg.memory.free_encoders_after_cache:
        adapter.unload(list(adapter.text_parts))
    from lorakit.hardware.attention import for_run

    choice = for_run(cfg, device, note if d.main else None)  # the SDPA backend in force for the whole run
    if d.main:
        doctor_summary(out, cfg.profile, choice)
    tr = Trainer(cfg, adapter, load_base(cfg, device, dtype), data, out, device, dtype, dist=d)
    mark("model_ready")
    if tr.compile_note and d.main:
        note(tr.compile_note)
    resumed = None
    if resume:
        ck, damaged = checkpoint.latest(out, tr.full) if resume == "latest" else (Path(resume), [])
        for w in damaged:
            note(w)
        if ck is None:
            raise InputError(f"--resume latest: no intact checkpoint in {out / 'checkpoints'}",
                             "start without --resume" + (" (the checkpoints there are damaged)" if damaged else ""))
        resumed = tr.resume(ck)
    if progress and d.main:
        progress(tr.step, cfg.schedule.steps, {"start": True, "global_batch": tr.global_batch, "world": d.world,
                                                "resumed": resumed, "compiled": tr.compiled})
    log = MetricsLog(out, tr.step if resume else None, main=d.main, warn=note, cfg=cfg)
    sampler = sampling.Sampler(tr, conds, out / "samples", warn=note) if conds and (d.main or tr.sharded) else None
    if sampler and tr.step == 0:  # FSDP: every rank takes part in the forward passes
        log.image("samples", sampler(0, write=d.main), 0)
        mark("first_samples")
    t_start = time.perf_counter()
    end = cfg.schedule.steps if stop_at is None else min(stop_at, cfg.schedule.steps)
    with checkpoint.stop_on_signals(tr):
        try:
            while tr.step < end and not tr.stop_requested:
                t0 = time.perf_counter()
                rec = {"step": None, "loss": tr.train_step()}
                rec.update(step=tr.step, lr=tr.sched.get_last_lr()[0], s_per_step=round(time.perf_counter() - t0, 4),
                           time=round(time.time(), 3))
                mark("first_step")
                if device.startswith("cuda"):
                    rec["gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                every = cfg.validation.every
                if data.validation and ((every and tr.step % every == 0) or tr.step == cfg.schedule.steps):
                    rec["val_loss"] = tr.eval_loss([it["key"] for it in data.validation])
                    if tr.best and tr.best.offer(tr.step, rec["val_loss"]):
                        rec["best"] = True
                        tr.save(name="best")
                log.write(rec)
                if progress and d.main:
                    progress(tr.step, cfg.schedule.steps, rec)
                if sampler and cfg.sampling.every and tr.step % cfg.sampling.every == 0:
                    log.image("samples", sampler(tr.step, write=d.main), tr.step)
                if cfg.output.save_every and tr.step % cfg.output.save_every == 0:
                    tr.save()
                tr.stop_requested = d.total(float(tr.stop_requested)) > 0  # a signal to any rank stops them all
                if tr.best and tr.best.stop:
                    break
        finally:
            log.close()
    early = bool(tr.best and tr.best.stop)  # validation.patience: no new best in that many checks
    interrupted = tr.step < cfg.schedule.steps and not early  # a signal after the last step still gets the LoRA
    if sampler and not interrupted and not (cfg.sampling.every and tr.step % cfg.sampling.every == 0):
        log.image("samples", sampler(tr.step, write=d.main), tr.step)
    ck = tr.save(final=not interrupted)
    result = {"steps": tr.step, "interrupted": interrupted, "checkpoint": str(ck), "metrics": str(log.path),
              "seconds": round(time.perf_counter() - t_start, 2), "cache": cache.to_dict(), "profile": prov,
              "memory_estimate": estimate, "memory_note": memory_note, "method": cfg.method,
              "processes": d.world, "global_batch": tr.global_batch, "rank": d.rank, "warnings": list(note),
              "timeline": dict(mark), "peak_rss_gib": peak_rss_gib(),
              "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device != "cpu" else None}
    if resumed:
        result["resumed"] = resumed
    if sampler and d.main and (out / "samples" / "progress.png").is_file():
        result["samples"] = str(out / "samples" / "progress.png")
    best_ck = out / "checkpoints" / "best"
    if tr.best and tr.best.step is not None:
        result["best"] = {**tr.best.report(), "checkpoint": str(best_ck)}
        if sampler and tr.best.step != tr.step and not tr.full:  # the best step's samples beside the others
            with checkpoint.weights_of(tr, best_ck):
                result["best"]["samples"] = str(sampler(tr.best.step, write=d.main, name="best"))
    if early:
        result["early_stopped"] = {"at_step": tr.step, "patience": cfg.validation.patience,
                                   "why": f"no val_loss better than step {tr.best.step}'s in "
                                          f"{cfg.validation.patience} checks; the LoRA is step {tr.best.step}'s"}
    if not interrupted and d.main:
        result.update(checkpoint.export(tr, best_ck if early else ck), consumer_check=tr.consumer_check)
        result["loss_curve"] = str(loss_curve(log.path, out / "loss_curve.png"))
    log.finish({k: result[k] for k in ("steps", "seconds", "peak_gpu_gib") if k in result}
               | ({"best_step": result["best"]["step"]} if "best" in result else {}))
    d.barrier()
    return result
