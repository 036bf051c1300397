"""Building a training run: the output folder held, the cache built (reused), the data, the sample prompts, the
model in its storage with what trains, the state resumed — each phase timed for the person waiting (`Events`)."""

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
from lorakit.errors import ConfigError
from lorakit.events import Events
from lorakit.hardware.attention import Measuring
from lorakit.hardware.gpu import apply_cap, budget_gib, compile_workers, run_environment
from lorakit.hardware.sdpa import apply as apply_attention
from lorakit.io import atomic_path, clean_orphans
from lorakit.io.lock import FolderLock
from lorakit.io.modules import load_facts
from lorakit.models.base import load_adapter
from lorakit.plan import disk
from lorakit.plan.decide import choice_from
from lorakit.plan.resolve import Resolved
from lorakit.train import checkpoint, dims, first_grid, precompile, sampling, stop, warm
from lorakit.train import resume as resume_mod
from lorakit.train.data import CachedData
from lorakit.train.prepare import load_base
from lorakit.train.report import MetricsLog, Notes, Timeline, doctor_summary, start_wandb


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
    events: Events
    resumed: dict | None = None
    stop: stop.StopFlag = field(default_factory=stop.StopFlag)
    started: float = 0.0
    initial: object | None = None  # the trained weights before step 1, for the step-0 sample grid after it
    said: set = field(default_factory=set)  # warnings said once per run
    said_grid_s: float | None = None  # how long the last sample grid took
    said_grid_how: str | None = None  # its blocks "uncompiled" or "compiling" during it (None: compiled already)
    warm_key: str | None = None  # what the compiled graphs depend on (`train.warm`); None: blocks not compiled
    sizes: set = field(default_factory=set)  # the bucket shapes the run trains on
    peak: object | None = None  # train.allocwatch.PeakWatch: the GPU memory peaks, from the first step on
    pace: object | None = None  # train.pace.Pace: whether the host or the GPU set the steps' pace
    compiled_from: int | None = None  # the first step whose blocks all ran compiled (None: they never did)


@contextlib.contextmanager
def hold_output(out, events: Events):
    """The output folder, locked by rank 0 for the whole run (a second run there is refused, naming this one)."""
    if int(os.environ.get("RANK", "0") or 0):
        yield
        return
    with FolderLock(out, "training run", hint="wait for it to finish, or give this run another output.dir") as lock:
        if lock.unsupported:
            events.warn(lock.unsupported)
        yield


def setup(resolved: Resolved, resume: str | None, events: Events, force: bool = False) -> Run:
    import torch

    from lorakit.train.trainer import Trainer

    cfg, note, mark = resolved.cfg, Notes(events.warn), Timeline()  # the timeline: seconds since the run began
    if cfg.model.expert == "both":  # `lorakit train` runs one phase per expert (cli/train.py); a run trains one
        raise ConfigError(["model.expert: both is two runs, one per expert, which `lorakit train CONFIG` makes"],
                          hint="run `lorakit train`, or one expert per run here: model.expert high or low")
    device = resolved.device
    apply_cap(device)  # LORAKIT_MEMORY_CAP_GIB: a smaller card, emulated
    run_environment(cfg.memory, device)  # the allocator's settings, the compile cache
    d = dist_mod.init(device)
    device = d.device(device)
    dtype = torch_dtype(cfg.model.dtype)
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    ck = None
    if d.main:  # a new run into an earlier run's folder: refused, or (--force) its results removed first
        over = resume_mod.check_fresh_start(out, cfg.output.name, resume, force)
        if over:
            resume_mod.clear_results(out, cfg.output.name)
            note(over)
    disk.check(cfg, out)  # a full fine-tune's checkpoints fit on this disk (every rank: each writes its shards there)
    if resume:  # found before anything loads: a wrong --resume costs seconds, not a cache build
        ck, found = resume_mod.find(out, resume, cfg.method == "full", checkpoint.latest)
        for n in found:
            note(n)
        if ck is None and d.main:  # --resume auto's first start: expected, not a warning
            events.info(f"--resume auto: no checkpoint in {out / 'checkpoints'} yet, starting fresh")
    # the first run here measures its attention backends from now on, in a thread, beside the encoders, the caching
    # and the load (FLUX.1-dev, one H200, 2026-11-29: begun after the caching, the run then waited 14.6 s for it)
    measuring = Measuring(cfg.model.family, device) if resolved.attention_deferred else None
    wandb_run = start_wandb(cfg, out, ck is not None) if cfg.logging.wandb and d.main else None  # fails in seconds
    if d.main:
        events.info(f"training {cfg.model.family} ({cfg.model.path}) for {cfg.schedule.steps} steps on {device}, "
                    f"profile {cfg.profile}, into {out}")
        for n in resolved.notes:
            note(n)
        # the cache's are swept by its build, under the cache's lock (a `lorakit cache` may be writing there now)
        gone = clean_orphans(out, recursive=True, skip=(cache_dir_for(cfg),))
        if gone:  # a run killed mid-write leaves its temporary files; the finished files are whole
            note(f"removed {len(gone)} temporary file(s) an interrupted run left, e.g. {gone[0].name}")
        with atomic_path(out / "config.resolved.yaml") as tmp:
            tmp.write_text(dump_yaml(cfg))
    # a first run with these settings here: the compile process(es) start now, their imports beside the caching
    early = precompile.wanted(cfg, device, d.world) and not warm.recorded(warm.warm_key(cfg, device))
    rehearsal = compile_process(cfg, device, d.world, resolved.estimate, events, build=False) if early else None
    if rehearsal is None:  # those started with the config's check (`precompile.start_early`) are not wanted
        precompile.drop_early()
    if compiles_at_step_one(cfg, device):
        compile_workers()  # their imports beside the caching and the model's load
    try:  # the compile process ends with a run that fails to start
        torch.manual_seed(cfg.seed)
        adapter = load_adapter(cfg.model.family, cfg.model.path, device=device, dtype=dtype,
                               backend=cfg.memory.loader)
        cache = build(cfg, device, adapter=adapter, dist=d, events=events)  # the ranks encode a share of the items
        mark("cached")
        store = Store(cache_dir_for(cfg))
        data = CachedData(store, store.read_manifest(), cfg.schedule.batch_size * d.world, cfg.seed,
                          cfg.data.repeats, hold_out=cfg.validation.items, in_memory=cfg.memory.cache_in_memory,
                          datasets=cfg.data.all_datasets(), prior_ratio=cfg.data.prior_ratio)
        conds = None
        if cfg.sampling.enabled:
            with events.phase("sample prompts"):  # encoded now, once
                conds = sampling.conditions(cfg, adapter, data)
        if conds and cfg.memory.free_encoders_after_cache:
            adapter.unload(list(adapter.text_parts))
        if not measuring:
            attention = cfg.memory.attention if device.startswith("cuda") else None
            # in force for the whole run: forward, backward, recompute ("auto" on a GPU: PyTorch picks per call)
            apply_attention(attention, fallback=True)
            if d.main:
                doctor_summary(out, cfg.profile, None if attention == "auto" else attention)
        key = warm.warm_key(cfg, device) if cfg.memory.compile else None
        sizes = set(warm.shapes(data, adapter)) if key else set()
        if key and cfg.memory.compile_background and warm.known(key, sizes):  # compiled here before: from the cache
            cfg = resolved.cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(
                update={"compile_background": False})})
            events.info(f"the blocks compile at step 1 and before step 2 from this machine's compile cache (a run "
                        f"with these settings compiled its {len(sizes)} bucket shape(s) here before), not in the "
                        "background")
            if d.main:
                with atomic_path(out / "config.resolved.yaml") as tmp:
                    tmp.write_text(dump_yaml(cfg))
        if rehearsal and not cfg.memory.compile_background:  # compiled here before after all
            rehearsal.close()
            rehearsal = None
        elif rehearsal:  # the caching is done: the copies are built now
            rehearsal.build(cfg, device)
        elif not early:
            rehearsal = compile_process(cfg, device, d.world, resolved.estimate, events)
        ahead = resolved.read_ahead  # the transformer's files, read into the page cache since the config was checked
        with events.phase("load model") as facts:
            t0 = time.perf_counter()
            base = load_base(cfg, device, dtype)
            facts.update(load_facts([base], time.perf_counter() - t0))
            mapped = device.startswith("cuda") and next(base.parameters()).device.type == "cpu"
            if mapped:
                del facts["gb_per_s"]  # 8-bit base or swapped blocks: mapped now, read while the model is prepared
                facts["mapped"] = "read while the model is prepared"
            elif ahead:
                facts.update(ahead.stop())
        with events.phase("prepare model") as facts:  # storage, LoRA, checkpointing, compiled blocks (at step 1)
            tr = Trainer(cfg, adapter, base, data, out, device, dtype, dist=d)
            facts.update(trainable=sum(p.numel() for p in tr.params), compiled=tr.compiled, buckets=data.shapes,
                         of_which=", ".join(f"{k} {v:.1f} s" for k, v in tr.took.items() if v >= 0.1) or None)
            if tr.swapper:
                facts["swapped"] = tr.swapper.said()
            if mapped and ahead:
                facts.update(ahead.stop())
        resolved.read_ahead = None
        del base
        varying, carried, packs = block_inputs(tr, events)
        if measuring:  # the first run here: the family's attention was measured beside the cache and the load
            cfg = tr.cfg = choose_attention(resolved, measuring, out, events, note)
            key = warm.warm_key(cfg, device) if key else None  # the compile depends on the backend chosen now
        mark("model_ready")
        resumed = tr.resume(ck) if ck else None
        if d.main:
            s = cfg.schedule
            events.info(f"global batch {tr.global_batch} = {s.batch_size} per process x {d.world} process(es) x "
                        f"{s.grad_accum} accumulation")
            if resolved.step and device.startswith("cuda"):  # with the attention measured at the start
                events.info(f"the step: {resolved.step}")
            if resumed:
                events.info(f"resumed at step {tr.step} (written by {resumed['from_world']} process(es))"
                            + (f"; {resumed['note']}" if resumed["note"] else ""))
        log = MetricsLog(out, tr.step if ck else None, main=d.main, warn=note, wandb_run=wandb_run)
        sampler = sampling.Sampler(tr, conds, out / "samples", warn=note) if conds and (d.main or tr.sharded) else None
        r = Run(resolved, tr, data, log, sampler, cache, d, note, mark, events, resumed, started=time.perf_counter(),
                warm_key=key, sizes=sizes)
        if sampler and tr.step == 0 and cfg.sampling.first:
            if tr.full:  # every weight trains: the grid before step 1 (FSDP: every rank takes part)
                render_samples(r, 0)
            else:  # the step-0 grid renders right after step 1 from these weights: it does not hold up the first step
                r.initial = checkpoint.snapshot(tr)
        if rehearsal and tr.background and tr.step < cfg.schedule.steps:
            rehearsal.go(tr, conds if sampler else None, varying, carried, packs)
            tr.background.ahead = rehearsal
            events.info(f"the blocks compile in {rehearsal.where} (a first run with these settings here): the "
                        "first steps run them uncompiled meanwhile, then they switch between two steps")
        elif rehearsal:
            rehearsal.close()
        return r
    except BaseException:
        if rehearsal:
            rehearsal.close()
        raise


def compiles_at_step_one(cfg, device: str) -> bool:
    """Does step 1 wait for the blocks' compile in this process (a GPU run whose blocks compile, not beside the
    first steps)? Its compile workers then start before the caching (`hardware.gpu.compile_workers`) instead of at
    the first compile, where the first kernels waited for their imports. Qwen-Image, rtx4090 profile, 24 GiB cap, a
    first run (one H200 each, 2026-12-01): step 1 compiled in 29.6 s with the workers started by it; 25.1 and
    32.5 s with them started early, on two hosts whose steady steps differed by a third (0.580 / 0.772 s)."""
    return device.startswith("cuda") and bool(cfg.memory.compile) and cfg.memory.compile_background is not True


def compile_process(cfg, device: str, world: int, est: dict | None, events: Events, build: bool = True):
    """A first run's compile process(es) (`train.precompile`), where the run wants them and the card has room; else
    None."""
    if not precompile.wanted(cfg, device, world):
        return None
    budget = budget_gib(device) if device.startswith("cuda") else None
    why = precompile.lacks_room(est, budget) if budget else None
    if why:
        events.info(f"the blocks compile in the background in this process: {why}")
        return None
    return precompile.Rehearsal(cfg, device, precompile.kinds_apart(cfg, device, est, budget, world), build=build)


def block_inputs(tr, events: Events) -> tuple[dict, dict, dict]:
    """The blocks' input sizes that vary over the run's data (its bucket shapes, text lengths), symbolic in their
    compiled graphs from the first compile, the inputs each block carries on to the next, with gradients in the
    first block too, and those a kind's first call gets apart where the later ones get slices of one tensor
    (`train.dims`): (varying, carried, packs). Not under FSDP. With CUDA graphs as without: one compiled graph
    serves every shape, and each shape records its own CUDA graphs from it."""
    batches = warm.variants(tr) if tr.compiled and not tr.sharded and tr.data is not None else []
    if not batches:
        return {}, {}, {}
    carried: dict = {}
    packs: dict = {}
    with events.phase("sizes that vary" if len(batches) > 1 else "the blocks' inputs") as facts:
        found = dims.varying(tr, batches, carried, packs)  # one shape: the graphs stay specialised to it
        dims.install(tr.transformer, found, carried, packs)
        if len(batches) > 1:
            facts["symbolic"] = dims.said(found) or "none"
        facts["with_grad"] = dims.said_carried(carried) or "none"
        if packs:
            facts["packed"] = dims.said_packs(packs)
    return found, carried, packs


def choose_attention(resolved: Resolved, measuring: Measuring, out: Path, events: Events, note):
    """The backend chosen from the measurement begun as the run started, put in force for the whole run, and
    written into config.resolved.yaml (the config a dry run shows). Returns the run's config."""
    with events.phase("attention self-test (first run here; measured while the run started)") as facts:
        choice = choice_from(measuring.result(), resolved.cfg, resolved.device, note)
        facts.update(attention=choice, measured_s=round(time.perf_counter() - measuring.started, 1))
    m = resolved.cfg.memory
    resolved.cfg = resolved.cfg.model_copy(update={"memory": m.model_copy(update={"attention": choice})})
    resolved.attention_deferred = False
    apply_attention(choice, fallback=True)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        with atomic_path(out / "config.resolved.yaml") as tmp:
            tmp.write_text(dump_yaml(resolved.cfg))
        doctor_summary(out, resolved.cfg.profile, None if choice == "auto" else choice)
    return resolved.cfg


# what made the last grid slower than the next one will be (Qwen-Image 1024², one H200, 2026-11-30: the step-0 grid
# 39.0 s with its blocks uncompiled beside the compile process, the last one 27.3 s compiled)
GRID_HOW = {"uncompiled": ", whose blocks ran uncompiled", "compiling": ", which also compiled its blocks' graphs"}


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (a new one: a step or a grid that waited for the
    compiler, or took its graphs from the compile cache)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def render_samples(r: Run, step: int, name: str | None = None):
    """A sample grid, said before it starts (what it renders, and how long the last one took) and timed. The
    step-0 grid of one process is taken from an earlier run's where its inputs are the same (`train.first_grid`)."""
    s = r.resolved.cfg.sampling
    n, took = len(r.sampler.conds), r.said_grid_s
    grid_key = first_grid.key(r) if step == 0 and name is None and r.dist.world == 1 else None
    kept = first_grid.cached(grid_key) if grid_key else None
    if kept:
        with r.events.phase("samples (step 0)") as facts:
            path = r.sampler.reuse(0, kept)
            facts.update(grid=str(path), reused=f"an earlier run's here, from the same model files, prompts, seeds "
                                                f"and settings: {kept}")
    else:
        r.events.info(f"samples (step {step}): {n} image(s) x {s.steps} steps"
                      + (f", about {took:.0f} s as the last grid{GRID_HOW.get(r.said_grid_how, '')}" if took else "")
                      + (" — the untrained LoRA, to compare with (sampling.first: false skips it)" if step == 0
                         else ""))
        bg = r.trainer.background
        eager, graphs, t0 = bg.eager_calls if bg else 0, compiled_graphs(), time.perf_counter()
        beside = bg.rendering() if bg and r.dist.world == 1 else contextlib.nullcontext()  # graphs taken meanwhile
        with r.events.phase(f"samples (step {step})") as facts, beside:
            path = r.sampler(step, write=r.dist.main, name=name)
            facts["grid"] = str(path) if path else None
        r.said_grid_s = time.perf_counter() - t0
        r.said_grid_how = "uncompiled" if bg and bg.eager_calls > eager else \
            "compiling" if compiled_graphs() > graphs else None
        if grid_key and path:
            first_grid.keep(grid_key, path)
    r.log.image("samples", path, step)
    r.mark("first_samples")
    return path
