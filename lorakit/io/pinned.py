"""Page-locked host copies of many tensors, packed: the weights that stream to the GPU (`io.stream`) or swap with it
(`train.swap`) wait in host memory the GPU can copy from asynchronously.

torch's caching host allocator rounds every page-locked allocation up to a power of two: a 335 MB weight (one of
Mistral Small's MLP matrices) takes 512 MB. Pinned one by one, FLUX.2 [dev]'s 105 GiB of streamed weights took
about 1.6 times that in host memory (4x H200 host, 2026-11-26: two `lorakit infer` processes on it, each 24 or 32 GiB card's
plan streaming every block, reached 126 and 166 GiB of host memory before their first step, and the host's 251 GiB
ran out). Packed into chunks (page-locked by `locked`, not by that allocator), nothing is rounded; each copy goes
to the first chunk with room for it (H100, 2026-11-26: filling only the newest chunk left every chunk's tail unused when
the weights are a sizeable part of a chunk — 18.0 GiB held for 12.6 GiB of FLUX.2-shaped matrices, no better than one by one).
"""

from __future__ import annotations

import mmap
import os

GIB = 2**30
CHUNK = GIB  # bytes per page-locked chunk
ALIGN = 512  # every copy starts at a multiple of this (any dtype's element size; the GPU's copy engines like it)
PAGE = 4096  # bytes a host page holds (at least)
SPARE_GIB = 8.0  # host memory left to everything else, at least, beside what is pinned


def pinnable() -> int:
    """Bytes the host can page-lock now: its available memory less the rest of the system's share (SPARE_GIB or a
    tenth of the host, whichever is more). Asked when the copies are made: a process that has pinned some already
    sees less."""
    import psutil

    vm = psutil.virtual_memory()
    return max(0, int(vm.available - max(SPARE_GIB * GIB, 0.1 * vm.total)))


class _Mapped(mmap.mmap):
    """Anonymous host memory, page-locked once `address` is set; unlocked before it is unmapped."""

    address = 0

    def __del__(self):
        if self.address:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # the interpreter is ending (its modules gone): the process's exit frees it all
                pass


def _touch(t, threads: int = 8) -> None:
    """Fault in every page of `t` from several threads (the kernel zeroes each page as it first meets it)."""
    from concurrent.futures import ThreadPoolExecutor

    part = -(-t.numel() // (threads * PAGE)) * PAGE  # whole pages each (the tensor starts on a page: an mmap)
    with ThreadPoolExecutor(threads) as pool:  # a strided fill writes one byte a page, without the interpreter
        list(pool.map(lambda i: t[i * part:(i + 1) * part:PAGE].fill_(0), range(threads)))


def locked(n: int):
    """(a uint8 tensor of `n` bytes of page-locked host memory, 0) — or the same memory pageable and the CUDA error
    that refused to lock it. The pages are faulted in by several threads first, then registered with CUDA
    (cudaHostRegister). H100, 2026-11-27, 16 GiB in 1 GiB pieces from a thread beside a loop of matmuls on the main
    thread (docs/benchmarks-history.md): torch's `pin_memory` (cudaHostAlloc) took 11.1 s and held back the other
    thread's CUDA calls all along (the loop lost 11.1 s); faulted in by 16 threads (2.4 s, the loop unhindered), then
    registered (1.9 s), the loop lost 1.9 s. Copies from the GPU reach both at 52-54 GB/s (pageable: 12.6). A FLUX.1-dev
    full fine-tune's first background save on 2x H200 waited 8-15 s for the pinning and took an 18-23 s step."""
    import torch

    size = -(-n // PAGE) * PAGE  # whole pages: what is mapped and registered
    try:
        m = _Mapped(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous, private (as malloc's): a fork copies on write
    except OSError as e:
        raise MemoryError(f"no host memory for {n} bytes ({e.strerror})") from None
    t = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping (and its unlocking) alive
    _touch(t, min(8, os.cpu_count() or 1))
    error = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 1))  # 1: portable, every CUDA context
    if error == 0:
        m.address = t.data_ptr()
    return t[:n], error


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostArena:
    """Host copies of tensors, each a view into a chunk of page-locked memory (`pin`; pageable otherwise, as on a
    machine without CUDA). `expect`: the bytes that will be copied, if known — a smaller total takes one chunk of
    the next power of two instead of a whole CHUNK. `limit`: page-locked bytes at most (what the host has room
    for); the tensors beyond it wait where they are, pageable, counted in `pageable` — FLUX.2 [dev]'s 58.5 GiB
    transformer on a host with 51 GiB to spare streams 50 GiB of it page-locked, not all of it pageable (H100,
    2026-11-26: 10 steps at 1024² in 66 s against 83). A tensor subclass (a quantized weight that knows its own layout)
    is pinned on its own, as torch does it. `register`: the chunks are page-locked by `locked` (beside a running step)
    instead of torch's `pin_memory` (the streamed weights, pinned before the first step, keep torch's until `locked`
    has been run on a GPU for them)."""

    def __init__(self, pin: bool = True, expect: int | None = None, limit: int | None = None, register: bool = False):
        self.pin, self.register = pin, register
        self.chunk = CHUNK if not expect else min(CHUNK, 1 << max(_align(expect) - 1, 1).bit_length())
        self.limit = limit
        self.chunks: list = []
        self.used: list[int] = []  # bytes taken at the start of each chunk (a tensor larger than a chunk: all of its)
        self.copied = 0  # bytes of the tensors copied in
        self.pageable = 0  # bytes of the tensors left pageable: no room under `limit`
        self.alone = 0  # bytes of the tensor subclasses pinned on their own
        self.refused = 0  # the CUDA error that refused to page-lock a chunk (the arena is pageable from then on)

    @property
    def reserved(self) -> int:
        """Bytes of host memory the arena holds: its chunks and the tensors pinned on their own."""
        return sum(c.numel() for c in self.chunks) + self.alone

    def _alloc(self, n: int):
        import torch

        if not self.pin:
            return torch.empty(n, dtype=torch.uint8)
        if not self.register:
            return torch.empty(n, dtype=torch.uint8, pin_memory=True)
        t, error = locked(n)
        if error:  # page-locking refused (a memlock limit): this chunk and the next ones stay pageable, counted
            self.pin, self.refused = False, error
        return t

    def _place(self, n: int) -> tuple[int, int] | None:
        """(chunk, offset) for `n` bytes: the first chunk whose free tail holds them, else a new chunk (its own one
        where `n` is larger than a chunk, rounded by the allocator); None where a new chunk would pass `limit`."""
        if n <= self.chunk:
            for i, (buf, used) in enumerate(zip(self.chunks, self.used, strict=True)):
                if used + n <= buf.numel():
                    return i, used
        size = max(self.chunk, _align(n))
        if self.limit is not None and self.reserved + size > self.limit:
            return None
        self.chunks.append(self._alloc(size))
        self.used.append(0)
        return len(self.chunks) - 1, 0

    def host(self, t):
        """Where `t` waits on the host: its copy in the arena where it pins and `limit` leaves room, else `t` itself
        (moved to the CPU if it is not there)."""
        t = t.detach()
        t = t if t.device.type == "cpu" else t.to("cpu")
        if not self.pin:
            return t
        out = self.copy(t)
        if out is None:
            self.pageable += t.numel() * t.element_size()
            return t
        return out

    def copy(self, t):
        """`t`'s values in the arena (a tensor of its dtype and shape); None where `limit` leaves no room."""
        import torch

        t = t.detach()
        n = t.numel() * t.element_size()
        if type(t) is not torch.Tensor:
            if self.limit is not None and self.reserved + n > self.limit:
                return None
            t = t.to("cpu")
            if not self.pin:
                return t
            self.alone += n
            return t.pin_memory()
        out = self.empty(t.shape, t.dtype)
        if out is not None:
            out.copy_(t)
        return out

    def empty(self, shape, dtype, whole: bool = False):
        """Room in the arena for a tensor of `shape` and `dtype`, its values unset (what a later copy fills: the
        pinned buffers of a background checkpoint, `train.shards.Stager`); None where `limit` leaves none. `whole`:
        the tensor's storage is its own bytes alone, not the chunk's (a view's storage is the whole chunk, which
        torch.distributed.checkpoint's writer clones into fresh memory before writing: a second copy of a rank's
        state at every save, 2x H200, 2026-11-27); the chunk lives as long as the tensor."""
        import ctypes
        import math

        import torch

        n = math.prod(shape) * dtype.itemsize
        where = self._place(n)
        if where is None:
            return None
        i, off = where
        self.used[i] = _align(off + n)
        self.copied += n
        chunk = self.chunks[i]
        if not whole or n == 0:
            return chunk[off:off + n].view(dtype).view(shape)
        room = (ctypes.c_char * n).from_address(chunk.data_ptr() + off)
        room.chunk = chunk  # the buffer the tensor keeps holds the chunk
        return torch.frombuffer(room, dtype=torch.uint8).view(dtype).view(shape)
