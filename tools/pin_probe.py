"""Page-locking host copies of streamed weights, the ways lorakit could (a lent GPU machine; session 26's question).

Session 26: `lorakit infer` on FLUX.2 [dev] under a 24 GiB card spent 240 s placing 105 GiB of weights in pinned
host memory, one `pin_memory()` per weight (torch rounds each up to a power of two: 166 GiB held). lorakit now packs
them (`io.pinned.HostArena`). This measures, for GIB of weights shaped like FLUX.2 [dev]'s block matrices, each way
in a fresh process (the allocator's settings are read at CUDA's start):
  per-tensor   each weight `.pin_memory()` (the old way)
  arena        `HostArena` (1 GiB chunks)
  arena+reg    the same with PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
  pageable     no page-locking (the fallback where the host has no room)
and reports seconds to place, host memory held (anonymous + shared, `bench.matrix.private_gib`), and the GB/s of
sending every weight to the GPU once (what each visit of a denoising step costs).

    bash scripts/device.sh python3 tools/pin_probe.py --gib 24
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = [(6144, 6144), (18432, 6144), (6144, 18432), (6144, 55296), (5120, 32768)]  # FLUX.2 [dev], Mistral MLP
WAYS = {"per-tensor": {}, "arena": {}, "pageable": {},
        "arena+reg": {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"}}


def one(way: str, gib: float) -> dict:
    import torch

    from lorakit.bench.matrix import private_gib
    from lorakit.io.pinned import HostArena

    torch.cuda.init()
    src, total, i = [], 0, 0
    while total < gib * 2**30:
        t = torch.empty(SHAPES[i % len(SHAPES)], dtype=torch.bfloat16).normal_()
        src.append(t)
        total += t.numel() * 2
        i += 1
    before = private_gib(os.getpid())
    t0 = time.perf_counter()
    if way == "per-tensor":
        host = [t.pin_memory() for t in src]
    elif way.startswith("arena"):
        arena = HostArena(True, expect=total)
        host = [arena.copy(t) for t in src]
    else:
        host = src
    placed = time.perf_counter() - t0
    held = private_gib(os.getpid()) - before
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in host:
        t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    send = time.perf_counter() - t0
    return {"way": way, "weights_gib": round(total / 2**30, 2), "place_s": round(placed, 2),
            "held_gib": round(held, 2), "send_gb_per_s": round(total / send / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--way", choices=list(WAYS))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for each way")
    a = ap.parse_args()
    if a.way:
        print(json.dumps(one(a.way, a.gib)))
        return
    for way, env in WAYS.items():
        try:
            r = subprocess.run([sys.executable, __file__, "--gib", str(a.gib), "--way", way], capture_output=True,
                               text=True, env={**os.environ, **env}, timeout=a.timeout)
        except subprocess.TimeoutExpired:  # session 27, H100: arena+reg had not finished 12 GiB in 280 s
            print(json.dumps({"way": way, "error": f"not done in {a.timeout:.0f} s"}), flush=True)
            continue
        print(r.stdout.strip() or json.dumps({"way": way, "error": r.stderr[-300:]}), flush=True)


if __name__ == "__main__":
    main()
