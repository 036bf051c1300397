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
from lorakit.train import flow_matching as fm

PREDICTS = ("flux", "qwen_image", "kandinsky5")  # families whose forward convention is implemented and tested


def make_optimizer(params, cfg, device: str):
    import torch

    o = cfg.optim
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                 fused=device.startswith("cuda"))
    if o.name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
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


class Trainer:
    """Holds the run's state; `train(until)` advances it, `save`/`resume` persist it."""

    def __init__(self, cfg, adapter, transformer, data, out_dir: Path, device: str, dtype):
        import torch

        from lorakit.train.lora import add_lora

        self.cfg, self.adapter, self.data, self.out = cfg, adapter, data, out_dir
        self.device, self.dtype = device, dtype
        self.info = family_info(cfg.model.family)
        if self.info.module not in PREDICTS:
            raise NotAvailableError(f"training {cfg.model.family} is not in this build yet (tracked as issue #6)",
                                    "FLUX and Qwen-Image(-Edit/-Plus) train today")
        self.transformer = transformer
        self.quantized = 0
        if cfg.memory.base_quant in ("fp8", "qfloat8"):
            from lorakit.train.quant import quantize_blocks

            self.quantized = quantize_blocks(transformer, dtype, device)
        transformer.to(device)  # what was not quantized (loaded to the CPU for an 8-bit base)
        if cfg.memory.blocks_to_swap:
            raise NotAvailableError("memory.blocks_to_swap is not in this build yet (tracked as issue #6)",
                                    "set it to 0, lower data.resolution, or use --set memory.base_quant=fp8")
        if cfg.memory.base_quant == "nf4":
            raise NotAvailableError("memory.base_quant=nf4 is not in this build yet (tracked as issue #6)",
                                    "use --set memory.base_quant=fp8 (8-bit e4m3 storage, bf16 compute)")
        self.peft_config = add_lora(transformer, self.info.module, cfg)
        if cfg.memory.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self.compiled = bool(cfg.memory.compile and device.startswith("cuda")
                             and getattr(transformer, "_repeated_blocks", None))
        if self.compiled:  # regional: each repeated block once (seconds, not minutes), shapes per bucket
            transformer.compile_repeated_blocks()
        transformer.train()
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        for p in self.params:
            p.data = p.data.float()  # LoRA weights train in fp32 whatever the base dtype
        self.opt = make_optimizer(self.params, cfg, device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.step = 0
        sched_file = Path(cfg.model.path or ".") / "scheduler" / "scheduler_config.json"
        self.sched_cfg = json.loads(sched_file.read_text()) if cfg.model.path and sched_file.is_file() else {}
        self.stop_requested = False

    # -------------------------------------------------------------- one step

    def _gen(self, step: int, micro: int):
        import torch

        return torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step * 1009 + micro) % 2**63)

    def loss_on(self, batch, sigmas, noise):
        """Weighted flow-matching loss of one batch at given sigmas and noise."""
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
        return (per * w).mean()

    def train_step(self) -> float:
        import torch

        s = self.cfg.schedule
        total = 0.0
        for micro in range(s.grad_accum):
            g = self._gen(self.step, micro)
            keys = self.data.batch_at(self.step * s.grad_accum + micro)
            drop = (torch.rand(len(keys), generator=g) < self.cfg.data.caption_dropout).tolist()
            batch = self.data.load(keys, drop)
            n = batch.latents.shape[0]
            seq = (batch.latents.shape[-1] // 2) * (batch.latents.shape[-2] // 2)
            sigmas = fm.sample_sigmas(n, s.timesteps, g, shift=s.shift, logit_mean=s.logit_mean,
                                      logit_std=s.logit_std, image_seq_len=seq, scheduler_config=self.sched_cfg)
            noise = torch.randn(batch.latents.shape, generator=g)
            loss = self.loss_on(batch, sigmas, noise) / s.grad_accum
            loss.backward()
            total += float(loss.detach())
        if not math.isfinite(total):
            raise InputError(f"the loss became {total} at step {self.step + 1}",
                             "lower optim.lr, or check memory.attention with `lorakit doctor`")
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

    def save(self, final: bool = False) -> Path:
        import torch

        from lorakit.io import atomic_path
        from lorakit.train.lora import save_lora

        name = "final" if final else f"step-{self.step:06d}"
        ck = self.out / "checkpoints" / name
        ck.mkdir(parents=True, exist_ok=True)
        save_lora(self.transformer, ck / "lora.safetensors", self.peft_config, {"lorakit_step": self.step})
        state = {"step": self.step, "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        with atomic_path(ck / "state.pt") as tmp:
            torch.save(state, tmp)
        if not final:
            kept = sorted(p for p in (self.out / "checkpoints").glob("step-*") if p.is_dir())
            for old in kept[: -self.cfg.output.keep_last]:
                for f in old.iterdir():
                    f.unlink()
                old.rmdir()
        return ck

    def resume(self, ck: Path) -> None:
        import torch

        from lorakit.train.lora import load_lora_into

        if not (ck / "lora.safetensors").is_file() or not (ck / "state.pt").is_file():
            raise InputError(f"{ck} is not a lorakit checkpoint (lora.safetensors + state.pt)")
        load_lora_into(self.transformer, ck / "lora.safetensors")
        state = torch.load(ck / "state.pt", weights_only=True)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])


def _tensorboard(folder: Path):
    """A SummaryWriter when TensorBoard is installed (None otherwise: metrics.jsonl always exists)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder))


def check_memory(cfg, cap_gib: float | None = None):
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
    cfg, note = plan(cfg, budget)
    return cfg, check(cfg, budget), note


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
    cfg, memory, memory_note = check_memory(cfg)  # refuses before any weights load
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.resolved.yaml").write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.seed)
    adapter = load_adapter(cfg.model.family, cfg.model.path, device=device, dtype=dtype, backend=cfg.memory.loader)
    cache = build(cfg, adapter=adapter)
    store = Store(cache_dir_for(cfg))
    data = CachedData(store, store.read_manifest(), cfg.schedule.batch_size, cfg.seed, cfg.data.repeats,
                      hold_out=cfg.sampling.validation_items)
    if device.startswith("cuda"):
        from lorakit.hardware.attention import apply, self_test

        choice = cfg.memory.attention if cfg.memory.attention != "auto" else self_test(device).choice.get(
            cfg.model.family)
        apply(choice)
    # an 8-bit base is loaded to the CPU (mapped, no copy) and reaches the GPU layer by layer in 8 bits
    eight_bit = cfg.memory.base_quant in ("fp8", "qfloat8") and device != "cpu"
    transformer = load_component(Path(cfg.model.path) / "transformer", "cpu" if eight_bit else device, dtype,
                                 cfg.memory.loader)
    tr = Trainer(cfg, adapter, transformer, data, out, device, dtype)
    if resume:
        ck = latest_checkpoint(out) if resume == "latest" else Path(resume)
        if ck is None:
            raise InputError(f"--resume latest: no checkpoint in {out / 'checkpoints'}")
        tr.resume(ck)
    metrics = out / "metrics.jsonl"
    if metrics.exists():  # a fresh run starts a new file; a resumed one drops steps past its checkpoint
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
    tb = _tensorboard(out / "tensorboard")
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
            with open(metrics, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if tb is not None:
                for k, v in rec.items():
                    if k != "step":
                        tb.add_scalar(f"train/{k}", v, tr.step)
            if progress:
                progress(tr.step, cfg.schedule.steps, rec)
            if cfg.output.save_every and tr.step % cfg.output.save_every == 0:
                tr.save()
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        if tb is not None:
            tb.close()
    interrupted = tr.stop_requested or tr.step < cfg.schedule.steps
    ck = tr.save(final=not interrupted)
    result = {"steps": tr.step, "interrupted": interrupted, "checkpoint": str(ck), "metrics": str(metrics),
              "seconds": round(time.perf_counter() - t_start, 2), "cache": cache.to_dict(), "profile": prov,
              "memory_estimate": memory, "memory_note": memory_note}
    if not interrupted:
        import shutil

        from lorakit.io import atomic_path

        final = out / f"{cfg.output.name}.safetensors"
        with atomic_path(final) as tmp:
            shutil.copyfile(ck / "lora.safetensors", tmp)
        result["lora"] = str(final)
        from lorakit.train.report import loss_curve

        result["loss_curve"] = str(loss_curve(metrics, out / "loss_curve.png"))
    return result
