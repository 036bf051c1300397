"""The separate compile process's own side (`train.precompile` starts it, `python -m lorakit.train.rehearse`): it
imports what the copy needs, builds a copy of the run's transformer (two blocks of each repeated list, random weights,
prepared by the same code as the run's), waits for the run's inputs, then rehearses the run's block calls in its order
so that torch compiles the same graphs into this machine's compile cache, and says when the training graphs are
there and when everything is."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from lorakit.config.schema import Config
from lorakit.dtypes import torch_dtype
from lorakit.hardware.gpu import compile_workers
from lorakit.hardware.sdpa import apply as apply_attention
from lorakit.io.modules import random_component
from lorakit.models.base import load_adapter, trained_dir
from lorakit.models.batch import Batch
from lorakit.train import dims, sampling, warm
from lorakit.train.precompile import BLOCKS, NICE, WARM
from lorakit.train.swap import repeated_blocks


def rebuilt(x):
    """`plain`'s inverse (a Condition's shape a tuple again; other tuples come back as lists, which the rehearsal
    only unpacks)."""
    if isinstance(x, dict) and x.get("class") in ("Batch", "Condition"):
        cls = Batch if x["class"] == "Batch" else sampling.Condition
        got = {k: rebuilt(v) for k, v in x.items() if k != "class"}
        return cls(**(got | ({"shape": tuple(got["shape"])} if "shape" in got else {})))
    if isinstance(x, dict):
        return {k: rebuilt(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rebuilt(v) for v in x]
    return x


def rehearse(tr, inputs: dict, trained=None) -> dict:
    """The run's block calls, in its order: step 1 (forward and backward), the other shapes, then (`trained` called
    with the seconds so far) a sampling step of each grid prompt (eval mode, no gradients). Returns the seconds each
    of the three took."""
    took, t0 = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        if tr.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        took[name], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()

    batch, sigmas, noise = inputs["first"]
    tr.loss_on(batch, sigmas, noise).backward()
    tr.opt.zero_grad(set_to_none=True)
    lap("step 1")
    warm.warm_shapes(tr, inputs["warm"])
    lap("other shapes")
    if trained:
        trained(dict(took))
    tr.transformer.eval()
    try:
        for k, c in enumerate(inputs["conds"]):
            sampling.denoise(tr, c, k, steps=1)
    finally:
        tr.transformer.train()
    lap("grid")
    return took


def build_copy(cfg, device: str):
    """The run's trainer over a copy of its transformer: `BLOCKS` blocks of each repeated list, random weights,
    prepared by the same code (storage, LoRA, dtypes, compiled blocks, compiled as the calls come)."""
    from lorakit.train.trainer import Trainer

    cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"compile_background": False})})
    dtype = torch_dtype(cfg.model.dtype)
    transformer = random_component(trained_dir(cfg), device, dtype, blocks=BLOCKS, seed=cfg.seed)
    adapter = load_adapter(cfg.model.family, cfg.model.path, device=device, dtype=dtype, backend=cfg.memory.loader)
    return Trainer(cfg, adapter, transformer, None, None, device, dtype)


def _orphaned(parent: int) -> None:
    """End this process when the run's is gone (killed: nothing else would end it)."""
    while True:
        time.sleep(2)
        if os.getppid() != parent:
            os._exit(3)


def only(transformer, kinds: list[str] | None) -> None:
    """The blocks of other kinds than `kinds` run uncompiled here (another process compiles theirs)."""
    for b in repeated_blocks(transformer) if kinds else ():
        if type(b).__name__ not in kinds:
            b._compiled_call_impl = None


def main() -> int:
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    began, born = time.perf_counter(), time.time()
    import torch
    from torch._dynamo.utils import counters

    import lorakit.train.trainer  # noqa: F401 - what the copy needs, imported while the run caches its data

    imported = time.perf_counter()
    warmed = WARM in sys.argv[1:]
    if warmed:  # the run's threads first where both want the CPU, from now on (inherited by the compile workers)
        os.nice(NICE)
        compile_workers()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    spec = json.loads(line)
    cfg = Config.model_validate(spec["config"])
    device = spec["device"]
    if device.startswith("cuda") and torch.device(device).index is not None:  # "cuda": the current one
        torch.cuda.set_device(torch.device(device))
    t0 = time.perf_counter()
    tr = build_copy(cfg, device)
    only(tr.transformer, spec.get("kinds"))
    if not warmed:  # compiling on the CPU: the run's steps first from now on (its compile workers start when it compiles)
        os.nice(NICE)
    start = {"imports": round(imported - began, 1), "copy": round(time.perf_counter() - t0, 1)}  # said if late
    built = time.time()
    print(f"built in {start['copy']:.1f} s; waiting for the run's inputs", flush=True)
    line = sys.stdin.readline()
    if not line.strip():  # the run did not need it
        return 0
    read = time.time()
    go = json.loads(line)
    apply_attention(go["attention"] if device.startswith("cuda") else None, fallback=True)  # as the run's setup
    inputs = rebuilt(torch.load(go["inputs"], weights_only=True))
    dims.install(tr.transformer, *dims.from_json(go.get("dims")))  # the run's graphs: symbolic, grads as the run's
    print(f"rehearsing {1 + len(inputs['warm'])} training shape(s) and {len(inputs['conds'])} grid prompt(s)"
          + (f" for {', '.join(spec['kinds'])}" if spec.get("kinds") else ""), flush=True)
    t1, late = time.perf_counter(), round(max(0.0, time.time() - go.get("sent", time.time())), 1)
    sent = go.get("sent", built)  # how long before the run handed over it was started, and built (< 0: after)
    start.update(before=round(sent - born, 1), built=round(sent - built, 1), read=round(read - sent, 1))

    def said(path: str, parts: dict, grid: int = 0) -> None:  # written whole, then renamed: never read half written
        got = {"ok": True, "seconds": round(time.perf_counter() - t1, 1), "late": late, "start": start,
               "graphs": int(counters["stats"]["unique_graphs"]), "parts": parts}
        got |= {"grid_prompts": grid} if grid else {}
        Path(path + ".part").write_text(json.dumps(got), encoding="utf-8")
        os.replace(path + ".part", path)
        print(json.dumps(got), flush=True)

    grid = len(inputs["conds"])
    said(spec["result"], rehearse(tr, inputs, trained=lambda parts: said(spec["training"], parts, grid)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
