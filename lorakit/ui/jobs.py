"""The dashboard's job queue: `lorakit train` runs started from the pages, one per GPU (one on a CPU machine), in
the order given; stopped with SIGTERM (the run saves a checkpoint and exits 75) and resumed with `--resume latest`.
The queue lives in a small SQLite database in the runs folder, so it survives a restart of `lorakit ui`: a job
whose process is gone is then read from its run folder (finished / interrupted / failed).

A job is checked before it is queued by `lorakit train CONFIG --dry-run --json` itself, so the page shows the CLI's
own messages, every problem at once."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from lorakit.errors import InputError
from lorakit.ui.runs import confined, status

DB = ".lorakit-ui.sqlite"
LOGS = ".lorakit-ui-logs"
ENDED = {0: "finished", 75: "interrupted", 130: "interrupted"}
SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY, config TEXT NOT NULL, sets TEXT NOT NULL,
  resume INTEGER NOT NULL, state TEXT NOT NULL, out_dir TEXT, pid INTEGER, exit INTEGER, created REAL, started REAL,
  ended REAL, slot INTEGER)"""
ACTIVE = ("running", "stopping")


def _alive(pid: int | None) -> bool:
    """Is this process still running (an exited child nobody reaped yet is not)?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Queue:
    """Jobs in `<root>/.lorakit-ui.sqlite`; `slots`: how many run at once (GPUs; 1 on the CPU). `roots`: the
    folders a job's config may be in."""

    def __init__(self, root: Path, slots: int = 1, roots: tuple = ()):
        self.root = Path(root).resolve()
        self.slots = max(1, slots)
        self.roots = tuple(Path(r).resolve() for r in (self.root, *roots))
        self.lock = threading.Lock()  # the database
        self.ticking = threading.Lock()  # one tick at a time (the worker's, or a request's)
        self.procs: dict[int, subprocess.Popen] = {}
        self.db = sqlite3.connect(self.root / DB, check_same_thread=False, isolation_level=None)
        self.db.execute(SCHEMA)  # jobs a previous `lorakit ui` left running are watched by pid (`tick`)
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reading

    def jobs(self) -> list[dict]:
        with self.lock:
            cur = self.db.execute("SELECT * FROM jobs ORDER BY id")
            cols = [c[0] for c in cur.description]
            rows = [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
        for r in rows:
            r["sets"] = json.loads(r["sets"])
            r["log"] = f"{LOGS}/job-{r['id']}.log"
        return rows

    def job(self, job_id: int) -> dict:
        for j in self.jobs():
            if j["id"] == job_id:
                return j
        raise InputError(f"no job {job_id}")

    def log(self, job_id: int, tail: int = 20000) -> str:
        p = self.root / LOGS / f"job-{job_id}.log"
        if not p.is_file():
            return ""
        with open(p, "rb") as f:
            f.seek(max(0, p.stat().st_size - tail))
            return f.read().decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ changing

    def config_path(self, config: str) -> Path:
        """A config the pages name: inside the runs or datasets folder (relative to the runs folder)."""
        for r in self.roots:
            try:
                p = confined(r, config)
            except InputError:
                continue
            if p.is_file():
                return p
        raise InputError(f"{config}: no such config file in the runs or datasets folder")

    def submit(self, config: str, sets: list[str] | None = None, resume: bool = False) -> dict:
        """Check the run as `lorakit train --dry-run` does, then queue it. InputError with every problem the CLI
        names when it would be refused."""
        path = self.config_path(config)
        sets = [s for s in (sets or []) if s.strip()]
        args = [sys.executable, "-m", "lorakit", "train", str(path), "--dry-run", "--json",
                *[a for s in sets for a in ("--set", s)]]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            try:
                err = json.loads(r.stdout or r.stderr)
            except ValueError:
                err = {"message": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["refused"]}
            problems = err.get("problems") or (err.get("details") or {}).get("problems") or [err.get("message")]
            raise InputError("; ".join(str(p) for p in problems), err.get("hint"), details={"problems": problems})
        out_dir = _out_dir(r.stdout)
        with self.lock:
            cur = self.db.execute("INSERT INTO jobs (config, sets, resume, state, out_dir, created) VALUES "
                                  "(?, ?, ?, 'queued', ?, ?)", (str(path), json.dumps(sets), int(resume), out_dir,
                                                                 time.time()))
        self.tick()
        return self.job(cur.lastrowid)

    def stop(self, job_id: int) -> dict:
        """SIGTERM: the run saves a checkpoint and exits 75 (a queued job is cancelled)."""
        j = self.job(job_id)
        if j["state"] == "queued":
            self._set(job_id, state="cancelled", ended=time.time())
        elif j["state"] == "running" and _alive(j["pid"]):
            os.kill(j["pid"], signal.SIGTERM)
            self._set(job_id, state="stopping")
        else:
            raise InputError(f"job {job_id} is {j['state']}: nothing to stop")
        return self.job(job_id)

    def resume(self, job_id: int) -> dict:
        """The job's run again with `--resume latest` (queued like a new job)."""
        j = self.job(job_id)
        if j["state"] in ("queued", "running", "stopping"):
            raise InputError(f"job {job_id} is {j['state']}")
        return self.submit(j["config"], j["sets"], resume=True)  # an absolute path inside the roots

    # ------------------------------------------------------------------ the worker

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="lorakit-ui-jobs", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        if self.thread:
            self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.tick()

    def tick(self) -> None:
        """Reap ended processes, then start queued jobs while a slot is free."""
        with self.ticking:
            self._tick()

    def _tick(self) -> None:
        for job_id, p in list(self.procs.items()):
            code = p.poll()
            if code is not None:
                del self.procs[job_id]
                self._set(job_id, state=ENDED.get(code, "failed"), exit=code, ended=time.time())
        jobs = self.jobs()
        for j in jobs:  # adopted from a previous `lorakit ui`: ended while nobody watched
            if j["state"] in ACTIVE and j["id"] not in self.procs and not _alive(j["pid"]):
                j["state"] = _read_state(j)
                self._set(j["id"], state=j["state"], ended=time.time())
        slots = free_slots({j["slot"] for j in jobs if j["state"] in ACTIVE}, self.slots)
        for j, slot in zip([j for j in jobs if j["state"] == "queued"], slots, strict=False):
            self._launch(j, slot)

    def _launch(self, j: dict, slot: int) -> None:
        (self.root / LOGS).mkdir(exist_ok=True)
        log = open(self.root / LOGS / f"job-{j['id']}.log", "ab")  # noqa: SIM115 - the child writes it
        args = [sys.executable, "-m", "lorakit", "train", j["config"], "--log-format", "plain",
                *[a for s in j["sets"] for a in ("--set", s)], *(("--resume", "latest") if j["resume"] else ())]
        env = dict(os.environ)
        if self.slots > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(slot)
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.procs[j["id"]] = p
        self._set(j["id"], state="running", pid=p.pid, started=time.time(), slot=slot)

    def _set(self, job_id: int, **fields) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.lock:
            self.db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))  # noqa: S608


def free_slots(busy: set, slots: int) -> list[int]:
    """The slots (GPU indices) no active job holds, lowest first."""
    return [s for s in range(slots) if s not in busy]


def _out_dir(dry_run_json: str) -> str | None:
    try:
        got = json.loads(dry_run_json)
    except ValueError:
        return None
    cfg = got.get("config") or got.get("resolved", {}).get("config") or {}
    return (cfg.get("output") or {}).get("dir")


def _read_state(j: dict) -> str:
    """What a job that ended unwatched became, from its run folder."""
    if not j.get("out_dir"):
        return "failed"
    st = status(Path(j["out_dir"]))
    return {"finished": "finished", "interrupted": "interrupted", "running": "running"}.get(st, "failed")
