"""A module larger than the GPU, run on the GPU all the same: its repeated blocks stay in host memory and visit
the GPU one at a time, each while it runs (diffusers' group offloading, applied to each block); what is not in a
block (embeddings, norms, an LM head: a few GiB at most) stays on the GPU. A transformers text encoder keeps its
layers two or three levels down (`model.language_model.layers`), where a pipeline's `enable_group_offload` sees
one child and moves the whole language model at once — FLUX.2 [dev]'s 24 B Mistral encoder (45 GiB in bf16)
then ran out of memory on a 32 GiB card. Nothing is rounded: bf16 weights stay bf16, outputs are the same.

The host copies are page-locked (fast copies) where the host has the memory for them beside what it holds;
elsewhere each block is locked on its way (slower, and nothing more is held than the mapped file). A pass is bound
by the copies (an encoder's 512 tokens compute in a fraction of a block's transfer).
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


def block_lists(module, share: float = 0.1) -> list:
    """The module's lists of repeated blocks: lists holding at least `share` of its weights, not inside another
    such list (an attention's `to_out` list is no list of blocks)."""
    import torch

    total = module_bytes(module) or 1
    lists = [(name, m) for name, m in module.named_modules()
             if name and isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m)
             and module_bytes(m) >= share * total]
    return [m for name, m in lists if not any(name.startswith(o + ".") for o, _ in lists)]


def module_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def stream(module, device, pinned: bool | None = None) -> dict:
    """Run `module` (its weights on the CPU) on `device`: each block visits while it runs, the rest moves there.
    `pinned`: page-locked host copies (None: where the host's available memory holds them with 8 GiB to spare).
    Returns what was done."""
    import psutil
    import torch
    from diffusers.hooks import apply_group_offloading

    size = module_bytes(module)
    if pinned is None:
        pinned = psutil.virtual_memory().available > size + 8 * GIB
    dev = torch.device(device)
    blocks = [b for lst in block_lists(module) for b in lst]
    for b in blocks:  # a block's children are one group: on the device while the block runs, then home
        apply_group_offloading(b, onload_device=dev, offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1, low_cpu_mem_usage=not pinned)
    inside = {id(t) for b in blocks for t in (*b.parameters(), *b.buffers())}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if id(p) not in inside:
                p.data = p.data.to(dev)
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and id(buf) not in inside:
                m._buffers[name] = buf.to(dev)
    resident = sum(t.numel() * t.element_size() for m in module.modules()
                   for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if id(t) not in inside)
    return {"streamed_gib": round((size - resident) / GIB, 2), "resident_gib": round(resident / GIB, 2),
            "blocks": len(blocks), "pinned": pinned}
