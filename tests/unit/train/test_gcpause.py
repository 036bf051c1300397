"""The collector's pauses timed per step and what the run keeps frozen (lorakit.train.gcpause), and a run that
leaves the process's collector as it found it."""

from __future__ import annotations

import gc
import json

import yaml

from lorakit.train.gcpause import Collector


class _Cycle:
    def __init__(self):
        self.me = self


def test_full_collections_are_timed_and_settle_freezes_what_is_left():
    c = Collector()
    try:
        keep = [_Cycle() for _ in range(20_000)]  # noqa: F841 - what the run keeps
        c.take()  # making them ran the collector itself
        gc.collect(1)
        assert c.take() == 0.0  # a younger generation's collection is not the pause this is about
        gc.collect()
        first = c.take()
        assert first > 0 and c.take() == 0.0
        assert c.settle() > 0 and gc.get_freeze_count() >= 20_000 and c.take() == 0.0
        gc.collect()
        assert c.take() < first  # the frozen objects are not walked again
    finally:
        c.close()
    assert gc.get_freeze_count() == 0 and c._timed not in gc.callbacks


def test_a_run_records_its_collections_and_leaves_the_collector_as_it_found_it(tmp_path, tiny, monkeypatch):
    from lorakit.data.demo import make_demo_dataset
    from lorakit.plan.resolve import resolve
    from lorakit.train import loop
    from lorakit.train.loop import run

    settled = []

    class Counting(Collector):
        def settle(self):
            settled.append(gc.get_freeze_count())
            return super().settle()

    monkeypatch.setattr(loop, "Collector", Counting)

    before = list(gc.callbacks)
    data = make_demo_dataset(tmp_path / "d", "flat", count=4, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 3},
           "sampling": {"enabled": False}, "output": {"dir": str(tmp_path / "run")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run(resolve(tmp_path / "run.yaml"))
    assert gc.get_freeze_count() == 0 and gc.callbacks == before
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r.get("gc_s", 0) >= 0 for r in rows)
    assert settled == [0]  # once, after step 1 (the blocks are not compiled on the CPU)


def test_the_run_freezes_what_step_1s_grid_and_each_later_grid_leave_after_they_are_rendered(tmp_path, tiny,
                                                                                              monkeypatch):
    """What the step-0 grid (and, on a GPU, step 1's other bucket shapes) and each later grid leave stays for the
    run: frozen after them, not before (FLUX rtx4090 on an H200, 2026-11-29: frozen before them, a 0.23-0.32 s full
    collection every ~8 steps, steady p90/median 1.38)."""
    from lorakit.data.demo import make_demo_dataset
    from lorakit.plan.resolve import resolve
    from lorakit.train import loop
    from lorakit.train.loop import run

    order = []

    class Counting(Collector):
        def settle(self):
            order.append("settle")
            return super().settle()

    def grid(r, step):
        order.append(f"grid {step}")
        return real(r, step)

    real = loop.render_samples
    monkeypatch.setattr(loop, "Collector", Counting)
    monkeypatch.setattr(loop, "render_samples", grid)
    data = make_demo_dataset(tmp_path / "d", "flat", count=4, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 3}, "sampling": {"every": 2, "steps": 1, "prompts": ["a cat"]},
           "output": {"dir": str(tmp_path / "run")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run(resolve(tmp_path / "run.yaml"))
    assert order[:4] == ["grid 0", "settle", "grid 2", "settle"], order
    assert gc.get_freeze_count() == 0
