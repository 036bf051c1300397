"""Block swapping: the frozen weights of N transformer blocks live in host memory and visit the GPU only while
their block runs — in the forward pass and in its recompute during backward (gradient checkpointing is
required: without it autograd would keep every visiting block's weights alive until backward). A recompute
stops as soon as it has what backward needs, before the block's forward hook runs, so a visitor also goes
home when the next block arrives, and every one after backward (`settle`).

Host copies are made once (page-locked, packed as `io.pinned` packs them, when `memory.pin_memory` and the host
has the room, so the copies run asynchronously); a visit is one host-to-device copy on a side stream, started
while the previous block computes, and leaving drops the GPU copy (the weights are frozen: nothing is copied
back). LoRA weights, gradients and optimizer states never move.
"""

from __future__ import annotations

from lorakit.errors import InputError
from lorakit.io.stream import block_entries, host_arena, place_rest, point


def repeated_blocks(transformer) -> list:
    """The transformer's repeated blocks in execution order (diffusers' `_repeated_blocks` classes; under FSDP2 a
    block's class is FSDP's subclass of it, named FSDP<class>)."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    return [m for m in transformer.modules() if type(m).__name__ in names or type(m).__name__[:4] == "FSDP"
            and type(m).__name__[4:] in names]


def swapped_names(transformer, n: int) -> tuple[str, ...]:
    """The module names of the blocks `BlockSwapper(transformer, n)` swaps: the last n."""
    ids = {id(b) for b in repeated_blocks(transformer)[-n:]} if n > 0 else set()
    return tuple(name for name, m in transformer.named_modules() if id(m) in ids)


class BlockSwapper:
    def __init__(self, transformer, n: int, device: str, pin: bool = True):
        import torch

        blocks = repeated_blocks(transformer)
        if not blocks:
            raise InputError("memory.blocks_to_swap: this transformer declares no repeated blocks")
        if n >= len(blocks):
            raise InputError(f"memory.blocks_to_swap={n}, but the transformer has {len(blocks)} blocks",
                             f"at most {len(blocks) - 1}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.blocks = blocks[-n:]  # the last ones: the first blocks start every step without waiting
        self.host: dict[int, list] = {}  # block index -> [(owner module, kind, name, host tensor)]
        self.ready: dict[int, object] = {}  # block index -> (tensors on the GPU, copy-done event)
        self.visiting: set[int] = set()  # blocks whose weights point at GPU copies now
        self.last = -1  # the block visited last: forward runs up the list, the recompute in backward down it
        self.arena = host_arena(self.blocks, self.device, pin)  # pageable where it cannot pin (slower visits)
        for i, b in enumerate(self.blocks):
            self.host[i] = block_entries(b, self.arena.host)  # the base, before any LoRA exists
            self._point(i, [e[3] for e in self.host[i]])  # rest on the host
            b.register_forward_pre_hook(self._make_in(i))
            b.register_forward_hook(self._make_out(i))

    def said(self) -> str:
        """Where the swapped blocks' weights wait, in words (the prepare phase's facts)."""
        a = self.arena
        if not self.cuda:
            where = "host memory"
        elif self.pinned:
            where = f"page-locked host memory ({a.reserved / 2**30:.1f} GiB)"
        elif a.reserved:
            where = (f"page-locked host memory ({a.reserved / 2**30:.1f} GiB) and pageable ({a.pageable / 2**30:.1f}"
                     " GiB: the host had no room to page-lock more; slower visits)")
        else:
            where = "pageable host memory (no room to page-lock them, or memory.pin_memory off: slower visits)"
        return f"{len(self.blocks)} blocks in {where}"

    @property
    def pinned(self) -> bool:
        """Are all the swapped blocks' host copies page-locked?"""
        return self.arena.pin and self.arena.pageable == 0

    def place_rest(self, transformer) -> None:
        """Move every tensor that is not swapped to the GPU (instead of `transformer.to(device)`)."""
        place_rest(transformer, [e for entries in self.host.values() for e in entries], self.device)

    def _point(self, i: int, tensors) -> None:
        point(self.host[i], tensors)

    def _fetch(self, i: int) -> None:
        """Start copying block i's weights to the GPU (side stream on CUDA)."""
        import torch

        if i in self.ready or not 0 <= i < len(self.blocks):
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                gpu = [e[3].to(self.device, non_blocking=True) for e in self.host[i]]
                ev = torch.cuda.Event()
                ev.record(self.stream)
        else:
            gpu, ev = [e[3].to(self.device, copy=True) for e in self.host[i]], None
        self.ready[i] = (gpu, ev)

    def _make_in(self, i: int):
        def hook(module, args):
            import torch

            for j in list(self.visiting - {i}):  # a recompute in backward stops early, before the block's
                self._rest(j)  # forward hook: the previous visitor goes home here (its backward is done)
            self._fetch(i)
            gpu, ev = self.ready.pop(i)
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
                for t in gpu:  # used on the compute stream: keep the allocator from reusing it early
                    t.record_stream(torch.cuda.current_stream(self.device))
            self._point(i, gpu)
            self.visiting.add(i)
            step = -1 if self.last == i + 1 else 1
            self.last = i
            self._fetch(i + step)  # the next block to run travels while this one computes
        return hook

    def _rest(self, i: int) -> None:
        self._point(i, [e[3] for e in self.host[i]])  # the GPU copy is freed once autograd no longer needs it
        self.visiting.discard(i)

    def settle(self) -> None:
        """Send every visitor home and drop prefetched copies (after backward, before sampling or saving)."""
        for j in list(self.visiting):
            self._rest(j)
        self.ready.clear()
        self.last = -1

    def _make_out(self, i: int):
        def hook(module, args, output):
            self._rest(i)
        return hook
