"""A training run, read top down: `setup` builds everything (cache, data, sampler, model, state: train/setup.py),
`steps` runs the optimizer steps with their logging, samples, checkpoints and validation, `finish` saves the result
and says what was done. The run's config arrives resolved (`lorakit.plan.resolve`): this module decides nothing
about the machine, it follows the config."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

from lorakit.convert.verify import consumer_note
from lorakit.events import PHASES, Events, Recorded
from lorakit.plan.resolve import Resolved
from lorakit.train import checkpoint, shards, stop, warm
from lorakit.train.allocwatch import AllocWatch, PeakWatch
from lorakit.train.compile_news import news
from lorakit.train.gcpause import Collector
from lorakit.train.pace import Pace, hints
from lorakit.train.report import loss_curve, peak_rss_gib
from lorakit.train.setup import Run, compiled_graphs, hold_output, render_samples, setup


def run(resolved: Resolved, resume: str | None = None, stop_at: int | None = None,
        events: Events | None = None, force: bool = False) -> dict:
    """Train per a resolved config: cache (reused when built), LoRA, steps, checkpoints, metrics, samples.

    Args:
        resume: "latest" (the newest checkpoint that reads back whole), "auto" (the same, or a fresh start when
            there is none) or a checkpoint folder.
        stop_at: stop after this many steps (tests of interruption); the run's schedule is unchanged.
        events: hears each phase with its duration, each step and each warning (warnings are also in the
            result's "warnings").
        force: start over in an output folder that holds an earlier run (refused otherwise: `resume.check_fresh_start`).
    """
    events = events or Events()
    if not int(os.environ.get("RANK", "0") or 0):  # the phases as they happen, for the dashboard's run page
        events = Recorded(events, Path(resolved.cfg.output.dir) / PHASES)
    with hold_output(resolved.cfg.output.dir, events):  # one run per output folder
        r = setup(resolved, resume, events, force)
        try:
            with stop.stop_on_signals(r.stop):
                try:
                    steps(r, resolved.cfg.schedule.steps if stop_at is None
                          else min(stop_at, resolved.cfg.schedule.steps))
                finally:
                    r.log.close()
            return finish(r)
        finally:  # a compile still running in the worker thread ends first (a process leaving it aborts)
            if r.trainer.background:
                r.trainer.background.close()
            r.dist.close()


def steps(r: Run, end: int) -> None:
    """Optimizer steps until `end`, a stop request (signal), or early stopping."""
    tr, cfg, d = r.trainer, r.resolved.cfg, r.dist
    cuda = tr.device.startswith("cuda")
    first = tr.step + 1
    bg = tr.background  # the blocks compile in a worker thread while the first steps run them eager
    bg_settled = False
    heard = []  # what the worker finished, said when nothing is left to it
    opening = f"step {first}" + (" (the blocks compile in the background)" if bg else
                                 " (compiling the blocks)" if tr.compiled else "")
    if tr.step < end:  # the first step waits for the compiler (compiled blocks) and the first kernels
        r.events.phase_start(opening)
    alloc = AllocWatch(cuda)  # what the allocator asked of the driver, per step (train/allocwatch.py)
    peak = r.peak = PeakWatch(cuda)  # the GPU memory peak of each step, compile and grid, and the run's
    last = time.perf_counter()  # when the previous step's record was written (the loop's start for the first)
    # a signal before the first step stops every rank before it (the loop tests only what all agreed); `ready`: no
    ready = r.stop.share(d, not bg or bg.lets_others_load)  # rank holds up a load (all take the graphs at one step)
    pace = r.pace = Pace(cuda and d.main and not tr.swapper,  # who sets the pace (train/pace.py; swapped blocks:
                         hints(cfg, tr.device, (r.resolved.step_inputs or {}).get("graphs_possible")))  # not judged)
    with Collector() as collector:  # full collections timed per step; what the run keeps, frozen (train/gcpause.py)
        while tr.step < end and not r.stop.agreed:
            if bg:  # where the separate process compiled them all, the graphs are taken from the cache here
                load = bg.loads_now and (ready or not d.enabled)  # a rank alone would hold the others up twice
                if load:  # the process's end is said first, then the phase that takes its graphs
                    heard = news(bg, heard, tr.step + 1, r.events.info, r.note)
                with r.events.phase("the compiled blocks from the compile cache") if load else nullcontext():
                    heard = news(bg, heard + bg.advance(load), tr.step + 1, r.events.info, r.note)
            alloc.take()  # what samples, checkpoints or validation asked between steps is not the step's
            peak.take()  # nor is their memory (it counts in the run's peak)
            t0 = time.perf_counter()
            graphs = own_graphs(bg) if tr.compiled else 0
            rec = {"step": None, "loss": tr.train_step()}
            rec.update(step=tr.step, lr=tr.sched.get_last_lr()[0], step_s=round(time.perf_counter() - t0, 4),
                       time=round(time.time(), 3), size=tr.last_size, wait_s=round(tr.wait_s, 4))  # size: the
            # step's bucket, WxH; step_s: train_step() alone; time: when the step ended (before any sample grid or
            # compile phase after it); wait_s: of step_s, the host's wait for the GPU (train/pace.py)
            if bg and bg.eager_calls:  # not yet compiled: a step of its own kind (benchmarks leave it out)
                rec["eager_blocks"] = bg.eager_calls
            pause = collector.take()
            if pause >= 0.001:
                rec["gc_s"] = round(pause, 3)
            rec.update(alloc.take())
            if cuda:
                rec["step_gpu_gib"] = peak.take()  # the step's own peak (validation's, a best checkpoint's: the run's)
            settle = False
            if tr.step == first:  # how long the first step took (compiling, the first kernels' warm-up)
                r.events.phase_end(opening, rec["step_s"], {"size": tr.last_size})
                settle = True
                if tr.compiled and not bg:  # compiled in the step itself
                    r.compiled_from = first
            elif tr.compiled and own_graphs(bg) > graphs:  # this step waited for the compiler (a new shape)
                r.events.phase_end("compile", rec["step_s"], {"step": tr.step, "size": tr.last_size})
                settle = True
            if bg and not bg_settled and not bg.pending and not bg.eager_calls and tr.step > first:
                settle = bg_settled = True  # the background compile's graphs are in use
                r.compiled_from = tr.step
                if r.warm_key and not bg.failed:  # every shape compiled: the next run with these settings starts steady
                    warm.remember(r.warm_key, r.sizes)
            r.mark("first_step")
            every = cfg.validation.every
            if r.data.validation and ((every and tr.step % every == 0) or tr.step == cfg.schedule.steps):
                rec["val_loss"] = tr.eval_loss([it["key"] for it in r.data.validation])
                if tr.best and tr.best.offer(tr.step, rec["val_loss"]):
                    rec["best"] = True
                    with r.events.phase(f"best checkpoint (step {tr.step})"):
                        save(r, name="best")
            grid_s = 0.0
            if tr.step == first and tr.compiled and r.sizes:  # the other bucket shapes, before the run meets them
                grid_s += warm_other_shapes(r)
                if cuda:
                    rec["compile_gpu_gib"] = peak.take()
            if r.initial is not None:  # the step-0 grid, from the weights before step 1 (logged before step 1's record:
                t1 = time.perf_counter()  # W&B takes steps in order); a phase of its own, timed and said apart
                with checkpoint.weights_in(tr, r.initial):
                    render_samples(r, 0)
                r.initial = None
                grid_s += time.perf_counter() - t1
                if cuda:
                    rec["grid_gpu_gib"] = peak.take()
            if settle:  # what exists now stays for the run, the other shapes' graphs and the grid's too: out of the
                collector.settle()  # collector's way (frozen before them, they were walked every ~8 steps: FLUX rtx4090)
            if cuda:
                rec["gpu_gib"] = peak.whole()  # the run's peak so far (validation's and the like too)
            now = time.perf_counter()  # s_per_step: the wall time since the previous record — what the clock shows,
            rec["s_per_step"] = round(now - last - grid_s, 4)  # stalls included
            last = now
            r.log.write(rec)
            if d.main:
                r.events.step(tr.step, cfg.schedule.steps, rec)
            said = pace.take(rec, steady=not settle and tr.step > first and "eager_blocks" not in rec)
            if said:
                r.events.info(said)
            if r.sampler and cfg.sampling.every and tr.step % cfg.sampling.every == 0:
                render_samples(r, tr.step)
                collector.settle()  # what the grid left for the run (its graphs), frozen with the rest
            checkpoint.poll(tr)  # a background checkpoint whose shards are written counts from now
            if cfg.output.save_every and tr.step % cfg.output.save_every == 0:
                with r.events.phase(f"checkpoint (step {tr.step})"):
                    save(r, background=True)
            ready = r.stop.share(d, not bg or bg.lets_others_load)  # a signal to any rank stops them all
            if tr.best and tr.best.stop:
                break


def save(r: Run, **kw):
    """A checkpoint (`Trainer.save`); a LoRA file that a consumer reads only in part (ComfyUI and FLUX.2's shared
    modulation under diffusers names) is said in the run's output, once per run, with the command that writes a
    file it reads whole; so are background checkpoints whose buffers could not be page-locked."""
    ck = r.trainer.save(**kw)
    for key, said in (("consumer", consumer_note(ck / "lora.safetensors", r.trainer.last_check)),
                      ("pinning", shards.refused_note(r.trainer))):  # each said once per run
        if said and key not in r.said:
            r.said.add(key)
            r.note(said)
    return ck


def warm_other_shapes(r: Run) -> float:
    """After step 1: every other bucket shape compiled now (a phase of its own) or handed to the background
    compile (`train.warm`); where the blocks compiled in the run, the shapes are remembered for the next run.
    Returns the seconds it took."""
    tr = r.trainer
    t0 = time.perf_counter()
    todo = warm.to_warm(tr, {tr.last_size})
    if todo and tr.background and tr.background.ahead:  # its rehearsal has them: met compiled (symbolic), not here
        r.events.info(f"{len(todo)} more shape(s) compiled by the separate process: {', '.join(dict(todo))}")
    elif todo and tr.background:
        done = warm.warm_shapes(tr, todo)
        r.events.info(f"{len(done)} more shape(s) handed to the background compile before the run meets them: "
                      f"{', '.join(done)}")
    elif todo:
        shapes = sum(1 for label, _ in todo if label in r.sizes)
        what = f"{shapes} more bucket shape(s)" if shapes else "other text lengths"
        with r.events.phase(f"compile {what}") as facts:
            before = compiled_graphs()
            facts["sizes"] = ", ".join(warm.warm_shapes(tr, todo))
            facts["new_graphs"] = compiled_graphs() - before  # none where their sizes were symbolic (train.dims)
    if r.warm_key and not tr.background:
        warm.remember(r.warm_key, r.sizes)
    return time.perf_counter() - t0


def own_graphs(bg) -> int:
    """Graphs the run compiled itself (those of the background worker held up no step)."""
    return bg.own_graphs() if bg else compiled_graphs()


def finish(r: Run) -> dict:
    """The final samples, checkpoint and exported result; the run's summary."""
    tr, cfg, d, out = r.trainer, r.resolved.cfg, r.dist, r.trainer.out
    if tr.background and tr.background.running:  # its compile in progress ends first: the saves then run alone
        with r.events.phase("background compile (the one in progress finishes)"):
            tr.background.close()
    early = bool(tr.best and tr.best.stop)  # validation.patience: no new best in that many checks
    interrupted = tr.step < cfg.schedule.steps and not early  # a signal after the last step still gets the LoRA
    if r.initial is not None:  # stopped before any step: the step-0 grid all the same
        render_samples(r, 0)
    if r.sampler and not interrupted and not (cfg.sampling.every and tr.step % cfg.sampling.every == 0):
        render_samples(r, tr.step)
    with r.events.phase(f"{'checkpoint' if interrupted else 'final checkpoint'} (step {tr.step})") as facts:
        ck = save(r, final=not interrupted)
        checkpoint.release(tr)
        facts["of_which"] = ", ".join(f"{k} {v:.1f} s" for k, v in tr.save_took.items()) or None  # every part
    result = {"steps": tr.step, "interrupted": interrupted, "checkpoint": str(ck), "metrics": str(r.log.path),
              "seconds": round(time.perf_counter() - r.started, 2), "cache": r.cache.to_dict(),
              "profile": r.resolved.profile, "memory_estimate": r.resolved.estimate,
              "memory_note": r.resolved.memory_note, "method": cfg.method, "processes": d.world,
              "global_batch": tr.global_batch, "rank": d.rank, "warnings": list(r.note), "timeline": dict(r.mark),
              "peak_rss_gib": peak_rss_gib(), "compiled_from": r.compiled_from, "pace": r.pace and r.pace.facts(),
              "peak_gpu_gib": (r.peak or PeakWatch(True)).whole() if tr.device != "cpu" else None}
    if d.enabled:  # every rank's peaks, in rank order, beside the plan's per-GPU estimate (collective: all ranks)
        result["per_rank"] = d.gathered({k: result[k] for k in ("peak_gpu_gib", "peak_rss_gib", "compiled_from")})
    if tr.staging_wait_s:  # the steps that waited for a background save's copy of the weights
        result["staging_wait_s"] = round(tr.staging_wait_s, 2)
    if r.resumed:
        result["resumed"] = r.resumed
    if r.sampler and d.main and (out / "samples" / "progress.png").is_file():
        result["samples"] = str(out / "samples" / "progress.png")
    best_ck = out / "checkpoints" / "best"
    if tr.best and tr.best.step is not None:
        result["best"] = {**tr.best.report(), "checkpoint": str(best_ck)}
        if r.sampler and tr.best.step != tr.step and not tr.full:  # the best step's samples beside the others
            with checkpoint.weights_of(tr, best_ck):
                result["best"]["samples"] = str(render_samples(r, tr.best.step, name="best"))
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
