"""The dashboard's job queue: `lorakit train` runs started from the pages, one per GPU (one on a CPU machine), in
the order given; stopped with SIGTERM (the run saves a checkpoint and exits 75) and resumed with `--resume latest`.
The queue lives in a small SQLite database in the runs folder, so it survives a restart of `lorakit ui`: a job
whose process is gone is then read from its run folder (finished / interrupted / failed). A job's process is known by
its pid *and* its start time, so a pid the system gave to another process since is never taken for the job (nor
signalled).

A job is checked before it is queued by `lorakit train CONFIG --dry-run --json` itself, so the page shows the CLI's
own messages, every problem at once. Jobs run in the runs folder: a relative path in their config (output.dir,
data.dirs) is relative to it, and their output must lie inside it. One job at a time per run folder: a second start
or resume of a folder a job holds (queued or running) is refused with that job's number."""

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

from lorakit.config.loading import deep_merge, load_yaml, parse_overrides
from lorakit.errors import EnvironmentFault, InputError, LorakitError
from lorakit.io.lock import holder
from lorakit.ui.confine import confined, inside, read_text
from lorakit.ui.runs import resumable, status

DB = ".lorakit-ui.sqlite"
LOGS = ".lorakit-ui-logs"
ENDED = {0: "finished", 75: "interrupted", 130: "interrupted"}
SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY, config TEXT NOT NULL, sets TEXT NOT NULL,
  resume INTEGER NOT NULL, state TEXT NOT NULL, out_dir TEXT, pid INTEGER, exit INTEGER, created REAL, started REAL,
  ended REAL, slot INTEGER, pid_start INTEGER)"""
ACTIVE = ("running", "stopping")
HOLDING = ("queued", *ACTIVE)  # states in which a job holds its run folder
STOPPED = ("interrupted", "failed", "cancelled")  # states a job may be resumed from


def started_at(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when it is gone (or the
    system has no /proc) — with the pid, what names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # exited, not reaped yet: not running
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _alive(pid: int | None, start: int | None) -> bool:
    """Is the job's process still running: this pid, started at `start` (a pid given to another process since is not
    the job's)? Without /proc only the pid can be asked."""
    if not pid:
        return False
    if Path("/proc/self/stat").exists():
        now = started_at(pid)
        return now is not None and (start is None or now == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
        self.db = _open_db(self.root)  # jobs a previous `lorakit ui` left running are watched by pid (`tick`)
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reading

    def jobs(self) -> list[dict]:
        with self.lock:
            cur = self.db.execute("SELECT * FROM jobs ORDER BY id")
            cols = [c[0] for c in cur.description]
            rows = [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
        held = {r["out_dir"] for r in rows if r["state"] in HOLDING and r["out_dir"]}
        newest = {r["out_dir"]: r["id"] for r in rows}  # rows come oldest first
        for r in rows:
            r["sets"] = json.loads(r["sets"])
            r["log"] = f"{LOGS}/job-{r['id']}.log"
            r["run"] = _run_name(self.root, r["out_dir"])
            # Resume is offered on the newest job of a run folder nobody holds, whose run stopped with a step checkpoint
            r["resumable"] = bool(r["state"] in STOPPED and r["out_dir"] and r["out_dir"] not in held
                                  and newest[r["out_dir"]] == r["id"] and status(Path(r["out_dir"])) == "interrupted")
        return rows

    def job(self, job_id: int) -> dict:
        for j in self.jobs():
            if j["id"] == job_id:
                return j
        raise InputError(f"no job {job_id}")

    def log(self, job_id: int, tail: int = 20000) -> str:
        """The last `tail` bytes of the job's log ("" when there is none, or it is a link out of the runs folder)."""
        try:
            return read_text(self.root, self.root / LOGS / f"job-{job_id}.log", limit=tail)
        except (OSError, InputError):
            return ""

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

    def check(self, config: str, sets: list[str] | None = None, resume: bool = False) -> dict:
        """`lorakit train --dry-run --json` of the run, in the runs folder: its answer (the profile and why, the
        resolved config, the memory estimate, notes). InputError with every problem the CLI names when it would be
        refused."""
        path = self.config_path(config)
        sets = [s for s in (sets or []) if s.strip()]
        args = [sys.executable, "-m", "lorakit", "train", str(path), "--dry-run", "--json",
                *[a for s in sets for a in ("--set", s)], *(("--resume", "latest") if resume else ())]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=self.root)
        if r.returncode != 0:
            try:
                err = json.loads(r.stdout or r.stderr)
            except ValueError:
                err = {"message": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["refused"]}
            problems = err.get("problems") or (err.get("details") or {}).get("problems") or [err.get("message")]
            raise InputError("; ".join(str(p) for p in problems), err.get("hint"), details={"problems": problems})
        try:
            got = json.loads(r.stdout)
        except ValueError:
            raise InputError(f"{path}: lorakit train --dry-run answered no JSON") from None
        return {**got, "config_file": str(path), "sets": sets, "resume": resume}

    def submit(self, config: str, sets: list[str] | None = None, resume: bool = False) -> dict:
        """Check the run as `lorakit train --dry-run` does (`check`), then queue it. InputError with every problem
        the CLI names when it would be refused."""
        named = _named_out_dir(self.config_path(config), sets)
        try:  # a folder a job trains into: said by job before the dry run sees that job's files
            real = inside(self.root, Path(self.root, named)) if named is not None else None
        except InputError:
            real = None  # outside the runs folder: refused after the dry run, which resolves it
        if real is not None and real != self.root:
            self._not_held(real)
        checked = self.check(config, sets, resume)
        path, sets = Path(checked["config_file"]), checked["sets"]
        out_dir = self._own_folder(_out_dir(checked))
        with self.lock:
            cur = self.db.execute("INSERT INTO jobs (config, sets, resume, state, out_dir, created) VALUES "
                                  "(?, ?, ?, 'queued', ?, ?)", (str(path), json.dumps(sets), int(resume), out_dir,
                                                                 time.time()))
        self.tick()
        return self.job(cur.lastrowid)

    def _own_folder(self, out_dir: str | None) -> str:
        """The run folder a checked job writes: inside the runs folder, and held by no other job or process."""
        if not out_dir:
            raise InputError("the checked config names no output.dir", "set output.dir (relative to the runs folder)")
        try:
            real = inside(self.root, Path(self.root, out_dir))
        except InputError:
            raise InputError(f"output.dir {out_dir}: outside the runs folder {self.root}",
                             "a job writes inside the runs folder: give a path relative to it") from None
        if real == self.root:
            raise InputError(f"output.dir {out_dir}: the runs folder itself", "give a folder inside it, e.g. runs/mine")
        self._not_held(real)
        return str(real)

    def _not_held(self, real: Path) -> None:
        """InputError where a job of this queue or another lorakit process trains into the folder `real` now."""
        for j in self.jobs():
            if j["state"] in HOLDING and j["out_dir"] == str(real):
                raise InputError(f"{_run_name(self.root, str(real))}: job {j['id']} ({j['state']}) already "
                                 "trains into this run folder", f"wait for job {j['id']} or stop it first")
        held = holder(real)
        if held is not None:
            who = f" (pid {held.get('pid')}: {held.get('command')})" if held else ""
            raise InputError(f"{_run_name(self.root, str(real))}: a lorakit process is training there now{who}",
                             "wait for it to finish, or stop it first")

    def stop(self, job_id: int) -> dict:
        """SIGTERM: the run saves a checkpoint and exits 75 (a queued job is cancelled). Only the job's own process is
        signalled: a pid that now names another process (the job ended while nobody watched) is left alone."""
        j = self.job(job_id)
        if j["state"] == "queued":
            self._set(job_id, state="cancelled", ended=time.time())
        elif j["state"] == "running" and _alive(j["pid"], j["pid_start"]):
            os.kill(j["pid"], signal.SIGTERM)
            self._set(job_id, state="stopping")
        elif j["state"] in ACTIVE:
            self.tick()  # its process is gone: read what it became from its run folder
            raise InputError(f"job {job_id} is no longer running (now {self.job(job_id)['state']}): nothing to stop")
        else:
            raise InputError(f"job {job_id} is {j['state']}: nothing to stop")
        return self.job(job_id)

    def resume(self, job_id: int) -> dict:
        """The job's run again with `--resume latest` (queued like a new job), where it saved a step checkpoint and
        no other job holds its folder."""
        j = self.job(job_id)
        if j["state"] in HOLDING:
            raise InputError(f"job {job_id} is {j['state']}")
        later = [k for k in self.jobs() if k["out_dir"] == j["out_dir"] and k["id"] > job_id]
        if later:
            raise InputError(f"job {job_id}'s run {j['run']} was started again by job {later[-1]['id']} "
                             f"({later[-1]['state']})", f"resume job {later[-1]['id']} instead, where it offers it")
        if j["state"] == "finished" or (j["out_dir"] and status(Path(j["out_dir"])) == "finished"):
            raise InputError(f"job {job_id}'s run {j['run']} is finished: nothing to resume")
        if not j["out_dir"] or not resumable(Path(j["out_dir"])):
            raise InputError(f"job {job_id}'s run {_run_name(self.root, j['out_dir'])} saved no step checkpoint: "
                             "there is nothing to resume from", "queue its config again to start it over")
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
            if j["state"] in ACTIVE and j["id"] not in self.procs and not _alive(j["pid"], j["pid_start"]):
                j["state"] = _read_state(j)
                self._set(j["id"], state=j["state"], ended=time.time())
        slots = free_slots({j["slot"] for j in jobs if j["state"] in ACTIVE}, self.slots)
        for j, slot in zip([j for j in jobs if j["state"] == "queued"], slots, strict=False):
            self._launch(j, slot)

    def _launch(self, j: dict, slot: int) -> None:
        logs = self.root / LOGS
        logs.mkdir(exist_ok=True)
        try:
            log = open(inside(self.root, logs / f"job-{j['id']}.log"), "ab")  # noqa: SIM115 - the child writes it
        except (OSError, InputError):  # the log cannot be written (a link out, a full disk): the job cannot run
            self._set(j["id"], state="failed", ended=time.time())
            return
        args = [sys.executable, "-m", "lorakit", "train", j["config"], "--log-format", "plain",
                *[a for s in j["sets"] for a in ("--set", s)], *(("--resume", "latest") if j["resume"] else ())]
        env = dict(os.environ)
        if self.slots > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(slot)
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                             cwd=self.root)
        log.close()
        self.procs[j["id"]] = p
        self._set(j["id"], state="running", pid=p.pid, pid_start=started_at(p.pid), started=time.time(), slot=slot)

    def _set(self, job_id: int, **fields) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.lock:
            self.db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))  # noqa: S608


def _open_db(root: Path) -> sqlite3.Connection:
    """The queue's database in the runs folder: created when missing; a damaged one, a link or a folder that cannot
    be written is said as such (naming the file), not as a bug."""
    path = root / DB
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise InputError(f"{path}: the job queue's database is a link or not a regular file",
                         "remove it (lorakit ui creates a new one) or give --runs another folder")
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute(SCHEMA)
        cols = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
        if "pid_start" not in cols:  # a queue written before jobs were known by pid and start time
            db.execute("ALTER TABLE jobs ADD COLUMN pid_start INTEGER")
        return db
    except sqlite3.DatabaseError as e:
        writable = os.access(root, os.W_OK)
        if not writable or "readonly" in str(e) or "unable to open" in str(e):
            raise EnvironmentFault(f"{path}: the job queue's database cannot be written ({e}): {root} is not "
                                   "writable", "give --runs a folder you can write, or fix its permissions") from None
        raise InputError(f"{path}: the job queue's database is damaged ({e})",
                         f"move it aside (mv {path} {path}.bad); lorakit ui then starts an empty queue") from None


def _run_name(root: Path, out_dir: str | None) -> str | None:
    """A job's run as the run list names it (relative to the runs folder)."""
    if not out_dir:
        return None
    try:
        return str(Path(out_dir).relative_to(root))
    except ValueError:
        return out_dir


def free_slots(busy: set, slots: int) -> list[int]:
    """The slots (GPU indices) no active job holds, lowest first."""
    return [s for s in range(slots) if s not in busy]


def _named_out_dir(path: Path, sets: list[str] | None) -> str | None:
    """The output.dir a config file and its --set values name (relative to the runs folder, where jobs run), or None
    where they name none or do not read (the dry run then says what it takes, or why not)."""
    try:
        user = deep_merge(load_yaml(path), parse_overrides([s for s in (sets or []) if s.strip()])[0])
    except (LorakitError, OSError):
        return None
    out = user.get("output")
    d = out.get("dir") if isinstance(out, dict) else None
    return d if isinstance(d, str) and d.strip() else None


def _out_dir(got: dict) -> str | None:
    """The output folder a dry run's answer names."""
    cfg = got.get("config") or got.get("resolved", {}).get("config") or {}
    return (cfg.get("output") or {}).get("dir")


def _read_state(j: dict) -> str:
    """What a job that ended unwatched became, from its run folder."""
    if not j.get("out_dir"):
        return "failed"
    st = status(Path(j["out_dir"]))
    return {"finished": "finished", "interrupted": "interrupted", "running": "running"}.get(st, "failed")
