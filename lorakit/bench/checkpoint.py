"""`lorakit bench checkpoint`: how fast a full fine-tune's checkpoint is written and read, next to what the disk
can do — sharded (torch.distributed.checkpoint, this process's shards, synchronous and the blocking part of an
asynchronous save), the gathered layout (the whole model in diffusers layout + the optimizer in state.pt, as rank 0
wrote before), and a sequential write/read of the same size with O_DIRECT (the disk's limit). The state is a
family's full-size transformer with random weights in bf16 on the GPU, plus AdamW's two moments (bf16, as
lorakit's bf16 AdamW keeps them) — or a share of them (`moments`), to fit the card."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from lorakit.io import save_sharded
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info
from lorakit.train.shards import WRITER_THREADS


def _size(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _model(family: str, device: str):
    import diffusers
    import torch

    adapter = family_adapter(family)
    cls = getattr(diffusers, family_info(family).transformer_class)
    with torch.device("meta"):
        model = cls(**adapter.full_config)
    return {k: torch.randn(v.shape, device=device, dtype=torch.bfloat16) for k, v in model.state_dict().items()}


def _disk(folder: Path, gib: float) -> dict:
    """Sequential write then read of `gib` GiB with O_DIRECT (dd): the disk's own limit."""
    f = folder / "dd.bin"
    count = max(1, int(gib * 16))  # 64 MiB blocks
    out = {}
    for what, args in (("write", ["if=/dev/zero", f"of={f}", "oflag=direct", "conv=fsync"]),
                       ("read", [f"if={f}", "of=/dev/null", "iflag=direct"])):
        t0 = time.perf_counter()
        subprocess.run(["dd", *args, "bs=64M", f"count={count}"], check=True, capture_output=True)
        out[f"{what}_gb_per_s"] = round(count * 64 * 2**20 / 1e9 / (time.perf_counter() - t0), 2)
    f.unlink()
    return out


def bench_checkpoint(family: str, folder: Path, moments: float = 2.0, device: str = "cuda") -> dict:
    """Time each way on the same state; every file is removed after its measurement."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = _model(family, device)
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
    for threads in (1, WRITER_THREADS):  # torch's default writer, and lorakit's
        shutil.rmtree(ck, ignore_errors=True)
        s = timed(lambda t=threads: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ck), thread_count=t),
                                             no_dist=True))
        out[f"sharded_save_{threads}_threads"] = {"s": round(s, 2), "gb_per_s": round(gb / s, 2),
                                                  "files": len(list(ck.iterdir()))}
    _drop(ck)
    s = timed(lambda: dcp.load(state, checkpoint_id=str(ck), no_dist=True))
    out["sharded_load_cold"] = {"s": round(s, 2), "gb_per_s": round(gb / s, 2)}
    shutil.rmtree(ck)
    box = {}
    s = timed(lambda: box.update(f=dcp.async_save(state, storage_writer=dcp.FileSystemWriter(
        str(ck), thread_count=WRITER_THREADS), no_dist=True)))
    t0 = time.perf_counter()
    box["f"].result()
    out["async_save"] = {"blocking_s": round(s, 2), "background_s": round(time.perf_counter() - t0, 2)}
    shutil.rmtree(ck)

    def gathered():
        save_sharded({k: v.cpu() for k, v in weights.items()}, folder / "transformer")
        torch.save({k: v.cpu() for k, v in optim.items()}, folder / "state.pt")
        os.sync()

    s = timed(gathered)
    out["gathered_save"] = {"s": round(s, 2), "gb_per_s": round(gb / s, 2)}
    shutil.rmtree(folder / "transformer")
    (folder / "state.pt").unlink()
    out["disk"] = _disk(folder, min(gb, shutil.disk_usage(folder).free / 2**30 * 0.8) / 1.07)
    return out


def _drop(path: Path) -> None:
    """The page cache of the files under `path` (POSIX_FADV_DONTNEED), so the load reads the disk."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
