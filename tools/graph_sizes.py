"""What a size the run has not met costs a step under CUDA graphs, and where that time goes.

lorakit's step as `lorakit bench step` builds it (the family's full architecture with random weights, the profile's
settings, `memory.cuda_graphs=true`), fed a planned sequence of batches: bucket shapes and text lengths in turn, each a
few steps in a row, then one text length padded with a mask (the text-length cost of a padded prompt), then a new
length on each shape with torch's checks of the graphs' memory pool off (`slow_path_cudagraph_asserts`, on by default:
what those checks cost a recording). Per step: wall time (synchronised), and what torch's CUDA graph trees did in it —
warm-up runs and recordings (count, seconds), the seconds in their memory-pool checks, in `torch.cuda.empty_cache`
and the host cache's emptying that each capture begins with, Python's full collections, and the allocator's retries
(a full card: cached blocks freed and the allocation tried again).

    python tools/graph_sizes.py --family qwen-image --profile rtx4090 --cap 24 [--lengths 12,13] \
        [--shapes 1024x1024,1216x832] [--pad 32] [--repeat 3] [--steady 10] [--no-checks] [--out F.json]

`--tiny --device cpu --no-graphs` runs the plan on the tiny layout on the CPU (the tool's own test).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Counters:
    """Time and counts of what torch's CUDA graph trees do, from wrappers around their own functions."""

    def __init__(self):
        self.now = {"warmups": 0, "warmup_s": 0.0, "recordings": 0, "record_s": 0.0, "pool_checks": 0,
                    "pool_check_s": 0.0, "empty_cache_s": 0.0, "host_empty_s": 0.0, "full_gcs": 0}

    def timed(self, count: str | None, seconds: str, fn):
        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if count:
                    self.now[count] += 1
                self.now[seconds] += time.perf_counter() - t
        return wrapped

    def install(self) -> None:
        import torch
        from torch._inductor import cudagraph_trees as trees

        m = trees.CUDAGraphTreeManager
        m.run_eager = self.timed("warmups", "warmup_s", m.run_eager)
        m.record_function = self.timed("recordings", "record_s", m.record_function)
        trees.check_memory_pool = self.timed("pool_checks", "pool_check_s", trees.check_memory_pool)
        torch.cuda.empty_cache = self.timed(None, "empty_cache_s", torch.cuda.empty_cache)
        torch._C._host_emptyCache = self.timed(None, "host_empty_s", torch._C._host_emptyCache)
        gc.callbacks.append(lambda phase, info: phase == "start" and info.get("generation") == 2
                            and self.now.__setitem__("full_gcs", self.now["full_gcs"] + 1))

    def snapshot(self) -> dict:
        return dict(self.now)


def plan(shapes: list[tuple[int, int]], lengths: list[int], pad: int, repeat: int, steady: int) -> list[tuple]:
    """(width, height, text length, padded length or 0, label, pool checks on) per step."""
    out = []
    first = (*shapes[0], lengths[0])
    for w, h in shapes:
        for n in lengths:
            out += [(w, h, n, 0, f"{w}x{h} text {n}", True)] * repeat
    out += [(*first, 0, f"{first[0]}x{first[1]} text {first[2]}, steady", True)] * steady
    if pad:
        out += [(*first, pad, f"{first[0]}x{first[1]} text {first[2]} padded to {pad}", True)] * (repeat + steady)
    new = lengths[-1] + 1  # a length not met yet: its warm-up and recording without the pool checks
    out += [(w, h, new, 0, f"{w}x{h} text {new}, pool checks off", False) for w, h in shapes for _ in range(repeat)]
    return out


def batch_of(base, adapter, w: int, h: int, n: int, pad: int, seed: int):
    """`base` (a synthetic batch) at w x h pixels with a prompt of n tokens, padded with a mask to `pad` tokens."""
    import torch

    from lorakit.models.batch import Batch

    g = torch.Generator().manual_seed(seed)
    f = adapter.vae_factor
    lat = base.latents
    latents = torch.randn(*lat.shape[:-2], h // f, w // f, generator=g, dtype=lat.dtype)
    controls = [torch.randn(*c.shape[:-2], h // f, w // f, generator=g, dtype=c.dtype) for c in base.controls]
    emb = base.text["prompt_embeds"]
    total = max(n, pad)
    text = {k: v for k, v in base.text.items() if k not in ("prompt_embeds", "prompt_embeds_mask")}
    text["prompt_embeds"] = torch.randn(emb.shape[0], total, emb.shape[2], generator=g, dtype=emb.dtype)
    text["prompt_embeds"][:, n:] = 0
    if "prompt_embeds_mask" in base.text or pad:
        mask = torch.zeros(emb.shape[0], total, dtype=torch.long)
        mask[:, :n] = 1
        text["prompt_embeds_mask"] = mask
    return Batch(base.keys, latents, text, controls, base.mask, base.weights)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen-image")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--cap", type=float, help="GiB of GPU memory the run may use (as LORAKIT_MEMORY_CAP_GIB)")
    ap.add_argument("--set", action="append", default=[], help="a lorakit setting key=value")
    ap.add_argument("--shapes", default="1024x1024,1216x832")
    ap.add_argument("--lengths", default="12,13")
    ap.add_argument("--pad", type=int, default=32, help="the padded text length (0: none)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steady", type=int, default=10)
    ap.add_argument("--no-checks", action="store_true", help="the memory-pool checks off from the first step")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-graphs", action="store_true", help="without memory.cuda_graphs (the CPU)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import torch
    from torch._inductor import config as inductor

    from lorakit.bench.step import way_spec
    from lorakit.bench.ways import prepare
    from lorakit.models.batch import drop_full_mask
    from lorakit.train import dims

    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    lengths = [int(x) for x in a.lengths.split(",")]
    sets = a.set + ([] if a.no_graphs else ["memory.cuda_graphs=true"])
    cuda = a.device.startswith("cuda")
    counters = Counters()
    if cuda:
        counters.install()
    res = shapes[0][0]
    spec = way_spec(a.family, res, a.profile, 1, 0, "tiny" if a.tiny else "full", a.device, a.cap, sets)
    t0 = time.perf_counter()
    _, info = prepare({**spec, "way": "lorakit", "gpus": 1})
    tr = info["trainer"]
    print(f"built in {time.perf_counter() - t0:.1f} s: {json.dumps(info['settings'])}", flush=True)
    base = tr.data.batch
    sizes = [(w, h, lengths[0]) for w, h in shapes] + ([(*shapes[0], lengths[-1])] if len(lengths) > 1 else [])
    variants = [drop_full_mask(batch_of(base, tr.adapter, *size, 0, 0)) for size in sizes]  # each shape, a length
    carried: dict = {}
    packs: dict = {}
    found = dims.varying(tr, variants, carried, packs)  # as `lorakit train` marks them before the first compile
    dims.install(tr.transformer, found, carried, packs)
    print(f"symbolic: {dims.said(found) or 'none'}", flush=True)
    rows = []
    for i, (w, h, n, pad, label, checks) in enumerate(plan(shapes, lengths, a.pad, a.repeat, a.steady)):
        tr.data.batch = batch_of(base, tr.adapter, w, h, n, pad, i)
        tr.ahead.held = None  # drawn again from the batch just set
        inductor.triton.slow_path_cudagraph_asserts = checks and not a.no_checks
        before = counters.snapshot()
        retries = torch.cuda.memory_stats(a.device).get("num_alloc_retries", 0) if cuda else 0
        t = time.perf_counter()
        loss = tr.train_step()
        if cuda:
            torch.cuda.synchronize()
        row = {"step": i + 1, "what": label, "size": tr.last_size, "s": round(time.perf_counter() - t, 3),
               "loss": round(float(loss), 4)}
        after = counters.snapshot()
        row |= {k: round(after[k] - before[k], 3) if isinstance(after[k], float) else after[k] - before[k]
                for k in after}
        if cuda:
            row["alloc_retries"] = torch.cuda.memory_stats(a.device).get("num_alloc_retries", 0) - retries
            row["peak_gib"] = round(torch.cuda.max_memory_reserved(a.device) / 2**30, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for label in dict.fromkeys(r["what"] for r in rows):
        times = [r["s"] for r in rows if r["what"] == label]
        summary[label] = {"first": times[0], "then": times[1:3], "median_rest": round(statistics.median(times[2:]), 3)
                          if len(times) > 2 else None}
    print(json.dumps(summary, indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": info["settings"], "rows": rows, "summary": summary}, indent=1))
    return rows


if __name__ == "__main__":
    main()
