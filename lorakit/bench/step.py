"""`lorakit bench step`: lorakit's training step against the usual diffusers + peft step, same run.

Each way runs in its own child process (so each has its own peak-memory figure, and an out-of-memory in one
does not end the other) on the same inputs: a transformer of the family's full published architecture (or the
tiny test one) with random weights built on the device, a synthetic batch of latents and text embeddings at
the requested resolution, warm-up steps, then timed steps (synchronised, median reported).

- `plain`: what the usual training script does — the bf16 diffusers model, peft LoRA r16 on
  to_q/to_k/to_v/to_out.0 (bf16 LoRA weights), fused AdamW, one SDPA backend set globally (flash, or
  efficient where the family passes a text mask), gradient checkpointing on for transformers over 16 B
  parameters (the usual scripts' advice, and how the Qwen-Image baseline in docs/benchmarks-history.md was measured),
  the text mask passed as the pipelines pass it.
- `lorakit`: `lorakit.train.loop.Trainer.train_step` — the code `lorakit train` runs — under the profile's
  settings (plus `--set` overrides), with the same LoRA targets and rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from lorakit.bench.ways import PLAIN_CHECKPOINTING_ABOVE, model_flops, run_way
from lorakit.config import assemble
from lorakit.errors import InputError
from lorakit.hardware.attention_cases import family_masked
from lorakit.models.base import family_adapter
from lorakit.plan.decide import attention_backend


def _child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "lorakit.bench.step", json.dumps(spec)]
    if spec.get("gpus", 1) > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['gpus']}",
                    "-m", "lorakit.bench.step"]
    env = dict(os.environ)
    if spec.get("expandable_segments"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: list[str] = []
    err: list[str] = []

    def relay(pipe, into, show):  # the child's progress lines ("bench ...") shown as they come, all of it kept
        for line in pipe:
            into.append(line)
            if show and line.startswith("bench "):
                print(line, end="", file=sys.stderr, flush=True)

    readers = [threading.Thread(target=relay, args=a, daemon=True) for a in ((p.stdout, out, False),
                                                                               (p.stderr, err, True))]
    for r in readers:
        r.start()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return {"way": spec["way"], "error": f"no result within {timeout:.0f} s"}
    for r in readers:
        r.join()
    out = "".join(out)
    err = "".join(err).strip().splitlines()
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    err = err or [f"exited with code {p.returncode}"]
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
          checkpoint_dir: str | None = None, frames: int = 1) -> dict:
    """Run each way in a child process; the figures side by side with the ratio to `plain`.

    frames: video families' clip length (frames = 4k + 1); the synthetic batch and lorakit's memory plan both
    take it (images: 1).

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
    if frames != 1 and (adapter.layout != "video" or (frames - 1) % adapter.temporal):
        raise InputError(f"--frames {frames}: " + (f"{family} trains images" if adapter.layout != "video" else
                                                   f"a clip of {family} has {adapter.temporal}k + 1 frames"),
                         "leave --frames out (1)" if adapter.layout != "video" else "e.g. --frames 17")
    base = way_spec(family, res, profile, steps, warmup, size, device, memory_cap, sets, attention, trace_dir,
                    checkpoint_dir, frames)
    flops = base["model_flops"]
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
    return {"family": family, "res": res, "frames": frames, "size": size, "profile": base["profile"],
            "memory_cap_gib": memory_cap, "steps": steps, "warmup": warmup, "model_flops_per_step": flops, "environment": env, "rows": rows}


def way_spec(family: str, res: int, profile: str | None, steps: int, warmup: int, size: str, device: str,
             memory_cap: float | None = None, sets: list[str] | None = None, attention: str | None = None,
             trace_dir: str | None = None, checkpoint_dir: str | None = None, frames: int = 1) -> dict:
    """What a child process gets to build and time one way (`run_way`; plus "way" and "gpus"): the batch, the
    profile and settings, the attention each way runs (lorakit's: the run's choice where none is given)."""
    cuda = device.startswith("cuda")
    masked = family_masked(family)
    if attention is None and cuda:
        attention = train_attention(family, res, profile, device) or ("flash+efficient" if masked else "flash")
    full = any(s.replace(" ", "") == "method=full" for s in sets or ())  # weight gradients: 3x the forward
    return dict(family=family, size=size, res=res, frames=frames, device=device, seed=0, rank=16, steps=steps,
                warmup=warmup, dtype="bf16" if cuda else "fp32", profile=profile or ("datacenter" if cuda else "cpu"),
                sets=list(sets or []), memory_cap=memory_cap,
                model_flops=model_flops(family, size, res, frames, full=full) if cuda else None, attention=attention,
                plain_attention=("efficient" if masked else "flash") if cuda else None,
                plain_checkpointing=family_adapter(family).published.params > PLAIN_CHECKPOINTING_ABOVE,
                expandable_segments=cuda, trace_dir=trace_dir, checkpoint_dir=checkpoint_dir)


def train_attention(family: str, res: int, profile: str | None, device: str) -> str | None:
    """The kernel `lorakit train` puts in force here for this family and resolution (the attention self-test's
    choice, measured once per machine); None where it leaves the pick to PyTorch."""
    cfg, _ = assemble(None, [f"model.family={family}", f"data.resolution={res}"], profile=profile or "datacenter")
    choice = attention_backend(cfg, device)
    return None if choice == "auto" else choice


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
