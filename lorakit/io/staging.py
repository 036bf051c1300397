"""Host tensors (a mapped checkpoint's) to the GPU one after another, each copied into pinned memory by a worker
thread while the caller works on the one before.

A mapped tensor's `.to("cuda")` is a pageable copy: the CUDA driver copies it through a small staging buffer of
its own, on the calling thread, and nothing else happens meanwhile. Over an 8-bit base that is how every block
Linear reached the GPU (`train.quant.quantize_blocks`), and the whole prepare ran at ~1 GB/s (H100 host: Qwen-Image's
38 GiB in 40 s, FLUX.1's 22 GiB in 21-23 s, with the file in the page cache). Here a worker thread copies the next
tensors into pinned buffers (torch's copy, spread over its CPU threads, which also faults the mapped pages in),
and the caller's copy to the GPU is then an asynchronous DMA from pinned memory.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import torch

AHEAD = 2  # tensors the worker has ready or in hand (pinned memory held: about this many of the largest)


def _pinned(t: torch.Tensor | None, pin: bool) -> torch.Tensor | None:
    if t is None or t.device.type != "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t)
    return out


def staged(tensors: Iterable[torch.Tensor | None], device, ahead: int = AHEAD,
           pin: bool | None = None, stats: dict | None = None) -> Iterator[torch.Tensor | None]:
    """Yield each of `tensors` on `device`, in order (None stays None; a tensor already off the CPU is yielded as
    it is). For a CUDA device the worker copies up to `ahead` tensors into pinned memory before the caller asks
    for them (the caching host allocator reuses a pinned block only once its copy to the GPU has finished);
    `pin`: override (False: plain host buffers, for a machine without CUDA). `stats`: gets "waited_s", the
    seconds the caller waited for the worker's copies (the host side's share of the time)."""
    dev = torch.device(device)
    if pin is None:
        pin = dev.type == "cuda"
    items = iter(tensors)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorakit-staging") as ex:
        pending: deque = deque(ex.submit(_pinned, t, pin) for t in islice(items, max(ahead, 1)))
        while pending:
            t0 = time.perf_counter()
            ready = pending.popleft().result()
            if stats is not None:
                stats["waited_s"] = stats.get("waited_s", 0.0) + time.perf_counter() - t0
            for t in items:  # the next one starts before this one goes to the GPU
                pending.append(ex.submit(_pinned, t, pin))
                break
            yield None if ready is None else ready.to(dev, non_blocking=pin)
