"""The dashboard's job queue: checked as the CLI checks, one run at a time, stopped with a checkpoint (exit 75),
resumed, and still there after `lorakit ui` restarts."""

import time

import pytest

from lorakit.errors import InputError
from lorakit.ui.jobs import Queue
from tests.unit.ui.conftest import run_yaml


def _until(q, job_id, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        q.tick()
        j = q.job(job_id)
        if j["state"] in states:
            return j
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} stayed {q.job(job_id)['state']}")


def _steps(run):
    m = run / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def test_jobs_queue_run_stop_resume_and_survive_a_restart(tmp_path, tiny):
    root = tmp_path / "runs"
    root.mkdir()
    run_yaml(root, tiny, root / "a", steps=4000, sampling={"enabled": False}, output={"save_every": 100000})
    run_yaml(root, tiny, root / "b", steps=3, sampling={"enabled": False})
    q = Queue(root)

    with pytest.raises(InputError) as e:  # the CLI's own messages, every problem at once
        q.submit("a.yaml", ["schedule.steps=-1", "lora.rank=0"])
    assert len(e.value.details["problems"]) == 2 and "lora.rank" in e.value.message
    with pytest.raises(InputError):
        q.submit("../elsewhere.yaml")  # configs from inside the runs or datasets folder only
    assert q.jobs() == []

    a = q.submit("a.yaml")
    b = q.submit("b.yaml")
    assert a["state"] == "running" and b["state"] == "queued"  # one slot: in order
    deadline = time.time() + 120
    while _steps(root / "a") < 3 and time.time() < deadline:
        time.sleep(0.1)
    q.stop(a["id"])  # SIGTERM: a checkpoint, exit 75
    a = _until(q, a["id"], {"interrupted", "failed"})
    assert a["state"] == "interrupted" and a["exit"] == 75, q.log(a["id"])
    assert (root / "a" / "checkpoints").is_dir() and "interrupted" in q.log(a["id"]).lower()
    b = _until(q, b["id"], {"finished", "failed"})  # the next in line ran when the slot freed
    assert b["state"] == "finished" and b["exit"] == 0, q.log(b["id"])

    done = _steps(root / "a")
    again = q.resume(a["id"])
    assert again["resume"] == 1 and again["config"] == a["config"]
    deadline = time.time() + 120
    while _steps(root / "a") <= done + 2 and time.time() < deadline:
        q.tick()
        time.sleep(0.1)
    assert _steps(root / "a") > done  # continued from the checkpoint
    pid = q.job(again["id"])["pid"]
    q.db.close()  # `lorakit ui` stops; the run goes on

    q2 = Queue(root)  # ... and starts again: the queue is still there, the running job adopted by its pid
    states = {j["id"]: j["state"] for j in q2.jobs()}
    assert states == {a["id"]: "interrupted", b["id"]: "finished", again["id"]: "running"}
    assert q2.job(again["id"])["pid"] == pid
    q2.stop(again["id"])
    j = _until(q2, again["id"], {"interrupted", "failed"})
    assert j["state"] == "interrupted"  # read from its run folder: step checkpoints, no final


def test_a_freed_slot_is_reused_and_a_held_one_never_shared():
    from lorakit.ui.jobs import free_slots

    assert free_slots(set(), 2) == [0, 1]
    assert free_slots({0}, 2) == [1]
    assert free_slots({1}, 2) == [0]  # A (slot 0) ended, B holds 1: the next job gets 0, not B's GPU
    assert free_slots({0, 1}, 2) == []
