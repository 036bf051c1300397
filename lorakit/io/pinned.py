"""Page-locked host copies of many tensors, packed: the weights that stream to the GPU (`io.stream`) or swap with it
(`train.swap`) wait in host memory the GPU can copy from asynchronously.

torch's caching host allocator rounds every page-locked allocation up to a power of two: a 335 MB weight (one of
Mistral Small's MLP matrices) takes 512 MB. Pinned one by one, FLUX.2 [dev]'s 105 GiB of streamed weights took
about 1.6 times that in host memory (session 26: two `lorakit infer` processes on one host, each 24 or 32 GiB card's
plan streaming every block, reached 126 and 166 GiB of host memory before their first step, and the host's 251 GiB
ran out). Packed into chunks whose size is itself a power of two, nothing is rounded: the waste is the last
chunk's unused tail.
"""

from __future__ import annotations

GIB = 2**30
CHUNK = GIB  # bytes per page-locked chunk (a power of two: the allocator takes it as it is)
ALIGN = 512  # every copy starts at a multiple of this (any dtype's element size; the GPU's copy engines like it)
SPARE_GIB = 8.0  # host memory left to everything else, at least, beside what is pinned


def room_for(nbytes: int) -> bool:
    """Does the host's available memory hold `nbytes` page-locked, leaving the rest of the system its share
    (SPARE_GIB or a tenth of the host, whichever is more)? Asked when the copies are made: a process that has
    pinned some already sees less."""
    import psutil

    vm = psutil.virtual_memory()
    return vm.available > nbytes + max(SPARE_GIB * GIB, 0.1 * vm.total)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostArena:
    """Host copies of tensors, each a view into a chunk of page-locked memory (`pin`; pageable otherwise, as on a
    machine without CUDA). `expect`: the bytes that will be copied, if known — a smaller total takes one chunk of
    the next power of two instead of a whole CHUNK. A tensor subclass (a quantized weight that knows its own
    layout) is pinned on its own, as torch does it."""

    def __init__(self, pin: bool = True, expect: int | None = None):
        self.pin = pin
        self.chunk = CHUNK if not expect else min(CHUNK, 1 << max(_align(expect) - 1, 1).bit_length())
        self.chunks: list = []
        self.open, self.used = None, 0  # the chunk being filled, and how far
        self.copied = 0  # bytes of the tensors copied in

    @property
    def reserved(self) -> int:
        """Bytes of host memory the chunks hold."""
        return sum(c.numel() for c in self.chunks)

    def _new(self, n: int):
        import torch

        buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
        self.chunks.append(buf)
        return buf

    def host(self, t):
        """Where `t` waits on the host: its copy in the arena where it pins, else `t` itself (moved to the CPU if it
        is not there)."""
        t = t.detach()
        t = t if t.device.type == "cpu" else t.to("cpu")
        return self.copy(t) if self.pin else t

    def copy(self, t):
        """`t`'s values in the arena (a tensor of its dtype and shape)."""
        import torch

        t = t.detach()
        if type(t) is not torch.Tensor:
            t = t.to("cpu")
            return t.pin_memory() if self.pin else t
        n = t.numel() * t.element_size()
        if n > self.chunk:  # larger than a chunk (no block's weight is): its own, rounded by the allocator
            buf, off = self._new(_align(n)), 0
        else:
            if self.open is None or self.used + n > self.chunk:
                self.open, self.used = self._new(self.chunk), 0
            buf, off = self.open, self.used
            self.used = _align(off + n)
        out = buf[off:off + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.copied += n
        return out
