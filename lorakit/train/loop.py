"""A training run, read top down: `setup` builds everything (cache, data, sampler, model, state), `steps` runs the
optimizer steps with their logging, samples, checkpoints and validation, `finish` saves the result and says what
was done. The run's config arrives resolved (`lorakit.plan.resolve`): this module decides nothing about the
machine, it follows the config."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from lorakit import dist as dist_mod
from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.config import dump_yaml
from lorakit.dtypes import torch_dtype
from lorakit.errors import InputError
from lorakit.hardware.gpu import apply_cap, expandable_segments
from lorakit.hardware.sdpa import apply as apply_attention
from lorakit.io import atomic_path, clean_orphans
from lorakit.io.lock import FolderLock
from lorakit.models.base import load_adapter
from lorakit.plan.resolve import Resolved
from lorakit.train import checkpoint, sampling
from lorakit.train.data import CachedData
from lorakit.train.prepare import load_base
from lorakit.train.report import (
    MetricsLog,
    Notes,
    Timeline,
    doctor_summary,
    loss_curve,
    peak_rss_gib,
    start_wandb,
)


@dataclass
class Run:
    """What `setup` built, for `steps` and `finish`."""

    resolved: Resolved
    trainer: object  # train.trainer.Trainer
    data: CachedData
    log: MetricsLog
    sampler: object | None  # train.sampling.Sampler
    cache: object  # cache.builder.Summary
    dist: dist_mod.Dist
    note: Notes
    mark: Timeline
    progress: object | None
    resumed: dict | None = None
    stop: checkpoint.StopFlag = field(default_factory=checkpoint.StopFlag)
    started: float = 0.0


def run(resolved: Resolved, resume: str | None = None, progress=None, stop_at: int | None = None,
        warn=None) -> dict:
    """Train per a resolved config: cache (reused when built), LoRA, steps, checkpoints, metrics, samples.

    Args:
        resume: "latest" (the newest checkpoint that reads back whole) or a checkpoint folder.
        progress: called as progress(step, total, record) with each step's record ({"start": True, ...} first).
        stop_at: stop after this many steps (tests of interruption); the run's schedule is unchanged.
        warn: called with each warning as it happens (they are also in the result's "warnings").
    """
    with _holding(resolved.cfg.output.dir, warn):  # one run per output folder
        r = setup(resolved, resume, progress, warn)
        with checkpoint.stop_on_signals(r.stop):
            try:
                steps(r, resolved.cfg.schedule.steps if stop_at is None else min(stop_at, resolved.cfg.schedule.steps))
            finally:
                r.log.close()
        return finish(r)


@contextlib.contextmanager
def _holding(out, warn):
    """The output folder, locked by rank 0 for the whole run (a second run there is refused, naming this one)."""
    if int(os.environ.get("RANK", "0") or 0):
        yield
        return
    with FolderLock(out, "training run", hint="wait for it to finish, or give this run another output.dir") as lock:
        if lock.unsupported and warn:
            warn(lock.unsupported)
        yield


def setup(resolved: Resolved, resume: str | None, progress, warn) -> Run:
    import torch

    from lorakit.train.trainer import Trainer

    cfg, note, mark = resolved.cfg, Notes(warn), Timeline()  # the timeline: seconds since the run began, by phase
    device = resolved.device
    apply_cap(device)  # LORAKIT_MEMORY_CAP_GIB: a smaller card, emulated
    if device.startswith("cuda") and cfg.memory.expandable_segments:
        expandable_segments()
    d = dist_mod.init(device)
    device = d.device(device)
    dtype = torch_dtype(cfg.model.dtype)
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    wandb_run = start_wandb(cfg, out, bool(resume)) if cfg.logging.wandb and d.main else None  # fails in seconds
    if d.main:
        for n in resolved.notes:
            note(n)
        gone = clean_orphans(out, recursive=True) + clean_orphans(cache_dir_for(cfg) / "items")
        if gone:  # a run killed mid-write leaves its temporary files; the finished files are whole
            note(f"removed {len(gone)} temporary file(s) an interrupted run left, e.g. {gone[0].name}")
        with atomic_path(out / "config.resolved.yaml") as tmp:
            tmp.write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.seed)
    adapter = load_adapter(cfg.model.family, cfg.model.path, device=device, dtype=dtype, backend=cfg.memory.loader)
    cache = build(cfg, device, adapter=adapter, dist=d)  # the ranks encode a share of the items each
    mark("cached")
    store = Store(cache_dir_for(cfg))
    data = CachedData(store, store.read_manifest(), cfg.schedule.batch_size * d.world, cfg.seed, cfg.data.repeats,
                      hold_out=cfg.validation.items, in_memory=cfg.memory.cache_in_memory,
                      datasets=cfg.data.all_datasets(), prior_ratio=cfg.data.prior_ratio)
    conds = sampling.conditions(cfg, adapter, data) if cfg.sampling.enabled else None  # encoded now, once
    if conds and cfg.memory.free_encoders_after_cache:
        adapter.unload(list(adapter.text_parts))
    attention = cfg.memory.attention if device.startswith("cuda") and cfg.memory.attention != "auto" else None
    apply_attention(attention, fallback=True)  # in force for the whole run: forward, backward, recompute
    if d.main:
        doctor_summary(out, cfg.profile, attention)
    tr = Trainer(cfg, adapter, load_base(cfg, device, dtype), data, out, device, dtype, dist=d)
    mark("model_ready")
    resumed = _resume(tr, out, resume, note) if resume else None
    if progress and d.main:
        progress(tr.step, cfg.schedule.steps, {"start": True, "global_batch": tr.global_batch, "world": d.world,
                                                "resumed": resumed, "compiled": tr.compiled})
    log = MetricsLog(out, tr.step if resume else None, main=d.main, warn=note, wandb_run=wandb_run)
    sampler = sampling.Sampler(tr, conds, out / "samples", warn=note) if conds and (d.main or tr.sharded) else None
    if sampler and tr.step == 0:  # FSDP: every rank takes part in the forward passes
        log.image("samples", sampler(0, write=d.main), 0)
        mark("first_samples")
    return Run(resolved, tr, data, log, sampler, cache, d, note, mark, progress, resumed,
               started=time.perf_counter())


def _resume(tr, out: Path, resume: str, note) -> dict:
    ck, damaged = checkpoint.latest(out, tr.full) if resume == "latest" else (Path(resume), [])
    for w in damaged:
        note(w)
    if ck is None:
        raise InputError(f"--resume latest: no intact checkpoint in {out / 'checkpoints'}",
                         "start without --resume" + (" (the checkpoints there are damaged)" if damaged else ""))
    return tr.resume(ck)


def steps(r: Run, end: int) -> None:
    """Optimizer steps until `end`, a stop request (signal), or early stopping."""
    import torch

    tr, cfg, d = r.trainer, r.resolved.cfg, r.dist
    cuda = tr.device.startswith("cuda")
    while tr.step < end and not r.stop.requested:
        t0 = time.perf_counter()
        rec = {"step": None, "loss": tr.train_step()}
        rec.update(step=tr.step, lr=tr.sched.get_last_lr()[0], s_per_step=round(time.perf_counter() - t0, 4),
                   time=round(time.time(), 3))
        r.mark("first_step")
        if cuda:
            rec["gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        every = cfg.validation.every
        if r.data.validation and ((every and tr.step % every == 0) or tr.step == cfg.schedule.steps):
            rec["val_loss"] = tr.eval_loss([it["key"] for it in r.data.validation])
            if tr.best and tr.best.offer(tr.step, rec["val_loss"]):
                rec["best"] = True
                tr.save(name="best")
        r.log.write(rec)
        if r.progress and d.main:
            r.progress(tr.step, cfg.schedule.steps, rec)
        if r.sampler and cfg.sampling.every and tr.step % cfg.sampling.every == 0:
            r.log.image("samples", r.sampler(tr.step, write=d.main), tr.step)
        if cfg.output.save_every and tr.step % cfg.output.save_every == 0:
            tr.save()
        r.stop.requested = d.total(float(r.stop.requested)) > 0  # a signal to any rank stops them all
        if tr.best and tr.best.stop:
            break


def finish(r: Run) -> dict:
    """The final samples, checkpoint and exported result; the run's summary."""
    import torch

    tr, cfg, d, out = r.trainer, r.resolved.cfg, r.dist, r.trainer.out
    early = bool(tr.best and tr.best.stop)  # validation.patience: no new best in that many checks
    interrupted = tr.step < cfg.schedule.steps and not early  # a signal after the last step still gets the LoRA
    if r.sampler and not interrupted and not (cfg.sampling.every and tr.step % cfg.sampling.every == 0):
        r.log.image("samples", r.sampler(tr.step, write=d.main), tr.step)
    ck = tr.save(final=not interrupted)
    result = {"steps": tr.step, "interrupted": interrupted, "checkpoint": str(ck), "metrics": str(r.log.path),
              "seconds": round(time.perf_counter() - r.started, 2), "cache": r.cache.to_dict(),
              "profile": r.resolved.profile, "memory_estimate": r.resolved.estimate,
              "memory_note": r.resolved.memory_note, "method": cfg.method, "processes": d.world,
              "global_batch": tr.global_batch, "rank": d.rank, "warnings": list(r.note), "timeline": dict(r.mark),
              "peak_rss_gib": peak_rss_gib(),
              "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if tr.device != "cpu" else None}
    if r.resumed:
        result["resumed"] = r.resumed
    if r.sampler and d.main and (out / "samples" / "progress.png").is_file():
        result["samples"] = str(out / "samples" / "progress.png")
    best_ck = out / "checkpoints" / "best"
    if tr.best and tr.best.step is not None:
        result["best"] = {**tr.best.report(), "checkpoint": str(best_ck)}
        if r.sampler and tr.best.step != tr.step and not tr.full:  # the best step's samples beside the others
            with checkpoint.weights_of(tr, best_ck):
                result["best"]["samples"] = str(r.sampler(tr.best.step, write=d.main, name="best"))
    if early:
        result["early_stopped"] = {"at_step": tr.step, "patience": cfg.validation.patience,
                                   "why": f"no val_loss better than step {tr.best.step}'s in "
                                          f"{cfg.validation.patience} checks; the LoRA is step {tr.best.step}'s"}
    if not interrupted and d.main:
        result.update(checkpoint.export(tr, best_ck if early else ck), consumer_check=tr.last_check)
        result["loss_curve"] = str(loss_curve(r.log.path, out / "loss_curve.png"))
    r.log.finish({k: result[k] for k in ("steps", "seconds", "peak_gpu_gib") if k in result}
                 | ({"best_step": result["best"]["step"]} if "best" in result else {}))
    d.barrier()
    return result
