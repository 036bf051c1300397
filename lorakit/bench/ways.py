"""The two ways `lorakit bench step` times, in the child process that runs one of them: the full-size (or tiny)
transformer with random weights built on the device, a synthetic batch shaped as the cache gives it, and either the
plain diffusers + peft step or lorakit's `Trainer.train_step` under the profile's resolved settings (the module
docstring of `bench/step.py` says what each way is)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from lorakit import dist as dist_mod
from lorakit.bench.load import drop_cache
from lorakit.bench.trace import trace
from lorakit.dtypes import torch_dtype
from lorakit.hardware import cudnn_op
from lorakit.hardware.gpu import apply_cap
from lorakit.hardware.sdpa import apply
from lorakit.io.modules import fill_random
from lorakit.models.base import family_adapter, load_adapter
from lorakit.models.batch import drop_full_mask
from lorakit.models.tiny import tiny_pipeline
from lorakit.plan.memory import estimate
from lorakit.plan.resolve import resolve
from lorakit.train import checkpoint, shards
from lorakit.train import flow_matching as fm
from lorakit.train.gcpause import Collector

REFERENCE_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the diffusers training examples' default
TEXT_LEN = 512
PLAIN_CHECKPOINTING_ABOVE = 16e9  # parameters: the usual scripts turn checkpointing on for models this large
# dense bf16 peak of known GPUs (for model FLOP/s utilisation), by a substring of the device name
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "B200": 2250e12, "GB200": 2500e12, "A100": 312e12,
             "RTX 4090": 165e12, "RTX 5090": 210e12, "GB10": 62e12}


def architecture(family: str, size: str) -> tuple[str, dict]:
    """(class name, config) of the family's transformer: `full` (published) or `tiny` (the test model)."""
    a = family_adapter(family)
    if size == "full":
        return a.info.transformer_class, dict(a.full_config)

    cfg = json.loads((tiny_pipeline(family) / "transformer" / "config.json").read_text())
    return cfg["_class_name"], {k: v for k, v in cfg.items() if not k.startswith("_")}


def build_random(family: str, size: str, device: str, dtype, seed: int = 0, keep_on: str | None = None):
    """The transformer with random weights made on the device (no download), kept there or on `keep_on`
    (the CPU, for an 8-bit base that must not sit on a small card in bf16 first, as `train` loads it).

    Weights ~ N(0, 0.02), biases 0, norm scales 1: activations stay finite through every block in bf16.
    """
    import diffusers
    from accelerate import init_empty_weights

    name, kwargs = architecture(family, size)
    cls = getattr(diffusers, name)
    with init_empty_weights(include_buffers=False):
        model = cls(**kwargs)
    return fill_random(model, device, dtype, seed, keep_on)


def reference_targets(family: str) -> list[str]:
    """The LoRA targets both ways train: the diffusers examples' default where the family has those modules,
    else the family's attention preset."""
    attention = family_adapter(family).lora_presets.attention
    return REFERENCE_TARGETS if set(REFERENCE_TARGETS) <= set(attention) else list(attention)


def synthetic_batch(family: str, size: str, res: int, seed: int = 0, text_len: int = TEXT_LEN, frames: int = 1):
    """One batch (CPU tensors) shaped as the cache gives it (the family adapter's `example_inputs`): latents at
    the resolution, text embeddings (+ mask / pooled), control latents of the same size for edit families."""
    import torch

    _, kw = architecture(family, size)
    return family_adapter(family).example_inputs(kw, res, text_len, torch.Generator().manual_seed(seed), frames)


class SyntheticData:
    """The data interface of `train.data.CachedData` over one repeated synthetic batch."""

    validation: list = []

    def __init__(self, batch, copies: int = 1):
        self.batch = batch
        self.copies = copies  # the global batch of a multi-GPU run: one copy per process

    def batch_at(self, index: int) -> list[str]:
        return self.batch.keys * self.copies

    def load(self, keys, drop=None, variants=None):
        return drop_full_mask(self.batch)


def _adapter(family: str):
    return load_adapter(family, None)


def plain_setup(spec: dict, model, device: str):
    """The usual way: bf16 LoRA via peft on the attention projections, fused AdamW."""
    import torch
    from peft import LoraConfig

    torch.manual_seed(spec["seed"])
    model.add_adapter(LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], init_lora_weights="gaussian",
                                 target_modules=reference_targets(spec["family"])))
    if spec["plain_checkpointing"]:
        model.enable_gradient_checkpointing()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.startswith("cuda"))
    return params, opt


def plain_loss(adapter, model, batch, sigmas, noise, device, dtype):
    """The plain step's loss: same conventions (adapter.predict), no autocast, everything in `dtype`."""
    x0 = batch.latents.to(device, dtype)
    xt, target = fm.noisy(x0, noise.to(device, dtype), sigmas.to(device))
    text = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in batch.text.items()}
    v = adapter.predict(model, xt, sigmas.to(device, dtype), text, guidance=1.0,
                        controls=[c.to(device, dtype) for c in batch.controls])
    return ((v.float() - target.float()) ** 2).mean()


def lorakit_config(spec: dict, device: str):
    """The run's config (profile + the bench's settings + --set), resolved as `train` resolves it: the memory plan
    fitted to the GPU (refused before anything is built when it cannot fit), compile, graphs, the attention
    backend the bench asks for."""
    sets = [f"model.family={spec['family']}", f"data.resolution={spec['res']}", f"lora.rank={spec['rank']}",
            f"lora.targets={json.dumps(reference_targets(spec['family']))}", "lora.dropout=0", f"seed={spec['seed']}",
            f"schedule.steps={spec['warmup'] + spec['steps']}", "schedule.warmup_steps=0",
            f"model.dtype={spec['dtype']}", "memory.compile_background=false",  # the steady step, compiled at once
            *([f"data.frames={spec.get('frames', 1)}"] if _adapter(spec["family"]).layout == "video" else []),
            *([f"memory.attention={spec['attention']}"] if spec.get("attention") else []), *spec["sets"]]
    return resolve(None, sets, profile=spec["profile"], paths=(), world=spec.get("gpus", 1),
                   cap_gib=spec.get("memory_cap")).cfg


def lorakit_trainer(spec: dict, model, adapter, data, device: str, dtype, cfg=None, dist=None):
    import torch

    from lorakit.train.trainer import Trainer

    cfg = cfg or lorakit_config(spec, device)
    if device.startswith("cuda"):
        apply(spec["attention"] or None)
    torch.manual_seed(spec["seed"])
    from pathlib import Path

    out = Path(spec["checkpoint_dir"]) if spec.get("checkpoint_dir") else None
    return Trainer(cfg, adapter, model, data, out, device, dtype, dist=dist), cfg


def prepare(spec: dict):
    """Build one way in this process. Returns (step function returning the loss, facts)."""
    import torch

    d = dist_mod.init(spec["device"])  # several processes when launched with --gpus N
    device = spec["device"] = d.device(spec["device"])
    dtype = torch_dtype(spec["dtype"])
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if spec.get("memory_cap"):  # as `lorakit train` under LORAKIT_MEMORY_CAP_GIB: the CUDA context inside it
            apply_cap(device, spec["memory_cap"])
    cfg = lorakit_config(spec, device) if spec["way"] == "lorakit" else None
    eight_bit = cfg is not None and cfg.memory.base_quant in ("fp8", "qfloat8", "nf4") and cuda
    t0 = time.perf_counter()
    model = build_random(spec["family"], spec["size"], device, dtype, seed=spec["seed"],
                         keep_on="cpu" if eight_bit else None)
    info: dict = {"build_s": round(time.perf_counter() - t0, 2)}
    adapter = _adapter(spec["family"])
    batch = synthetic_batch(spec["family"], spec["size"], spec["res"], seed=spec["seed"],
                            frames=spec.get("frames", 1))
    if spec["way"] == "plain":
        cudnn_op.use(False)  # the usual way calls PyTorch's SDPA (lorakit's operators stay lorakit's)
        if cuda and spec["plain_attention"]:
            apply(spec["plain_attention"])
        params, opt = plain_setup(spec, model, device)
        g = torch.Generator().manual_seed(spec["seed"])

        def step() -> torch.Tensor:
            sig = torch.rand(1, generator=g)
            noise = torch.randn(batch.latents.shape, generator=g)
            loss = plain_loss(adapter, model, batch, sig, noise, device, dtype)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        info["checkpointing"] = spec["plain_checkpointing"]
        info["attention"] = spec["plain_attention"]
    else:
        tr, cfg = lorakit_trainer(spec, model, adapter, SyntheticData(batch, d.world), device, dtype, cfg, d)
        step = tr.train_step
        info["trainer"] = tr
        info["method"] = cfg.method
        info["checkpointing"] = cfg.memory.gradient_checkpointing
        info["attention"] = spec["attention"]
        info["settings"] = {k: getattr(cfg.memory, k) for k in ("base_quant", "compute", "gradient_checkpointing",
                                                                   "checkpoint_blocks", "compile", "blocks_to_swap",
                                                                   "optimizer_8bit", "compiled_recompute", "cpp_wrapper")}
        info["settings"]["cuda_graphs"] = tr.graphs  # in force (memory.cuda_graphs asks; prepare decides)
        if cuda:
            info["estimate_gib"] = estimate(cfg, spec.get("gpus", 1))["gib"]  # beside the measured peak
        info["optimizer"] = cfg.optim.name
    return step, info


def run_way(spec: dict) -> dict:
    """One way, in this process: build, warm up, time. Returns the figures."""
    import torch

    step, info = prepare(spec)
    device = spec["device"]
    cuda = device.startswith("cuda")
    tr = info.pop("trainer", None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses, gc_s = [], [], 0.0
    with Collector() as collector:  # full collections timed in the timed steps
        for i in range(spec["warmup"] + spec["steps"]):
            if i == spec["warmup"] and spec["way"] == "lorakit":
                collector.settle()  # what the run keeps, frozen after the warm-up, as `lorakit train` does after
                # step 1 (`train.loop`); the plain way's loop collects as Python does
            t = time.perf_counter()
            loss = step()
            if cuda:
                torch.cuda.synchronize()
            pause = collector.take()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t)
                gc_s += pause
            losses.append(float(loss))
    med = statistics.median(times)
    if not int(os.environ.get("RANK", "0") or 0):  # as it is measured (a run cut short still shows it)
        print(f"bench step: {spec['way']} {med:.3f} s/step", file=sys.stderr, flush=True)
    if spec.get("trace_dir"):
        info["trace"] = trace(step, spec, cuda)
    if spec.get("checkpoint_dir") and tr is not None:
        try:
            info["checkpoint"] = checkpoint_check(tr, cuda)
        except Exception as e:  # noqa: BLE001 - the timings above stand; say why the check failed
            import traceback

            where = " | ".join(ln.strip() for ln in traceback.format_exc().strip().splitlines()[-7:])
            print(f"bench checkpoint: failed on rank {tr.dist.rank}: {where}", file=sys.stderr, flush=True)
            if tr.dist.world > 1:  # the other ranks wait in a collective: end them all (the launcher does)
                raise
            info["checkpoint"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    gpus = spec.get("gpus", 1)
    out = {"way": spec["way"], "gpus": gpus, "s_per_step": round(med, 4), "items_per_s": round(gpus / med, 4),
           "min_s": round(min(times), 4), "max_s": round(max(times), 4), "steps_timed": len(times),
           "times_s": [round(x, 4) for x in times], "gc_s": round(gc_s, 3),
           "losses": [round(x, 5) for x in losses], **info}
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        flops = spec.get("model_flops")
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        if flops and peak:
            out["mfu"] = round(flops / med / peak, 3)
    return out


def checkpoint_check(tr, cuda: bool, steps: int = 2) -> dict:
    """Save a checkpoint, take `steps` more steps, resume from the checkpoint and take them again: the run
    continues from what was written (timings of both, and the losses side by side, unrounded); the resume reads
    the disk (the save's pages dropped from the cache). A sharded full fine-tune also saves in the background
    (output.async_save) three times — the first save pins its host buffers, the second reuses them, the third does
    too with 2 writer threads a rank instead of the run's 8 — each timed as the run feels it (`_background_save`),
    then once more synchronously from those buffers (`save_from_buffers_s`).
    Every checkpoint is removed after its measurement (a full-size one is ~70 GB)."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t = time.perf_counter()
    ck = tr.save()
    sync()
    save_s = time.perf_counter() - t
    _say(tr, f"synchronous save {save_s:.1f} s")
    after = [tr.train_step() for _ in range(steps)]
    if tr.dist.main:  # the resume reads the disk, not the page cache the save filled
        cold = drop_cache([f for f in ck.rglob("*") if f.is_file()])
    tr.dist.barrier()
    t = time.perf_counter()
    tr.resume(ck)
    sync()
    resume_s = time.perf_counter() - t
    _say(tr, f"resume {resume_s:.1f} s")
    again = [tr.train_step() for _ in range(steps)]
    size = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file()) if tr.dist.main else 0
    out = {"save_s": round(save_s, 1), "resume_s": round(resume_s, 1), "gib": round(size / 2**30, 1),
           "losses_after_save": after, "losses_after_resume": again, "exact": after == again,
           **({"resume_read": cold} if tr.dist.main else {})}
    if (ck / "dcp").is_dir():  # sharded: what each rank wrote; then the disk is freed for the next saves
        out["shard_files"] = sorted(f.name for f in (ck / "dcp").iterdir())
        _remove(tr, ck)
        if tr.cfg.output.async_save:
            out["async"] = []
            for writers in (None, None, 2):  # the last with fewer writer threads beside the steps
                out["async"].append(_background_save(tr, sync, writers=writers))
                _say(tr, f"background save: {json.dumps(out['async'][-1])}")
            t = time.perf_counter()  # a synchronous save now that the pinned buffers exist (best, final)
            again_ck = tr.save()
            sync()
            out["save_from_buffers_s"] = round(time.perf_counter() - t, 1)
            _say(tr, f"synchronous save from the pinned buffers {out['save_from_buffers_s']} s")
            _remove(tr, again_ck)
            checkpoint.release(tr)
    return out


def _say(tr, what: str) -> None:
    """A measurement as it is made, on stderr (rank 0): a run cut short still shows what it measured."""
    if tr.dist.main:
        print(f"bench checkpoint: {what}", file=sys.stderr, flush=True)


def _remove(tr, ck) -> None:
    """A bench checkpoint removed (full-size ones are ~70 GB: one at a time fits the disk)."""
    import shutil

    tr.dist.barrier()
    if tr.dist.main:
        shutil.rmtree(ck)
    tr.dist.barrier()


def _background_save(tr, sync, during: int = 8, writers: int | None = None) -> dict:
    """One background save of a sharded full fine-tune, timed as the run feels it (see `checkpoint_check`): the
    call, what the next update waited for the copy, the `during` steps taken while the shards are written (each
    rank takes as many: they run collectives), then the rest of the write. `writers`: the files each rank writes at
    once for this save (default: the run's, `shards.WRITER_THREADS`) — the bench compares what they cost the steps."""
    sync()
    default = shards.WRITER_THREADS
    shards.WRITER_THREADS = writers or default
    try:
        waited, t = tr.staging_wait_s, time.perf_counter()
        ck = tr.save(background=True)
        call_s = time.perf_counter() - t
        t0, steps = time.perf_counter(), []
        for _ in range(during):
            t = time.perf_counter()
            tr.train_step()
            sync()
            steps.append(round(time.perf_counter() - t, 2))
        writing = tr.pending is not None and not tr.pending.future.done()  # still, after those steps
        checkpoint.wait(tr)
    finally:
        shards.WRITER_THREADS = default
    tr.dist.barrier()
    background_s = time.perf_counter() - t0
    _remove(tr, ck)
    waited = tr.staging_wait_s - waited
    return {"writers": writers or default, "call_s": round(call_s, 2), "update_waited_s": round(waited, 2),
            "blocking_s": round(call_s + waited, 2), "steps_during_write_s": steps,
            "written_after_the_steps": not writing, "background_s": round(background_s, 1)}


def model_flops(family: str, size: str, res: int, frames: int = 1, full: bool = False) -> float:
    """FLOPs of one step: a LoRA step counted as forward + input-gradient backward of the frozen base (2x the
    forward), a full fine-tune's (`full`) with the weights' gradients too (3x the forward: the usual 6 x parameters
    x tokens), the forward counted by torch's FlopCounterMode on the meta device (matmuls and attention)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    adapter = _adapter(family)
    if not adapter.meta_forward:
        batch = synthetic_batch(family, size, res, frames=frames)
        return (3.0 if full else 2.0) * adapter.forward_flops(architecture(family, size)[1], batch)
    architecture(family, size)  # a tiny pipeline is built (once) on the CPU, not on the meta device
    with torch.device("meta"):
        model = build_meta(family, size)
        batch = synthetic_batch(family, size, res, frames=frames)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        b = batch
        x0 = b.latents.to("meta")
        xt, _ = fm.noisy(x0, torch.randn_like(x0), torch.tensor([0.5], device="meta"))
        adapter.predict(model, xt, torch.tensor([0.5], device="meta"),
                        {k: v.to("meta") for k, v in b.text.items()}, controls=[c.to("meta") for c in b.controls])
    return (3.0 if full else 2.0) * fc.get_total_flops()


def build_meta(family: str, size: str):
    import diffusers

    name, kwargs = architecture(family, size)
    return getattr(diffusers, name)(**kwargs)


def compare_numerics(family: str, size: str = "tiny", res: int = 128, device: str = "cpu", dtype_name: str = "fp32",
                     sets: list[str] | None = None, sigma: float = 0.6) -> dict:
    """lorakit's step against the plain step on the same weights, LoRA, inputs, sigma and noise.

    Returns both losses and the largest relative difference of the LoRA gradients (per tensor, by norm).
    """
    import torch

    dtype = torch_dtype(dtype_name)
    cuda = device.startswith("cuda")
    spec = dict(family=family, size=size, res=res, device=device, seed=0, rank=16, steps=1, warmup=0,
                dtype=dtype_name, profile="datacenter" if cuda else "cpu", sets=list(sets or []),
                attention="flash+efficient" if cuda else None, plain_checkpointing=False)
    if cuda:  # both ways on kernels that work here (PyTorch's default pick, cuDNN, fails in backward on H100)

        apply("flash+efficient")
    adapter = _adapter(family)
    batch = synthetic_batch(family, size, res, seed=0)
    noise = torch.randn(batch.latents.shape, generator=torch.Generator().manual_seed(1))
    sig = torch.tensor([sigma])

    plain = build_random(family, size, device, dtype, seed=0)
    params, _ = plain_setup(spec, plain, device)
    loss_p = plain_loss(adapter, plain, batch, sig, noise, device, dtype)
    loss_p.backward()
    grads_p = {n: p.grad.float().cpu() for n, p in plain.named_parameters() if p.requires_grad}
    weights = {n: p.detach().float().cpu() for n, p in plain.named_parameters() if p.requires_grad}
    del plain, params

    ours = build_random(family, size, device, dtype, seed=0)
    tr, _ = lorakit_trainer(spec, ours, adapter, SyntheticData(batch), device, dtype)
    named = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    if set(named) != set(weights):
        raise AssertionError(f"LoRA parameters differ: {sorted(set(named) ^ set(weights))[:4]}")
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(weights[n])
    loss_o = tr.loss_on(SyntheticData(batch).load(batch.keys), sig, noise)
    loss_o.backward()
    worst = 0.0
    for n, p in named.items():
        ref = grads_p[n]
        diff = (p.grad.float().cpu() - ref).norm() / ref.norm().clamp(min=1e-12)
        worst = max(worst, float(diff))
    return {"loss_plain": float(loss_p.detach()), "loss_lorakit": float(loss_o.detach()), "grad_rel_diff": worst,
            "tensors": len(named), "compiled": tr.compiled}
