"""`lorakit bench step`: lorakit's training step against the usual diffusers + peft step, same run.

Each way runs in its own child process (so each has its own peak-memory figure, and an out-of-memory in one
does not end the other) on the same inputs: a transformer of the family's full published architecture (or the
tiny test one) with random weights built on the device, a synthetic batch of latents and text embeddings at
the requested resolution, warm-up steps, then timed steps (synchronised, median reported).

- `plain`: what the usual training script does — the bf16 diffusers model, peft LoRA r16 on
  to_q/to_k/to_v/to_out.0 (bf16 LoRA weights), fused AdamW, one SDPA backend set globally (flash, or
  efficient where the family passes a text mask), gradient checkpointing on for transformers over 16 B
  parameters (the usual scripts' advice, and how the Qwen-Image baseline in docs/benchmarks.md was measured),
  the text mask passed as the pipelines pass it.
- `lorakit`: `lorakit.train.loop.Trainer.train_step` — the code `lorakit train` runs — under the profile's
  settings (plus `--set` overrides), with the same LoRA targets and rank.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from lorakit import dist as dist_mod
from lorakit.dtypes import torch_dtype
from lorakit.errors import InputError
from lorakit.hardware.attention_cases import family_masked
from lorakit.hardware.sdpa import apply
from lorakit.io.modules import keep_fp32
from lorakit.models.base import family_adapter, load_adapter
from lorakit.models.batch import drop_full_mask
from lorakit.models.tiny import tiny_pipeline
from lorakit.plan.memory import estimate
from lorakit.plan.resolve import resolve
from lorakit.train import flow_matching as fm

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
    import torch
    from accelerate import init_empty_weights

    name, kwargs = architecture(family, size)
    cls = getattr(diffusers, name)
    with init_empty_weights(include_buffers=False):
        model = cls(**kwargs)
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for n, p in model.named_parameters():
        t = torch.empty(p.shape, device=device, dtype=dtype)
        if n.endswith("bias"):
            t.zero_()
        elif "norm" in n and p.dim() == 1:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        sd[n] = t if keep_on is None else t.to(keep_on)
    model.load_state_dict(sd, strict=True, assign=True)

    return keep_fp32(model.to(keep_on or device)).eval().requires_grad_(False)


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


# --------------------------------------------------------------------------- the two ways (child side)


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
            f"model.dtype={spec['dtype']}", *([f"memory.attention={spec['attention']}"] if spec.get("attention")
                                              else []), *spec["sets"]]
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
        if spec.get("memory_cap"):
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(spec["memory_cap"] * 2**30 / total, 1.0), device)
    cfg = lorakit_config(spec, device) if spec["way"] == "lorakit" else None
    eight_bit = cfg is not None and cfg.memory.base_quant in ("fp8", "qfloat8", "nf4") and cuda
    t0 = time.perf_counter()
    model = build_random(spec["family"], spec["size"], device, dtype, seed=spec["seed"],
                         keep_on="cpu" if eight_bit else None)
    info: dict = {"build_s": round(time.perf_counter() - t0, 2)}
    adapter = _adapter(spec["family"])
    batch = synthetic_batch(spec["family"], spec["size"], spec["res"], seed=spec["seed"])
    if spec["way"] == "plain":
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
                                                                   "optimizer_8bit")}
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
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
        losses.append(float(loss))
    if spec.get("trace_dir"):
        info["trace"] = trace(step, spec, cuda)
    if spec.get("checkpoint_dir") and tr is not None:
        try:
            info["checkpoint"] = checkpoint_check(tr, cuda)
        except Exception as e:  # noqa: BLE001 - the timings above stand; say why the check failed
            info["checkpoint"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    med = statistics.median(times)
    gpus = spec.get("gpus", 1)
    out = {"way": spec["way"], "gpus": gpus, "s_per_step": round(med, 4), "items_per_s": round(gpus / med, 4),
           "min_s": round(min(times), 4), "max_s": round(max(times), 4), "steps_timed": len(times),
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
    continues from what was written (timings of both, and the losses side by side)."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t = time.perf_counter()
    ck = tr.save()
    sync()
    save_s = time.perf_counter() - t
    after = [tr.train_step() for _ in range(steps)]
    t = time.perf_counter()
    tr.resume(ck)
    sync()
    resume_s = time.perf_counter() - t
    again = [tr.train_step() for _ in range(steps)]
    size = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file()) if tr.dist.main else 0
    return {"save_s": round(save_s, 1), "resume_s": round(resume_s, 1), "gib": round(size / 2**30, 1),
            "losses_after_save": [round(x, 5) for x in after], "losses_after_resume": [round(x, 5) for x in again]}


def trace(step, spec: dict, cuda: bool, steps: int = 2) -> str:
    """Profile a few more steps; write the busiest kernels and the GPU's idle share to TRACE_DIR/<way>.txt."""
    from pathlib import Path

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key, 0) for e in ev if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")) / 1e6 if cuda else None
    lines = [f"{spec['way']} {spec['family']} {spec['res']}: {steps} steps, wall {wall:.3f} s"
             + (f", kernels busy {busy:.3f} s ({busy / wall:.0%} of wall)" if busy else "")]
    if cuda:
        lines += gap_report(prof.events())
    lines.append(ev.table(sort_by=key, row_limit=30, max_name_column_width=70))
    out = Path(spec["trace_dir"]) / f"{spec['way']}-{spec['family']}-{spec['res']}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    if cuda:  # the whole timeline, for chrome://tracing or Perfetto
        prof.export_chrome_trace(str(out.with_suffix(".json")))
    out.write_text("\n".join(lines) + "\n")
    return str(out)


def gap_report(events, top: int = 12) -> list[str]:
    """Where the GPU waited: kernels merged into busy spans, the idle gaps between them (total, by size) and the
    largest ones with the kernels on either side — host-bound steps show up as many gaps, a sync as one big one."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not ks:
        return ["no kernels recorded"]
    gaps, end, prev = [], ks[0][1], ks[0][2]
    for s, e, name in ks[1:]:
        if s > end:
            gaps.append((s - end, prev, name))
        if e >= end:
            end, prev = e, name
    span = (end - ks[0][0]) / 1e6
    idle = sum(g for g, _, _ in gaps) / 1e6
    sizes = [(lo, hi, [g for g, _, _ in gaps if lo <= g < hi]) for lo, hi in
             ((0, 10), (10, 100), (100, 1000), (1000, float("inf")))]
    out = [f"GPU timeline {span:.3f} s from first to last kernel: idle {idle * 1e3:.1f} ms ({idle / span:.1%}) in "
           f"{len(gaps)} gaps; " + ", ".join(f"{len(g)} of {lo}-{hi if hi != float('inf') else ''} us: "
                                              f"{sum(g) / 1e3:.1f} ms" for lo, hi, g in sizes)]
    out += [f"  gap {g / 1e3:8.3f} ms after {a[:60]!r} before {b[:60]!r}" for g, a, b in sorted(gaps, reverse=True)[:top]]
    return out


def model_flops(family: str, size: str, res: int) -> float:
    """FLOPs of one LoRA step counted as forward + input-gradient backward of the frozen base (2x the forward),
    with the forward counted by torch's FlopCounterMode on the meta device (matmuls and attention)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_meta(family, size)
        batch = synthetic_batch(family, size, res)
    adapter = _adapter(family)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        b = batch
        x0 = b.latents.to("meta")
        xt, _ = fm.noisy(x0, torch.randn_like(x0), torch.tensor([0.5], device="meta"))
        adapter.predict(model, xt, torch.tensor([0.5], device="meta"),
                        {k: v.to("meta") for k, v in b.text.items()}, controls=[c.to("meta") for c in b.controls])
    return 2.0 * fc.get_total_flops()


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


# --------------------------------------------------------------------------- the parent


def _child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "lorakit.bench.step", json.dumps(spec)]
    if spec.get("gpus", 1) > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['gpus']}",
                    "-m", "lorakit.bench.step"]
    env = dict(os.environ)
    if spec.get("expandable_segments"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"way": spec["way"], "error": f"no result within {timeout:.0f} s"}
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    err = p.stderr.strip().splitlines() or [f"exited with code {p.returncode}"]
    oom = next((ln for ln in reversed(err) if "OutOfMemoryError" in ln or "out of memory" in ln), None)
    if oom is None:
        return {"way": spec["way"], "error": err[-1][-300:]}
    # torch's message says how much was asked for and what was in use; the last lorakit frame says where
    where = next((ln.strip() for ln in reversed(err) if 'File "' in ln and "/lorakit/" in ln), None)
    return {"way": spec["way"], "error": "out of memory", "detail": oom.strip()[-400:],
            **({"where": where[-200:]} if where else {})}


def bench(family: str, res: int, profile: str | None, steps: int = 10, warmup: int = 3, size: str = "full",
          device: str | None = None, memory_cap: float | None = None, sets: list[str] | None = None,
          ways: tuple[str, ...] = ("plain", "lorakit"), attention: str | None = None,
          timeout: float = 900, progress=None, trace_dir: str | None = None, gpus: int = 1,
          checkpoint_dir: str | None = None) -> dict:
    """Run each way in a child process; the figures side by side with the ratio to `plain`.

    gpus > 1 adds lorakit on that many GPUs (one process each: data parallel, FSDP for method=full), with its
    throughput against lorakit on one GPU. checkpoint_dir: the lorakit rows also save, resume and continue."""
    import torch

    adapter = family_adapter(family)  # an unknown name is refused here, with the closest one
    if res % 16:
        raise InputError(f"--res must be a multiple of 16, got {res}")
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda, but no CUDA GPU is visible", "use --device cpu with --tiny")
    if device == "cpu" and size == "full":
        raise InputError("a full-size step on the CPU would take hours", "add --tiny, or run on a GPU")
    cuda = device.startswith("cuda")
    masked = family_masked(family)
    if attention is None and cuda:
        attention = "flash+efficient" if masked else "flash"
    flops = model_flops(family, size, res) if cuda else None
    base = dict(family=family, size=size, res=res, device=device, seed=0, rank=16, steps=steps, warmup=warmup,
                dtype="bf16" if cuda else "fp32", profile=profile or ("datacenter" if cuda else "cpu"),
                sets=list(sets or []), memory_cap=memory_cap, model_flops=flops, attention=attention,
                plain_attention=("efficient" if masked else "flash") if cuda else None,
                plain_checkpointing=adapter.published.params > PLAIN_CHECKPOINTING_ABOVE,
                expandable_segments=cuda, trace_dir=trace_dir,
                checkpoint_dir=checkpoint_dir)
    if gpus > 1 and cuda and torch.cuda.device_count() < gpus:
        raise InputError(f"--gpus {gpus}, but {torch.cuda.device_count()} CUDA GPU(s) are visible")
    runs = [(w, 1) for w in ways] + ([("lorakit", gpus)] if gpus > 1 else [])
    rows = []
    for way, n in runs:
        if progress:
            progress(way if n == 1 else f"{way} on {n} GPUs")
        rows.append(_child({**base, "way": way, "gpus": n}, timeout))
    ref = next((r for r in rows if r["way"] == "plain" and "s_per_step" in r), None)
    one = next((r for r in rows if r["way"] == "lorakit" and r.get("gpus", 1) == 1 and "s_per_step" in r), None)
    for r in rows:
        if ref and "s_per_step" in r and r.get("gpus", 1) == 1:
            r["speedup_vs_plain"] = round(ref["s_per_step"] / r["s_per_step"], 3)
        if one and "items_per_s" in r and r.get("gpus", 1) > 1:
            r["throughput_vs_1gpu"] = round(r["items_per_s"] / one["items_per_s"], 3)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    try:
        import diffusers
        import peft

        env.update(diffusers=diffusers.__version__, peft=peft.__version__)
    except ImportError:
        pass
    if cuda:
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return {"family": family, "res": res, "size": size, "profile": base["profile"], "memory_cap_gib": memory_cap,
            "steps": steps, "warmup": warmup, "model_flops_per_step": flops, "environment": env, "rows": rows}


if __name__ == "__main__":  # child process: one way
    from lorakit.quiet import quiet_libraries

    quiet_libraries()
    _spec = json.loads(sys.argv[1])
    try:
        _out = run_way(_spec)
    except InputError as _e:  # refused (e.g. the memory check): the reason is the row
        _out = {"way": _spec["way"], "error": f"refused: {_e.message}" + (f" ({_e.hint})" if _e.hint else "")}
    if int(os.environ.get("RANK", "0") or 0) == 0:  # one row per way, from rank 0
        print(json.dumps(_out), flush=True)
