"""Host tensors staged to a device by a worker one step ahead (lorakit.io.staging): in order, equal, None kept,
and the worker never more than `ahead` tensors ahead of the caller."""

from __future__ import annotations

import threading

import torch

from lorakit.io import staging
from lorakit.io.staging import staged


def test_each_tensor_arrives_in_order_equal_and_none_stays_none():
    src = [torch.randn(3, 4), None, torch.arange(5), torch.randn(2, dtype=torch.bfloat16)]
    got = list(staged(iter(src), "cpu", pin=False))
    assert got[1] is None and len(got) == 4
    for a, b in zip(src, got, strict=True):
        if a is not None:
            assert b.dtype == a.dtype and torch.equal(a, b) and b.data_ptr() != a.data_ptr()  # a copy


def test_the_worker_is_at_most_ahead_tensors_ahead(monkeypatch):
    copied, lock = [], threading.Lock()
    real = staging._pinned

    def counting(t, pin):
        with lock:
            copied.append(int(t[0]))
        return real(t, pin)

    monkeypatch.setattr(staging, "_pinned", counting)
    gen = staged((torch.tensor([i]) for i in range(10)), "cpu", ahead=2, pin=False)
    for i, t in enumerate(gen):
        assert int(t[0]) == i
        with lock:
            assert len(copied) <= i + 1 + 2  # this one, and at most two more
    assert copied == list(range(10))


def test_a_caller_that_stops_early_leaves_no_worker_behind():
    gen = staged((torch.zeros(1000) for _ in range(100)), "cpu", pin=False)
    next(gen)
    gen.close()
    assert not any(t.name.startswith("lorakit-staging") and t.is_alive() for t in threading.enumerate())


def test_a_tensor_already_on_the_device_is_yielded_as_it_is():
    t = torch.zeros(3, device="meta")
    assert next(staged([t], "meta", pin=False)) is t


def test_the_callers_wait_for_the_worker_is_counted(monkeypatch):
    import time

    real = staging._pinned

    def slow(t, pin):
        time.sleep(0.05)
        return real(t, pin)

    monkeypatch.setattr(staging, "_pinned", slow)
    stats = {}
    assert len(list(staged((torch.zeros(10) for _ in range(4)), "cpu", ahead=1, pin=False, stats=stats))) == 4
    assert 0.15 <= stats["waited_s"] < 2  # one worker: each copy waited for in turn
