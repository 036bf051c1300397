"""A module larger than the GPU, run on the GPU all the same: its repeated blocks stay in host memory and visit
the GPU one at a time, each while it runs; what is not in a block (embeddings, norms, an LM head: a few GiB at
most) stays on the GPU. A visit copies the block's host tensors to the GPU and its end drops the copies — nothing
is copied back (the weights are frozen), as `placement.Swap` does for whole components. A transformers text
encoder keeps its layers two or three levels down (`model.language_model.layers`), where a pipeline's
`enable_group_offload` sees one child and moves the whole language model at once: FLUX.2 [dev]'s 24 B Mistral
encoder (45 GiB in bf16) then ran out of memory on a 32 GiB card; and diffusers' group offload without a side
stream copies each block back to new host memory after it runs (`_offload_to_memory`: the FLUX.2 [dev] cache took
312 s for six items under a 32 GiB cap on an H200 host that way).
Nothing is rounded: bf16 weights stay bf16, outputs are the same.

The host copies are page-locked (fast, asynchronous copies), packed (`io.pinned`: nothing rounded up), as far as
the host has the memory for them beside what it holds; the rest are copied from the mapped or loaded tensors as
they are (slower).
"""

from __future__ import annotations

import math
from pathlib import Path

from lorakit.io.header import FLOATS, read_header
from lorakit.io.pinned import HostArena, pinnable
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


def too_large(gib: float, budget_gib: float) -> bool:
    """Does a component of `gib` not fit a GPU of `budget_gib` with room to run (so it streams)? The cache and
    `infer`'s placement ask the same question of a text encoder."""
    return gib + ROOM_GIB > budget_gib


def host_arena(blocks, device, pin: bool = True) -> HostArena:
    """Where the host copies of `blocks` wait (`io.pinned`): page-locked and packed where `device` is a GPU and `pin`
    asks for it, as many as the host's available memory holds (`io.pinned.pinnable`), the rest pageable; all
    pageable otherwise."""
    import torch

    size = sum(module_bytes(b) for b in blocks)
    want = bool(pin) and torch.device(device).type == "cuda"
    room = pinnable() if want else 0
    return HostArena(room > 0, expect=size, limit=room)


def stream(module, device, pinned: bool = True) -> dict:
    """Run `module` (its weights on the CPU) on `device`: each block visits while it runs, the rest moves there.
    `pinned`: page-locked host copies as far as the host has room (`host_arena`). Returns what was done: `pinned`
    is true where every streamed byte is page-locked, `pageable_gib` says how much is not."""
    import torch

    size = module_bytes(module)
    blocks = [b for lst in block_lists(module) for b in lst]
    dev = torch.device(device)
    arena = host_arena(blocks, dev, pinned)
    every: list = []
    for b in blocks:
        entries = block_entries(b, arena.host)
        hosts = [e[3] for e in entries]
        point(entries, hosts)
        b.register_forward_pre_hook(_bring(entries, hosts, dev))
        b.register_forward_hook(lambda m, a, o, entries=entries, hosts=hosts: point(entries, hosts))
        every += entries
    place_rest(module, every, dev)  # the rest: on the device for good
    streamed = sum(e[3].numel() * e[3].element_size() for e in every)
    pageable = arena.pageable if arena.pin else streamed  # not page-locked at all: every streamed byte
    return {"streamed_gib": round(streamed / GIB, 2), "resident_gib": round((size - streamed) / GIB, 2),
            "blocks": len(blocks), "pinned": arena.pin and pageable == 0,
            "pinned_gib": round(arena.reserved / GIB, 2), "pageable_gib": round(pageable / GIB, 2)}


def block_entries(block, to_host) -> list:
    """(owner module, "param" | "buffer", name, host tensor) for every parameter and buffer of `block`, its host
    tensor `to_host(tensor)`: what a visit points at copies on the GPU and its end back at the host (`point`).
    `stream` and `train.swap.BlockSwapper` (training's swapped blocks) visit blocks this way."""
    entries = []
    for mod in block.modules():
        for name, p in mod.named_parameters(recurse=False):
            entries.append((mod, "param", name, to_host(p.data)))
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None:
                entries.append((mod, "buffer", name, to_host(buf)))
    return entries


def point(entries, tensors) -> None:
    """Each entry's parameter or buffer to the given tensor (its host copy, or its copy on the device)."""
    for (mod, kind, name, _), t in zip(entries, tensors, strict=True):
        if kind == "param":
            getattr(mod, name).data = t
        else:
            mod._buffers[name] = t


def place_rest(module, entries, device) -> None:
    """Every parameter and buffer of `module` that none of `entries` owns to `device`, for good."""
    owned = {(id(m), k, n) for m, k, n, _ in entries}
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if (id(mod), "param", name) not in owned:
                p.data = p.data.to(device)
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and (id(mod), "buffer", name) not in owned:
                mod._buffers[name] = buf.to(device)


def _bring(entries, hosts, dev):
    def hook(module, args):  # copied on the compute stream: ordered before the block's kernels and its end
        point(entries, [t.to(dev, non_blocking=True) for t in hosts])
    return hook
