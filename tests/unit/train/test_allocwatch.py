"""The allocator's per-step counts (lorakit.train.allocwatch): each step's own, recorded only where not zero."""

from __future__ import annotations

from lorakit.train.allocwatch import AllocWatch


def test_counts_are_per_step_and_only_where_not_zero():
    stats = {"num_alloc_retries": 3, "num_device_alloc": 40, "num_device_free": 2}
    w = AllocWatch(True, stats=lambda: dict(stats))  # what the run had done before its first step is not counted
    assert w.take() == {}
    stats.update(num_alloc_retries=5, num_device_alloc=41)
    assert w.take() == {"alloc_retries": 2, "cuda_mallocs": 1}
    assert w.take() == {}
    stats.update(num_device_alloc=44)
    assert w.take() == {"cuda_mallocs": 3}


def test_without_cuda_nothing_is_asked():
    w = AllocWatch(False, stats=lambda: (_ for _ in ()).throw(AssertionError("asked")))
    assert w.take() == {}
