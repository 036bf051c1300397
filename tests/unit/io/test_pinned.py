"""Host copies packed into chunks (`io.pinned`): the same values, each copy aligned, nothing rounded up, the chunks'
free tails filled; page-locked on a GPU machine."""

import pytest
import torch

from lorakit.io import pinned
from lorakit.io.pinned import ALIGN, HostArena, pinnable


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(33, 17, generator=g).to(torch.bfloat16), torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
            torch.rand(7, generator=g) > 0.5, torch.arange(11), torch.tensor(2.5), torch.empty(0, 4),
            torch.randn(8, 6, generator=g).t(),  # not contiguous
            torch.randn(64, 64, generator=g)]


def test_each_copy_holds_the_same_values_dtype_and_shape_at_an_aligned_place():
    arena = HostArena(pin=False)
    src = _tensors()
    out = [arena.copy(t) for t in src]
    for a, b in zip(src, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.float(), b.float())
        assert b.numel() == 0 or (b.data_ptr() - arena.chunks[0].data_ptr()) % ALIGN == 0
    assert len(arena.chunks) == 1 and arena.copied == sum(t.numel() * t.element_size() for t in src)
    src[0].zero_()
    assert out[0].abs().sum() > 0  # copies, not views of the originals


def test_the_chunk_is_the_next_power_of_two_of_what_is_expected_and_only_its_tail_is_unused():
    src = [torch.ones(1000, dtype=torch.bfloat16) for _ in range(10)]  # 2,000 bytes each, 2,048 aligned
    arena = HostArena(pin=False, expect=sum(t.numel() * t.element_size() for t in src))
    for t in src:
        arena.copy(t)
    assert arena.chunk == 32768 and arena.reserved == 32768  # 20,480 bytes packed; one tensor each: 10 x 2,048
    few = HostArena(pin=False, expect=10)  # less expected than comes: each larger copy its own chunk, still right
    out = [few.copy(t) for t in src]
    assert few.chunk == ALIGN and len(few.chunks) == 10 and all(torch.equal(a, b) for a, b in zip(src, out, strict=True))


def test_a_tensor_larger_than_a_chunk_takes_its_own_and_the_open_chunk_goes_on_filling(monkeypatch):
    monkeypatch.setattr(pinned, "CHUNK", 4096)
    arena = HostArena(pin=False)
    small, big, after = torch.ones(100), torch.full((2000,), 2.0), torch.full((100,), 3.0)
    a, b, c = arena.copy(small), arena.copy(big), arena.copy(after)
    assert len(arena.chunks) == 2 and b.data_ptr() == arena.chunks[1].data_ptr()
    assert c.data_ptr() - a.data_ptr() == 512  # beside the first, in the open chunk (not inside the large one)
    assert torch.equal(b, big) and torch.equal(c, after) and torch.equal(a, small)


def test_whole_room_has_a_storage_of_its_own_bytes_inside_the_chunk_that_it_keeps_alive():
    """What torch.distributed.checkpoint's writer takes as it is: a view's storage is the whole chunk, and the writer
    clones such a tensor into fresh memory before writing it."""
    import gc

    arena = HostArena(pin=False)
    a = arena.empty((33, 17), torch.bfloat16, whole=True)
    b = arena.empty((5,), torch.float32, whole=True)
    view = arena.empty((4,), torch.float32)
    chunk = arena.chunks[0]
    for t in (a, b):
        assert t.untyped_storage().size() == t.nbytes and t.shape in ((33, 17), (5,))
        assert chunk.data_ptr() <= t.data_ptr() < chunk.data_ptr() + chunk.numel() - t.nbytes + 1
    assert view.untyped_storage().size() == chunk.numel()
    assert (b.data_ptr() - a.data_ptr()) % ALIGN == 0 and b.data_ptr() >= a.data_ptr() + a.nbytes
    b.copy_(torch.arange(5.0))
    assert torch.equal(chunk[b.data_ptr() - chunk.data_ptr():][:20].view(torch.float32), torch.arange(5.0))
    del arena, chunk, view, a
    gc.collect()
    big = torch.full((1 << 20,), 7.0)  # memory the chunk would have gone back to
    assert torch.equal(b, torch.arange(5.0)) and big[0] == 7.0  # b still holds the chunk


def test_weights_a_sizeable_part_of_a_chunk_fill_every_chunks_free_tail(monkeypatch):
    """On an H100, 2026-11-26: FLUX.2 [dev]'s block matrices (72, 216, 216, 648 and 320 MiB in
    1 GiB chunks), each copied into the newest chunk only, held 18.0 GiB for 12.6 GiB of weights (1.43x, no better
    than pinning one by one). Here at 1/16384 of the size."""
    monkeypatch.setattr(pinned, "CHUNK", 65536)
    arena = HostArena(pin=False)
    sizes = [72, 216, 216, 648, 320] * 9  # units of 64 bytes: a chunk holds 1,024
    out = [arena.copy(torch.full((n * 64,), i % 251, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    assert arena.copied == sum(sizes) * 64 and arena.reserved <= 1.12 * arena.copied  # was 1.39
    assert all(int(t[0]) == int(t[-1]) == i % 251 for i, t in enumerate(out))  # none overlaps another


def test_room_is_what_the_host_has_available_beyond_its_share_for_everything_else(monkeypatch):
    class VM:
        total, available = 128 * 2**30, 100 * 2**30

    monkeypatch.setattr("psutil.virtual_memory", lambda: VM)
    assert pinnable() == int(100 * 2**30 - 12.8 * 2**30)  # 100 available - 12.8 (a tenth of 128, more than 8)
    VM.available = 10 * 2**30
    assert pinnable() == 0


def test_beyond_its_limit_the_arena_leaves_tensors_pageable_and_counts_them(monkeypatch):
    """A host with room for part of a component: the copies fill chunks up to the limit, the rest stay where they
    are (the mapped or loaded tensors, pageable), and `pageable` says how much."""
    monkeypatch.setattr("lorakit.io.pinned.CHUNK", 4096)
    made = []
    monkeypatch.setattr(HostArena, "_alloc", lambda self, n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    src = [torch.full((256,), i, dtype=torch.float32) for i in range(10)]  # 1 KiB each: 4 to a chunk
    arena = HostArena(pin=True, limit=2 * 4096 + 100)  # room for two chunks
    out = [arena.host(t) for t in src]
    assert made == [4096, 4096] and arena.reserved == 8192 <= arena.limit
    same = [o.data_ptr() == t.data_ptr() for o, t in zip(out, src, strict=True)]
    assert same == [False] * 8 + [True] * 2  # the first eight copied, the last two left as they are
    assert arena.copied == 8 * 1024 and arena.pageable == 2 * 1024
    assert all(torch.equal(o, t) for o, t in zip(out, src, strict=True))
    none = HostArena(pin=True, limit=0)
    assert none.host(src[0]).data_ptr() == src[0].data_ptr() and none.pageable == 1024 and none.reserved == 0 and not made[2:]


def _mapping(address: int) -> list[str]:
    """The /proc/self/maps line (split) of the mapping that holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()
    raise AssertionError(f"{address:#x} is in no mapping")


class _Cudart:
    """What `locked` asks of CUDA, recorded: the registrations (address, bytes, flags) and unregistrations."""

    def __init__(self, answer=0):
        self.answer, self.registered, self.unregistered = answer, [], []

    def cudaHostRegister(self, ptr, n, flags):
        self.registered.append((ptr, n, flags))
        return self.answer

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_a_chunk_is_faulted_in_registered_once_and_unregistered_when_the_last_tensor_on_it_goes(monkeypatch):
    import gc

    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(pinned, "CHUNK", 1 << 20)
    arena = HostArena(pin=True, register=True)
    src = _tensors()
    out = [arena.copy(t) for t in src]
    whole = arena.empty((3, 5), torch.float32, whole=True)
    ((ptr, n, flags),) = cudart.registered
    assert ptr == arena.chunks[0].data_ptr() and n == 1 << 20 and flags == 1 and not arena.refused
    assert _mapping(ptr)[1] == "rw-p"  # private anonymous memory, as malloc's (a shared one is shmem: a fork shares it)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(src, out, strict=True))
    del arena, out
    gc.collect()
    assert cudart.unregistered == []  # `whole` still holds the chunk
    whole.fill_(1.0)
    del whole
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_a_lock_maps_and_registers_whole_pages_and_gives_the_bytes_asked_for(monkeypatch):
    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    t, error = pinned.locked(3 * pinned.PAGE + 512)
    assert error == 0 and t.numel() == 3 * pinned.PAGE + 512 and t.dtype == torch.uint8
    assert cudart.registered == [(t.data_ptr(), 4 * pinned.PAGE, 1)] and t.data_ptr() % pinned.PAGE == 0


def test_a_refused_page_lock_leaves_the_arena_pageable_and_says_which_error(monkeypatch):
    cudart = _Cudart(answer=2)  # cudaErrorMemoryAllocation: a memlock limit, say
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(pinned, "CHUNK", 4096)
    arena = HostArena(pin=True, register=True)
    src = [torch.full((600,), float(i)) for i in range(3)]  # 2,400 bytes each: one a chunk
    out = [arena.host(t) for t in src]
    assert len(cudart.registered) == 1 and arena.refused == 2 and not arena.pin  # asked once, not again
    assert all(torch.equal(a, b) for a, b in zip(src, out, strict=True)) and cudart.unregistered == []


def test_pages_are_faulted_in_by_several_threads_and_keep_their_values():
    for pages in (1, 3, 9):
        t = torch.full((pages * pinned.PAGE + 5,), 7, dtype=torch.uint8)
        pinned._touch(t, threads=4)
        written = (t == 0).nonzero().flatten() // pinned.PAGE
        assert written.tolist() == list(range(pages + 1))  # one byte on each page, the last partial one too


@pytest.mark.gpu
@pytest.mark.parametrize("register", [False, True], ids=["pin_memory", "registered"])
def test_the_copies_are_page_locked_and_reach_the_gpu_asynchronously(register):
    arena = HostArena(pin=True, register=register)
    src = _tensors()
    out = [arena.copy(t) for t in src]
    assert all(t.is_pinned() for t in out)
    back = [t.to("cuda", non_blocking=True) for t in out]
    torch.cuda.synchronize()
    assert all(torch.equal(a.float(), b.cpu().float()) for a, b in zip(src, back, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("register", [False, True], ids=["pin_memory", "registered"])
def test_whole_room_is_page_locked_and_takes_an_asynchronous_copy_from_the_gpu(register):
    arena = HostArena(pin=True, register=register)
    src = [t.cuda() for t in _tensors() if t.numel()]
    out = [arena.empty(t.shape, t.dtype, whole=True) for t in src]
    assert all(t.is_pinned() and t.untyped_storage().size() == t.nbytes for t in out)
    for o, t in zip(out, src, strict=True):
        o.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(o.float(), t.cpu().float()) for o, t in zip(out, src, strict=True))


@pytest.mark.gpu
def test_a_limited_arena_page_locks_what_fits_and_the_rest_still_reaches_the_gpu(monkeypatch):
    monkeypatch.setattr(pinned, "CHUNK", 4096)
    arena = HostArena(pin=True, limit=4096)
    src = [torch.randn(256) for _ in range(6)]  # 1 KiB each: four fill the one chunk the limit allows
    out = [arena.host(t) for t in src]
    assert [o.is_pinned() for o in out] == [True] * 4 + [False] * 2 and arena.pageable == 2048
    back = [o.to("cuda", non_blocking=True) for o in out]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b.cpu()) for a, b in zip(src, back, strict=True))
