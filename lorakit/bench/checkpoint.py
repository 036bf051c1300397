"""`lorakit bench checkpoint`: how fast a full fine-tune's checkpoint is written and read, next to what the disk
can do — sharded (torch.distributed.checkpoint, this process's shards, synchronous and the blocking part of an
asynchronous save), the gathered layout (the whole model in diffusers layout + the optimizer in state.pt, as rank 0
wrote before), and a sequential write/read of the same size with O_DIRECT (the disk's limit). The asynchronous save
is lorakit's (`train.shards.Stager`): timed twice, the first pinning its host buffers, the second reusing them; its
copy runs on a stream of its own, so the call returns at once and a run's step goes on beside the copy. The state is
a family's full-size transformer with random weights in bf16 on the GPU, plus AdamW's two moments (bf16, as
lorakit's bf16 AdamW keeps them) — or a share of them (`moments`), to fit the card."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from lorakit.bench.load import drop_cache
from lorakit.bench.ways import architecture
from lorakit.io import save_sharded
from lorakit.train.shards import WRITER_THREADS, Stager


def _size(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _model(family: str, device: str, size: str = "full"):
    import diffusers
    import torch

    name, config = architecture(family, size)
    with torch.device("meta"):
        model = getattr(diffusers, name)(**config)
    return {k: torch.randn(v.shape, device=device, dtype=torch.bfloat16) for k, v in model.state_dict().items()}


def _disk(folder: Path, gib: float, streams: tuple[int, ...] = (1, 2)) -> dict:
    """Sequential write then read of `gib` GiB with O_DIRECT (dd): the disk's own limit — by one stream, and by
    several at once (the GiB split between them), as several ranks write a sharded checkpoint."""
    out = {}
    for n in streams:
        files = [folder / f"dd{k}.bin" for k in range(n)]
        count = max(1, int(gib * 16 / n))  # 64 MiB blocks per stream
        for what, args in (("write", lambda f: ["if=/dev/zero", f"of={f}", "oflag=direct", "conv=fsync"]),
                           ("read", lambda f: [f"if={f}", "of=/dev/null", "iflag=direct"])):
            t0 = time.perf_counter()
            procs = [subprocess.Popen(["dd", *args(f), "bs=64M", f"count={count}"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for f in files]
            if any(p.wait() for p in procs):
                raise OSError(f"dd could not {what} {folder}")
            key = f"{what}_gb_per_s" if n == 1 else f"{what}_{n}_streams_gb_per_s"
            out[key] = round(n * count * 64 * 2**20 / 1e9 / (time.perf_counter() - t0), 2)
        for f in files:
            f.unlink()
    return out


PARTS = ("sharded", "async", "gathered", "disk")


def bench_checkpoint(family: str, folder: Path, moments: float = 2.0, device: str = "cuda",
                     parts: tuple[str, ...] = PARTS, size: str = "full") -> dict:
    """Time each way (of `parts`) on the same state; every file is removed after its measurement. size: "full"
    (the published architecture) or "tiny" (the test model, on a CPU)."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = _model(family, device, size)
    names = list(weights)
    optim = {}
    for k in range(int(moments + 0.999)):  # whole moments, then a share of the last one
        share = min(1.0, moments - k)
        keep = names[: int(len(names) * share)]
        optim.update({f"m{k}.{n}": torch.zeros_like(weights[n]) for n in keep})
    state = {"model": weights, "optim": optim}
    gb = (_size(weights) + _size(optim)) / 1e9
    out = {"family": family, "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
           "state_gb": round(gb, 2), "weights_gb": round(_size(weights) / 1e9, 2), "folder": str(folder),
           "free_gb_before": round(shutil.disk_usage(folder).free / 1e9, 1)}

    def timed(fn) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    ck = folder / "dcp"
    if "sharded" in parts:
        for threads in (1, WRITER_THREADS):  # torch's default writer, and lorakit's
            shutil.rmtree(ck, ignore_errors=True)
            s = timed(lambda t=threads: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ck), thread_count=t),
                                                 no_dist=True))
            out[f"sharded_save_{threads}_threads"] = {"s": round(s, 2), "gb_per_s": round(gb / s, 2),
                                                      "files": len(list(ck.iterdir()))}
        drop_cache([f for f in ck.rglob("*") if f.is_file()])
        s = timed(lambda: dcp.load(state, checkpoint_id=str(ck), no_dist=True))
        out["sharded_load_cold"] = {"s": round(s, 2), "gb_per_s": round(gb / s, 2)}
        shutil.rmtree(ck)
    if "async" in parts:
        stager = Stager(device.startswith("cuda"))  # lorakit's: pinned buffers, reused by the second save
        for save in ("async_save_first", "async_save_second"):
            box = {}
            call = timed(lambda b=box: b.update(r=dcp.async_save(state, storage_writer=dcp.FileSystemWriter(
                str(ck), thread_count=WRITER_THREADS), async_stager=stager, no_dist=True)))
            t0 = time.perf_counter()
            box["r"].staging_completion.result()
            copy = time.perf_counter() - t0
            box["r"].upload_completion.result()
            out[save] = {"call_s": round(call, 2), "copy_s": round(copy, 2),
                         "background_s": round(time.perf_counter() - t0, 2)}
            shutil.rmtree(ck)
        stager.close()
    if "gathered" in parts:
        def gathered():
            save_sharded({k: v.cpu() for k, v in weights.items()}, folder / "transformer")
            torch.save({k: v.cpu() for k, v in optim.items()}, folder / "state.pt")
            os.sync()

        s = timed(gathered)
        out["gathered_save"] = {"s": round(s, 2), "gb_per_s": round(gb / s, 2)}
        shutil.rmtree(folder / "transformer")
        (folder / "state.pt").unlink()
    if "disk" in parts:
        out["disk"] = _disk(folder, min(gb, shutil.disk_usage(folder).free / 2**30 * 0.8) / 1.07)
    return out
