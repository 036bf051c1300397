"""The training loop: one loop for every family; family specifics live in the adapters.

Every random draw of a step (sigmas, noise, caption dropout) comes from a generator seeded by
(seed, step, micro-step), the batch order is a pure function of (seed, epoch), and LoRA dropout's global
RNG state is saved with each checkpoint — so a resumed run repeats the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

from lorakit.errors import InputError, NotAvailableError
from lorakit.models.registry import family_info
from lorakit.train import dist as dist_mod
from lorakit.train import flow_matching as fm
from lorakit.train.optim import lr_lambda, make_optimizer

PREDICTS = ("flux", "qwen_image", "kandinsky5")  # families whose forward convention is implemented and tested


class Trainer:
    """Holds the run's state; `train(until)` advances it, `save`/`resume` persist it."""

    def __init__(self, cfg, adapter, transformer, data, out_dir: Path, device: str, dtype, dist=None):
        import torch

        from lorakit.train.lora import add_lora

        self.cfg, self.adapter, self.data, self.out = cfg, adapter, data, out_dir
        self.device, self.dtype = device, dtype
        self.dist = dist or dist_mod.Dist()
        self.full = cfg.method == "full"
        self.info = family_info(cfg.model.family)
        if self.info.module not in PREDICTS:
            raise NotAvailableError(f"training {cfg.model.family} is not in this build yet (tracked as issue #6)",
                                    "FLUX and Qwen-Image(-Edit/-Plus) train today")
        if self.full and cfg.memory.blocks_to_swap:
            raise InputError("method=full trains every weight: memory.blocks_to_swap (frozen weights kept on the "
                             "host) does not apply", "--set memory.blocks_to_swap=0, or use --gpus N (FSDP)")
        if self.full and cfg.memory.base_quant != "none":
            raise InputError(f"method=full trains every weight: memory.base_quant={cfg.memory.base_quant} "
                             "(a frozen 8-bit base) does not apply", "--set memory.base_quant=none")
        self.transformer = transformer
        self.quantized = 0
        if cfg.memory.base_quant in ("fp8", "qfloat8"):
            from lorakit.train.quant import quantize_blocks

            self.quantized = quantize_blocks(transformer, dtype, device)
        if cfg.memory.base_quant == "nf4":
            if cfg.memory.blocks_to_swap:
                raise InputError("memory.base_quant=nf4 with memory.blocks_to_swap is not supported (the 4-bit "
                                 "weights keep their quantization state on the GPU)",
                                 "use base_quant=fp8 with block swapping, or nf4 without it")
            from lorakit.train.quant import quantize_blocks_nf4

            self.quantized = quantize_blocks_nf4(transformer, dtype, device)
        self.sharded = self.full and self.dist.enabled
        self.swapper = None
        if cfg.memory.blocks_to_swap and not self.sharded:
            from lorakit.train.swap import BlockSwapper

            self.swapper = BlockSwapper(transformer, cfg.memory.blocks_to_swap, device, pin=cfg.memory.pin_memory)
            self.swapper.place_rest(transformer)
        elif not self.sharded:
            transformer.to(device)  # what was not quantized (loaded to the CPU for an 8-bit base)
        if self.full:
            self.peft_config = None
            transformer.requires_grad_(True)
        else:
            self.peft_config = add_lora(transformer, self.info.module, cfg)
        if cfg.memory.gradient_checkpointing or self.swapper:  # swapping needs the recompute
            transformer.enable_gradient_checkpointing()
        if self.sharded:  # FSDP: each block's weights, grads and optimizer states split over the ranks
            _fully_shard(transformer, device)
        self.compiled = bool(cfg.memory.compile and device.startswith("cuda") and not self.sharded
                             and not self.swapper and getattr(transformer, "_repeated_blocks", None))
        if self.compiled:  # regional: each repeated block once (seconds, not minutes), shapes per bucket
            transformer.compile_repeated_blocks()
        transformer.train()
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        if not self.full:
            for p in self.params:  # LoRA weights train in fp32 whatever the base dtype, on the GPU (peft puts
                p.data = p.data.to(device, torch.float32)  # those of swapped layers beside their host weights)
        self.opt = make_optimizer(self.params, cfg, device, full=self.full)
        # 8-bit (bitsandbytes) moments are saved per rank as they are, not gathered by parameter name
        self.per_rank_state = self.full and (getattr(self.opt, "local_shards", False)
                                             or type(self.opt).__module__.startswith("bitsandbytes"))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.step = 0
        sched_file = Path(cfg.model.path or ".") / "scheduler" / "scheduler_config.json"
        self.sched_cfg = json.loads(sched_file.read_text()) if cfg.model.path and sched_file.is_file() else {}
        self.stop_requested = False

    # -------------------------------------------------------------- one step

    def _gen(self, step: int, micro: int):
        import torch

        return torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step * 1009 + micro) % 2**63)

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
        per = ((v.float() - target.float()) ** 2).flatten(1).mean(1)
        w = fm.loss_weight(sigmas.to(self.device), self.cfg.schedule.loss_weighting).float()
        return (per * w).mean() if reduce == "mean" else (per * w).sum()

    def train_step(self) -> float:
        """One optimizer step over the global batch (this rank's share of it); returns the global loss."""
        import torch

        s, d = self.cfg.schedule, self.dist
        fsdp = d.world if self.sharded else 1  # FSDP averages gradients over ranks: each share is x world
        mine = 0.0
        for micro in range(s.grad_accum):
            g = self._gen(self.step, micro)
            keys = self.data.batch_at(self.step * s.grad_accum + micro)  # the global micro-batch
            n = len(keys)
            drop = (torch.rand(n, generator=g) < self.cfg.data.caption_dropout).tolist()
            idx = d.share(range(n))
            weight = 1.0
            if not idx:  # fewer items than ranks: run one with weight 0 (collectives stay in step)
                idx, weight = [0], 0.0
            batch = self.data.load([keys[i] for i in idx], [drop[i] for i in idx])
            seq = (batch.latents.shape[-1] // 2) * (batch.latents.shape[-2] // 2)
            sigmas = fm.sample_sigmas(n, s.timesteps, g, shift=s.shift, logit_mean=s.logit_mean,
                                      logit_std=s.logit_std, image_seq_len=seq, scheduler_config=self.sched_cfg)
            noise = torch.randn((n, *batch.latents.shape[1:]), generator=g)
            # this rank's share of the global mean
            loss = self.loss_on(batch, sigmas[idx], noise[idx], reduce="sum") * (weight * fsdp / (n * s.grad_accum))
            loss.backward()
            mine += float(loss.detach()) / fsdp
        if self.swapper:
            self.swapper.settle()
        total = d.total(mine)
        if not math.isfinite(total):
            raise InputError(f"the loss became {total} at step {self.step + 1}",
                             "lower optim.lr, or check memory.attention with `lorakit doctor`")
        if not self.sharded:
            d.sum_grads(self.params)
        if self.cfg.optim.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return total

    def eval_loss(self, keys: list[str], sigmas=(0.25, 0.5, 0.75), seed: int = 1234) -> float:
        """Loss on items at fixed sigmas and fixed noise (what overfitting should lower)."""
        import torch

        was = self.transformer.training
        self.transformer.eval()
        out = []
        with torch.no_grad():
            for k in keys:
                b = self.data.load([k])
                g = torch.Generator().manual_seed(seed)
                noise = torch.randn(b.latents.shape, generator=g)
                for s in sigmas:
                    out.append(float(self.loss_on(b, torch.tensor([s]), noise)))
        self.transformer.train(was)
        return sum(out) / len(out)

    # -------------------------------------------------------------- checkpoints

    def _full_state(self) -> tuple[dict, dict]:
        """Whole-model weights and optimizer state keyed by parameter name (gathered from the shards on
        rank 0 under FSDP), so a checkpoint resumes on any number of GPUs."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.transformer, options=opts)
        if self.per_rank_state:  # 8-bit moments of each rank's shard: saved per rank
            return weights, None
        return weights, get_optimizer_state_dict(self.transformer, self.opt, options=opts)

    def _rank_state_file(self, ck: Path) -> Path:
        return ck / f"optimizer-rank{self.dist.rank}-of-{self.dist.world}.pt"

    def save(self, final: bool = False) -> Path:
        """Write a checkpoint (rank 0; every rank takes part in gathering FSDP shards)."""
        import torch

        from lorakit.io import atomic_path
        from lorakit.train.lora import save_lora

        name = "final" if final else f"step-{self.step:06d}"
        ck = self.out / "checkpoints" / name
        if self.full:
            weights, opt_state = self._full_state()
            if opt_state is None:  # per-rank 8-bit optimizer state
                ck.mkdir(parents=True, exist_ok=True)
                with atomic_path(self._rank_state_file(ck)) as tmp:
                    torch.save(self.opt.state_dict(), tmp)
        if self.dist.main:
            ck.mkdir(parents=True, exist_ok=True)
            if self.full:
                _save_transformer(self.transformer, weights, ck / "transformer")
            else:
                save_lora(self.transformer, ck / "lora.safetensors", self.peft_config, {"lorakit_step": self.step})
                opt_state = self.opt.state_dict()
            state = {"step": self.step, "optimizer": opt_state, "scheduler": self.sched.state_dict(),
                     "torch_rng": torch.get_rng_state(), "world": self.dist.world,
                     "global_batch": self.global_batch}
            with atomic_path(ck / "state.pt") as tmp:
                torch.save(state, tmp)
            if not final:
                kept = sorted(p for p in (self.out / "checkpoints").glob("step-*") if p.is_dir())
                for old in kept[: -self.cfg.output.keep_last]:
                    import shutil

                    shutil.rmtree(old)
        self.dist.barrier()
        return ck

    @property
    def global_batch(self) -> int:
        s = self.cfg.schedule
        return s.batch_size * self.dist.world * s.grad_accum

    def resume(self, ck: Path) -> dict:
        """Continue from a checkpoint (written by any number of ranks). Returns what changed, if anything."""
        import torch

        from lorakit.train.lora import load_lora_into

        weights = ck / ("transformer" if self.full else "lora.safetensors")
        if not weights.exists() or not (ck / "state.pt").is_file():
            what = "transformer/ + state.pt" if self.full else "lora.safetensors + state.pt"
            raise InputError(f"{ck} is not a lorakit checkpoint of this method ({what})",
                             "method=full and method=lora checkpoints do not mix")
        state = torch.load(ck / "state.pt", weights_only=True)
        if self.full:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            from lorakit.io import load

            main = self.dist.main
            set_model_state_dict(self.transformer, load(weights) if main else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.sharded))
            if self.per_rank_state or state["optimizer"] is None:
                mine = self._rank_state_file(ck)
                if not (self.per_rank_state and mine.is_file()):
                    raise InputError(f"{ck} holds 8-bit optimizer states of {state.get('world', 1)} GPU(s) "
                                     f"(one file per GPU); this run has {self.dist.world} with "
                                     f"{type(self.opt).__name__}",
                                     f"resume with --gpus {state.get('world', 1)} and the same optim.name, or "
                                     "train with optim.name=adamw (its checkpoints resume on any GPU count)")
                self.opt.load_state_dict(torch.load(mine, weights_only=True))
            else:  # weights that never get a gradient (e.g. the last block's unused text output) have no state
                set_optimizer_state_dict(self.transformer, self.opt, state["optimizer"] if main else {},
                                         options=StateDictOptions(full_state_dict=True, strict=False,
                                                                  broadcast_from_rank0=self.sharded))
        else:
            load_lora_into(self.transformer, weights)
            self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])
        was = state.get("global_batch", self.global_batch)
        return {"from_world": state.get("world", 1), "from_global_batch": was,
                "note": None if was == self.global_batch else
                f"the checkpoint was written with a global batch of {was}, this run's is {self.global_batch}: "
                "the data order continues from the same batch index with the new batch size"}


def _fully_shard(transformer, device: str) -> None:
    """FSDP2 over the transformer: every repeated block its own unit, then the rest."""
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (td.get_world_size(),))
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    for m in list(transformer.modules()):
        if type(m).__name__ in names:
            fully_shard(m, mesh=mesh)
    fully_shard(transformer, mesh=mesh)


def _save_transformer(transformer, weights: dict, folder: Path) -> None:
    """A fully trained transformer in diffusers layout: config.json + (sharded) safetensors."""
    from lorakit.io import atomic_path
    from lorakit.io.writer import save_sharded

    cls = next(c for c in type(transformer).__mro__ if c.__module__.startswith("diffusers."))
    config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
    config["_class_name"] = cls.__name__
    try:
        import diffusers

        config["_diffusers_version"] = diffusers.__version__
    except ImportError:
        pass
    save_sharded({k: v.contiguous() for k, v in weights.items()}, folder)
    with atomic_path(folder / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True, default=list))


def _tensorboard(folder: Path):
    """A SummaryWriter when TensorBoard is installed (None otherwise: metrics.jsonl always exists)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder))


def check_memory(cfg, cap_gib: float | None = None, world: int = 1):
    """Fit the run to the GPU (detected, else the profile's card; `cap_gib` if given): gradient checkpointing
    turned on where it is needed, then the estimate checked (refused with suggestions when it cannot fit).

    Returns:
        (cfg, estimate or None for the cpu profile, note or None).
    """
    import torch

    from lorakit.hardware.profiles import load_profile
    from lorakit.train.memory import check, plan

    hw = load_profile(cfg.profile).hardware
    if not hw.get("gpu"):
        return cfg, None, None
    if cap_gib:
        budget = cap_gib
    elif torch.cuda.is_available():
        budget = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        budget = float(hw.get("memory_gib") or hw.get("min_memory_gib") or 0)
    cfg, note = plan(cfg, budget, world)
    return cfg, check(cfg, budget, world), note


def _expandable_segments() -> None:
    """memory.expandable_segments: the CUDA allocator grows segments instead of caching fixed blocks (less
    fragmentation; the dgx-spark profile's unified memory wants it). Set before the first allocation."""
    import os

    import torch

    if "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
            x for x in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True") if x)
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # older torch: the environment variable (read at CUDA start) holds
        pass


def latest_checkpoint(out_dir: Path) -> Path | None:
    cks = sorted(p for p in (out_dir / "checkpoints").glob("step-*") if (p / "state.pt").is_file())
    return cks[-1] if cks else None


def run(cfg, prov: dict, resume: str | None = None, progress=None, stop_at: int | None = None) -> dict:
    """Train per the config: cache (reused when built), LoRA, loop, checkpoints, metrics.

    Args:
        resume: "latest" or a checkpoint folder.
        stop_at: stop after this many steps (tests of interruption); the run's schedule is unchanged.
    """
    import torch

    from lorakit.cache.builder import build, cache_dir_for, device_and_dtype
    from lorakit.cache.store import Store
    from lorakit.config import dump_yaml
    from lorakit.io.modules import load_component
    from lorakit.models.base import load_adapter
    from lorakit.train.data import CachedData

    if cfg.model.path is None:
        from lorakit.errors import ConfigError

        raise ConfigError(["model.path: required to train"], hint="--set model.path=/models/FLUX.1-dev")
    device, dtype = device_and_dtype(cfg)
    if device.startswith("cuda") and cfg.memory.expandable_segments:
        _expandable_segments()
    d = dist_mod.init(device)
    device = d.device(device)
    cfg, memory, memory_note = check_memory(cfg, world=d.world)  # refuses before any weights load
    out = Path(cfg.output.dir)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.resolved.yaml").write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.seed)
    adapter = load_adapter(cfg.model.family, cfg.model.path, device=device, dtype=dtype, backend=cfg.memory.loader)
    cache = build(cfg, adapter=adapter, dist=d)  # the ranks encode a share of the items each
    store = Store(cache_dir_for(cfg))
    data = CachedData(store, store.read_manifest(), cfg.schedule.batch_size * d.world, cfg.seed, cfg.data.repeats,
                      hold_out=cfg.sampling.validation_items, in_memory=cfg.memory.cache_in_memory)
    conds = None
    if cfg.sampling.enabled:  # prompts encoded now: no text encoder is needed while training
        from lorakit.train.sampling import conditions

        conds = conditions(cfg, adapter, data)
        if cfg.memory.free_encoders_after_cache:
            adapter.unload(list(adapter.text_parts))
    choice = None
    if device.startswith("cuda"):
        from lorakit.hardware.attention import apply, self_test

        choice = cfg.memory.attention if cfg.memory.attention != "auto" else self_test(device).choice.get(
            cfg.model.family)
        apply(choice)
    if d.main:
        from lorakit.train.report import doctor_summary

        doctor_summary(out, cfg.profile, choice)
    # an 8-bit base is loaded to the CPU (mapped, no copy) and reaches the GPU layer by layer in 8 bits
    # and with block swapping, the swapped blocks' weights never visit the GPU outside their turn
    eight_bit = cfg.memory.base_quant in ("fp8", "qfloat8") and device != "cpu"
    to_cpu = device != "cpu" and (eight_bit or cfg.memory.base_quant == "nf4" or cfg.memory.blocks_to_swap)
    transformer = load_component(Path(cfg.model.path) / "transformer", "cpu" if to_cpu else device, dtype,
                                 cfg.memory.loader, unified_memory=cfg.memory.unified_memory)
    tr = Trainer(cfg, adapter, transformer, data, out, device, dtype, dist=d)
    resumed = None
    if resume:
        ck = latest_checkpoint(out) if resume == "latest" else Path(resume)
        if ck is None:
            raise InputError(f"--resume latest: no checkpoint in {out / 'checkpoints'}")
        resumed = tr.resume(ck)
    if progress and d.main:
        progress(tr.step, cfg.schedule.steps, {"start": True, "global_batch": tr.global_batch, "world": d.world,
                                                "resumed": resumed})
    metrics = out / "metrics.jsonl"
    if metrics.exists() and d.main:  # a fresh run starts a new file; a resumed one drops steps past its checkpoint
        kept = [ln for ln in metrics.read_text().splitlines() if ln.strip() and resume
                and json.loads(ln)["step"] <= tr.step]
        metrics.write_text("".join(ln + "\n" for ln in kept))
    old_handlers = {}

    def _stop(signum, frame):
        tr.stop_requested = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old_handlers[sig] = signal.signal(sig, _stop)
        except ValueError:  # not the main thread
            pass
    tb = _tensorboard(out / "tensorboard") if d.main else None
    sampler = None
    if conds and (d.main or tr.sharded):  # FSDP: every rank takes part in the forward passes
        from lorakit.train.sampling import Sampler

        sampler = Sampler(tr, conds, out / "samples")
        if tr.step == 0:
            sampler(0, write=d.main)
    losses = []
    t_start = time.perf_counter()
    end = cfg.schedule.steps if stop_at is None else min(stop_at, cfg.schedule.steps)
    try:
        while tr.step < end and not tr.stop_requested:
            t0 = time.perf_counter()
            loss = tr.train_step()
            losses.append(loss)
            rec = {"step": tr.step, "loss": loss, "lr": tr.sched.get_last_lr()[0],
                   "s_per_step": round(time.perf_counter() - t0, 4)}
            if device.startswith("cuda"):
                rec["gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            every = cfg.sampling.validation_every
            if data.validation and ((every and tr.step % every == 0) or tr.step == cfg.schedule.steps):
                rec["val_loss"] = tr.eval_loss([it["key"] for it in data.validation])
            if d.main:
                with open(metrics, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                if tb is not None:
                    for k, v in rec.items():
                        if k != "step":
                            tb.add_scalar(f"train/{k}", v, tr.step)
                if progress:
                    progress(tr.step, cfg.schedule.steps, rec)
            if sampler and cfg.sampling.every and tr.step % cfg.sampling.every == 0:
                sampler(tr.step, write=d.main)
            if cfg.output.save_every and tr.step % cfg.output.save_every == 0:
                tr.save()
            tr.stop_requested = d.total(float(tr.stop_requested)) > 0  # a signal to any rank stops them all
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        if tb is not None:
            tb.close()
    interrupted = tr.stop_requested or tr.step < cfg.schedule.steps
    if sampler and not interrupted and not (cfg.sampling.every and tr.step % cfg.sampling.every == 0):
        sampler(tr.step, write=d.main)
    ck = tr.save(final=not interrupted)
    result = {"steps": tr.step, "interrupted": interrupted, "checkpoint": str(ck), "metrics": str(metrics),
              "seconds": round(time.perf_counter() - t_start, 2), "cache": cache.to_dict(), "profile": prov,
              "memory_estimate": memory, "memory_note": memory_note, "method": cfg.method,
              "processes": d.world, "global_batch": tr.global_batch, "rank": d.rank}
    if resumed:
        result["resumed"] = resumed
    if sampler and d.main and (out / "samples" / "progress.png").is_file():
        result["samples"] = str(out / "samples" / "progress.png")
    if not interrupted and d.main:
        import shutil

        from lorakit.io import atomic_path

        if tr.full:
            final = out / f"{cfg.output.name}-transformer"
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(ck / "transformer", final)
            result["transformer"] = str(final)
        else:
            final = out / f"{cfg.output.name}.safetensors"
            with atomic_path(final) as tmp:
                shutil.copyfile(ck / "lora.safetensors", tmp)
            result["lora"] = str(final)
        from lorakit.train.report import loss_curve

        result["loss_curve"] = str(loss_curve(metrics, out / "loss_curve.png"))
    d.barrier()
    return result
