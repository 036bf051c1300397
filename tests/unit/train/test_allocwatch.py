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


def test_each_part_has_its_own_memory_peak_and_the_run_keeps_the_largest():
    """The step, the other shapes' compile and the step-0 grid each report their own peak (the grid's decode was
    the one past a 24 GiB card's edge, hidden in one running maximum)."""
    from lorakit.train.allocwatch import PeakWatch

    now, resets = {"peak": 21 * 2**30}, []

    def reset():
        resets.append(now["peak"])
        now["peak"] = 19 * 2**30  # what stays allocated between parts

    w = PeakWatch(True, read=lambda: now["peak"], reset=reset)
    assert w.take() == 21.0 and w.run == 21.0
    now["peak"] = int(23.75 * 2**30)
    assert w.take() == 23.75 and w.run == 23.75
    assert w.take() == 19.0 and w.run == 23.75 and len(resets) == 3
    now["peak"] = 22 * 2**30  # the final grid: less than the run's peak
    assert w.whole() == 23.75
    assert PeakWatch(False).take() is None


def test_the_peak_is_read_from_the_allocators_counters_as_they_are(monkeypatch):
    """Read from torch's nested counters, not `max_memory_allocated` (which flattens and sorts them all, each read
    of a step); the reset starts the next part's peak."""
    import torch

    from lorakit.train.allocwatch import PeakWatch

    stats, resets = {"allocated_bytes": {"all": {"peak": 3 * 2**30, "current": 2**30}}}, []
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda *a, **k: stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("flattened")))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: resets.append(1))
    w = PeakWatch(True)
    assert w.take() == 3.0 and resets == [1] and w.whole() == 3.0
