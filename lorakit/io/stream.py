"""A module larger than the GPU, run on the GPU all the same: its weights stay in host memory and its repeated
blocks visit the GPU one at a time (diffusers' group offloading, pointed at the blocks wherever they sit; the next
one copied on a side stream while the current one computes where they sit at the top). A transformers text encoder keeps its
layers two or three levels down (`model.language_model.layers`), where a pipeline's `enable_group_offload` sees
one child and moves the whole language model at once — FLUX.2 [dev]'s 24 B Mistral encoder (45 GiB in bf16)
then runs out of memory on a 32 GiB card. Nothing is rounded: bf16 weights stay bf16, outputs are the same.

The host copies are page-locked (the copies run asynchronously) where the host has the memory for them beside
what it holds; elsewhere each block is locked on its way (slower, and nothing more is held than the mapped file).
"""

from __future__ import annotations

import math
from pathlib import Path

from lorakit.io.header import FLOATS, read_header
from lorakit.io.reader import resolve_files

GIB = 2**30
ROOM_GIB = 5.0  # what an encoder needs beside its weights to run (and the allocator's slack)


def folder_gib(folder, dtype_bytes: int) -> float | None:
    """A component's weights in GiB with its floats at `dtype_bytes` each (from its safetensors headers; None
    where the folder has no weight files)."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("*.safetensors*")):
        return None
    total = 0
    for f in resolve_files(folder):
        for info in read_header(f).tensors.values():
            total += math.prod(info.shape) * dtype_bytes if info.dtype in FLOATS else info.nbytes
    return round(total / GIB, 2)


def block_paths(module, share: float = 0.1) -> list[str]:
    """The names of the modules on the way from `module` to its lists of repeated blocks — lists holding at least
    `share` of its weights, not inside another such list (an attention's `to_out` list is no list of blocks) — the
    lists' own names not included: where group offloading must look inside instead of moving a child whole."""
    import torch

    total = module_bytes(module) or 1
    lists = [name for name, m in module.named_modules()
             if name and isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 1
             and module_bytes(m) >= share * total]
    outer = [n for n in lists if not any(n.startswith(o + ".") for o in lists)]
    return sorted({part for n in outer for part in n.split(".")[:-1]})


def module_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def stream(module, device, pinned: bool | None = None) -> dict:
    """Run `module` (its weights on the CPU) on `device` with its blocks streamed. `pinned`: page-locked host
    copies (None: where the host's available memory holds them with 8 GiB to spare). Returns what was done."""
    import psutil
    import torch
    from diffusers.hooks import apply_group_offloading

    size = module_bytes(module)
    if pinned is None:
        pinned = psutil.virtual_memory().available > size + 8 * GIB
    dev = torch.device(device)
    paths = block_paths(module)
    # the next block copied on a side stream while one computes: only where the blocks sit at the top (diffusers'
    # prefetch hooks of nested levels collide: "layer_execution_tracker already exists"); an encoder's pass is
    # bound by the copies either way (512 tokens compute in a fraction of a block's transfer)
    ahead = dev.type == "cuda" and not paths
    apply_group_offloading(module, onload_device=dev, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=ahead,
                           non_blocking=ahead, low_cpu_mem_usage=not pinned, block_modules=paths or None)
    return {"streamed_gib": round(size / GIB, 2), "pinned": pinned, "overlapped": ahead}
