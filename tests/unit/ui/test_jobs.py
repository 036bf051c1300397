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


@pytest.mark.slow
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


@pytest.mark.slow
def test_one_job_per_run_folder_resume_only_from_a_checkpoint_and_outputs_inside_the_runs_folder(tmp_path, tiny):
    root = tmp_path / "runs"
    root.mkdir()
    run_yaml(root, tiny, root / "a", steps=4000, sampling={"enabled": False}, output={"save_every": 2})
    run_yaml(root, tiny, root / "quick", steps=1, sampling={"enabled": False})
    run_yaml(root, tiny, tmp_path / "outside", steps=2, sampling={"enabled": False})
    (root / "rel.yaml").write_text((root / "quick.yaml").read_text().replace(str(root / "quick"), "rel-out"))
    q = Queue(root)

    with pytest.raises(InputError, match="outside the runs folder"):  # output.dir must lie inside it
        q.submit("outside.yaml")
    rel = q.submit("rel.yaml")  # a relative output.dir: relative to the runs folder, not the server's cwd
    assert rel["out_dir"] == str((root / "rel-out").resolve()) and rel["run"] == "rel-out"
    rel = _until(q, rel["id"], {"finished", "failed"})
    assert rel["state"] == "finished", q.log(rel["id"])
    with pytest.raises(InputError, match="is finished"):
        q.resume(rel["id"])

    a = q.submit("a.yaml")
    deadline = time.time() + 120
    metrics = root / "a" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.1)  # the job has written steps: its folder must still read as the job's, not an earlier run's
    with pytest.raises(InputError, match=f"job {a['id']} .* already trains into this run folder"):
        q.submit("a.yaml")  # a second start of a held folder
    while not list((root / "a" / "checkpoints").glob("step-*")) and time.time() < deadline:
        time.sleep(0.1)
    q.stop(a["id"])
    a = _until(q, a["id"], {"interrupted", "failed"})
    assert a["state"] == "interrupted" and a["resumable"]
    again = q.resume(a["id"])
    with pytest.raises(InputError, match=f"started again by job {again['id']}"):
        q.resume(a["id"])  # the duplicate resume of the same row
    assert not q.job(a["id"])["resumable"]  # the older row no longer offers it
    q.stop(again["id"])
    again = _until(q, again["id"], {"interrupted", "failed"})
    assert again["resumable"] and not q.job(a["id"])["resumable"]  # only the newest row of the folder


def test_a_reused_pid_is_never_taken_for_the_job_nor_signalled(tmp_path):
    import os

    from lorakit.ui.jobs import started_at

    root = tmp_path / "runs"
    root.mkdir()
    q = Queue(root)
    # a job a previous `lorakit ui` left "running", whose pid the system has since given to this very process
    mine = started_at(os.getpid())
    with q.lock:
        q.db.execute("INSERT INTO jobs (config, sets, resume, state, out_dir, pid, pid_start, created, started) "
                     "VALUES ('x.yaml', '[]', 0, 'running', ?, ?, ?, 0, 0)", (str(root / "gone"), os.getpid(),
                                                                             mine - 1))
    q2 = Queue(root)
    q2.tick()
    j = q2.jobs()[0]
    assert j["state"] == "failed"  # read from its (empty) run folder, not from a live process that is not it
    with pytest.raises(InputError, match="nothing to stop"):
        q2.stop(j["id"])  # and this process got no SIGTERM (the test is still running)


def test_a_damaged_queue_or_a_read_only_runs_folder_is_said_by_name(tmp_path, monkeypatch):
    import sqlite3

    from lorakit.errors import EnvironmentFault
    from lorakit.ui.jobs import DB

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / DB).write_bytes(b"this is not a database" * 100)
    with pytest.raises(InputError, match="damaged") as e:
        Queue(bad)
    assert str(bad / DB) in e.value.message and "mv" in e.value.hint
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / DB).symlink_to(tmp_path / "elsewhere.sqlite")
    with pytest.raises(InputError, match="link"):
        Queue(tmp_path / "linked")
    ro = tmp_path / "ro"  # a read-only disk (root writes through a folder's mode bits, so sqlite says it here)
    ro.mkdir()

    def read_only(*a, **k):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(sqlite3, "connect", read_only)
    with pytest.raises(EnvironmentFault, match="cannot be written") as e:
        Queue(ro)
    assert str(ro / DB) in e.value.message
