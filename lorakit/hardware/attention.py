"""The attention backend self-test.

Why: on an H100 with torch 2.11 + cuDNN 9.19, PyTorch's default SDPA pick for FLUX (cuDNN attention)
crashes in backward, and a bare kernel can pass where the same kernel fails inside a model. So lorakit:

1. runs forward AND backward of every backend at the families' shapes (`self_test`; the shapes are each
   family adapter's `attention_cases`, `attention_cases.py`), caching the result per machine fingerprint;
2. runs each architecture's real transformer blocks ("model <arch>" cases, `attention_model.py`) with the
   backends that could be chosen, fastest first, until every family of the architecture has one that passed;
3. chooses per family the fastest backend that worked at all of that family's cases (`attention_choice.py`);
4. a run puts the choice in force with PyTorch's global SDPA switches (`sdpa.apply`).

Every measurement runs in a child process that reports each case as it finishes; a case that does not
answer within the watchdog (20 s) is recorded as hung and the child is replaced, so a kernel that hangs or
corrupts the GPU context costs seconds and takes no other result down.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from lorakit.hardware import (  # no torch at import: doctor's cached answer stays import-light
    attention_model,
    fa4,
)
from lorakit.hardware import probe as probe_mod
from lorakit.hardware.attention_cases import (
    AttentionReport,
    CaseResult,
    all_cases,
    all_model_cases,
    context_lost,
    family_cases,
    fingerprint,
    known_bad,
    model_case,
    run_case,
)
from lorakit.hardware.attention_choice import choose, measured_backends
from lorakit.hardware.children import close, read_line
from lorakit.hardware.sdpa import ALL_BACKENDS
from lorakit.models.base import family_adapter
from lorakit.models.facts import AttentionCase
from lorakit.models.registry import family_names
from lorakit.paths import cache_root, write_whole

WATCHDOG_S = 20.0  # one case (after the child's imports) may take this long before it counts as hung
STARTUP_S = 180.0  # a child's imports (torch, diffusers) on a cold machine
VERSION = 7  # bump when what a cached report means changes (7: cuDNN inside FLUX, gradients compared)
CHILD = [sys.executable, "-m", "lorakit.hardware.attention"]  # the command of a child (+ "bare" | "models")


def _key(device: str, cases, models, facts=None) -> dict:
    """What a measurement is cached under: the machine's fingerprint and what was measured."""
    fp = fingerprint(device, facts)
    fp.update(cases=[asdict(c) for c in cases], models=list(models), version=VERSION)
    return fp


EARLY: dict = {}  # family -> the children `start_early` started for its coming self-test


def self_test_family(family: str, device: str = "cuda") -> AttentionReport:
    """What a training run needs: doctor's measurement of every family where this machine has one, else the cases
    of this family alone (its bare shapes and its architecture's in-model case: a fraction of the whole test),
    measured once per machine and cached as well (with the children `start_early` started, where it did)."""
    everything, own = _family_measurements(family, device)
    children = EARLY.pop(family, None)
    report = _cached(_key(device, *everything))
    if report is not None:
        close_children(children)
        return report
    return self_test(device, cases=own[0], models=own[1], children=children)


def start_early(family: str, device: str) -> bool:
    """Start the child processes of this family's self-test now, where it will be measured (a CUDA device, no
    measurement cached here): their imports (torch, diffusers: 9-11 s on one H200, 2026-11-30) then run beside the
    run's own checks instead of after them. Asked before the machine is probed: on a machine whose probe is not
    cached yet (a first run) nothing is cached, else the cached answer says. The children end by themselves when
    this process does not use them (`_child_main`)."""
    if not device.startswith("cuda") or family in EARLY or probe_mod.machine_key() is None:
        return False
    if probe_mod.facts_cached() and cached_family_report(family, device) is not None:
        return False
    EARLY[family] = prestart(models=(model_case(family),))
    return True


def drop_early(family: str) -> None:
    """Stop the children `start_early` started for a family whose run will not measure after all (each holds torch
    and diffusers in host memory)."""
    close_children(EARLY.pop(family, None))


def drop_all_early() -> None:
    """`drop_early` for every family (a run refused after `start_early`)."""
    for family in list(EARLY):
        drop_early(family)


class Measuring:
    """A training run's first self-test of its family here (`self_test_family`: child processes, cached per
    machine), run in a thread as the run starts: beside the encoders, the caching and the model's load. `result`
    waits for it. A run that fails meanwhile does not wait for it to exit (its threads are daemons; the children
    end at their next answer to the gone process)."""

    def __init__(self, family: str, device: str):
        self.started = time.perf_counter()
        self._report, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(family, device), name="lorakit-attention",
                                        daemon=True)
        self._thread.start()

    def _run(self, family: str, device: str) -> None:
        try:
            self._report = self_test_family(family, device)
        except Exception as e:  # noqa: BLE001 - raised where the run waits for it
            self._error = e

    def result(self) -> AttentionReport:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._report


def cached_family_report(family: str, device: str = "cuda") -> AttentionReport | None:
    """What `self_test_family` would return without measuring: doctor's whole measurement or this family's, where
    this machine has one cached; else None (the next run's self-test measures)."""
    for cases, models in _family_measurements(family, device):
        report = _cached(_key(device, cases, models))
        if report is not None:
            return report
    return None


def _family_measurements(family: str, device: str) -> tuple:
    """(cases, models) of doctor's whole measurement, then of this family's alone."""
    cuda = device.startswith("cuda")
    return ((all_cases(), all_model_cases() if cuda else ()),
            (tuple(family_adapter(family).attention_cases), (model_case(family),) if cuda else ()))


def _cached(fp: dict) -> AttentionReport | None:
    """The report cached under this key; None where there is none or it is damaged (it is then measured)."""
    path = _cache_file(fp)
    if not path.is_file():
        return None
    try:
        return AttentionReport.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None


def _cache_file(fp: dict) -> Path:
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "attention" / f"{key}.json"


def _child_main(mode: str) -> None:
    """The child process: import what the jobs need, say "ready", read the jobs (one JSON line on stdin), run
    them in order, one JSON line each as it finishes; stop after a job that lost the CUDA context (the parent
    starts a fresh child for the rest). A "models" child also imports diffusers and the families before it is
    ready, so one started early (a spare) has its imports done when its model case comes."""
    import torch  # noqa: F401 - imported before "ready": the watchdog then times the cases only

    fa4.preimport()  # where flash-attn-4 is installed: ~10 s of imports, not a hung kernel
    if mode == "models":
        import diffusers  # noqa: F401

        family_names()
    print(json.dumps({"ready": True}), flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # an unused spare
    spec = json.loads(line)
    cases = {c["name"]: AttentionCase(**c) for c in spec["cases"]}
    for backend, name in spec["jobs"]:
        if name.startswith("model "):
            r = attention_model.run_model_case(name, backend, spec["device"], repeats=spec["repeats"])
        else:
            r = run_case(backend, cases[name], spec["device"], spec["repeats"])
        print(json.dumps(asdict(r)), flush=True)
        if context_lost(r):
            return
        if spec["device"].startswith("cuda"):
            torch.cuda.empty_cache()


def spawn(models: bool = False) -> subprocess.Popen:
    """A child process for `run_jobs` (it starts importing at once and then waits for its jobs)."""
    return subprocess.Popen([*CHILD, "models" if models else "bare"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_jobs(jobs: list[tuple[str, str]], device: str, repeats: int, cases=(), watchdog: float = WATCHDOG_S,
             startup: float = STARTUP_S, progress=None, spare: subprocess.Popen | None = None) -> list[CaseResult]:
    """Run (backend, case) jobs in watched child processes: a job that fails with a lost CUDA context, kills
    its process or gives no answer within `watchdog` seconds is recorded, and a fresh child takes the rest.
    `spare`: a child from `spawn` already started, used first."""
    todo = list(jobs)
    out: list[CaseResult] = []
    models = any(name.startswith("model ") for _, name in jobs)
    while todo:
        spec = {"jobs": todo, "device": device, "repeats": repeats, "cases": [asdict(c) for c in cases]}
        p, spare = spare or spawn(models), None
        try:
            ready = read_line(p, startup)
            if ready is None:
                out.append(_dead(todo.pop(0), p, f"no answer in {startup:.0f} s while starting"))
                continue
            try:
                p.stdin.write(json.dumps(spec) + "\n")
                p.stdin.close()
            except OSError:
                out.append(_dead(todo.pop(0), p))
                continue
            while todo:
                line = read_line(p, watchdog)
                if line is None:
                    if p.poll() is None:  # alive but silent: a hung kernel
                        out.append(CaseResult(*todo.pop(0), False, error=f"hung: no answer in {watchdog:.0f} s"))
                    else:
                        out.append(_dead(todo.pop(0), p))
                    break
                r = CaseResult(**json.loads(line))
                todo.pop(0)
                out.append(r)
                if progress:
                    progress(r)
                if context_lost(r):
                    break
        finally:
            close(p)
    return out


def _dead(job: tuple[str, str], p: subprocess.Popen, why: str | None = None) -> CaseResult:
    if why is None:
        p.wait()
        tail = (p.stderr.read().strip().splitlines() or ["no output"])[-1][:300]
        why = f"test process died (exit {p.returncode}): {tail}"
    return CaseResult(job[0], job[1], False, error=why)


def prestart(models=None) -> dict:
    """Children for a coming `self_test`, started now so their imports overlap the parent's own (doctor
    starts them before it probes): one for the bare shapes, two per model case."""
    models = all_model_cases() if models is None else models
    return {"bare": spawn(), "models": {m: [spawn(models=True), spawn(models=True)] for m in models}}


def close_children(children: dict | None) -> None:
    """Stop the children `prestart` made that were not used."""
    for p in [(children or {}).get("bare")] + [p for ps in (children or {}).get("models", {}).values() for p in ps]:
        if p is not None:
            close(p)


def self_test(device: str = "cuda", use_cache: bool = True, repeats: int = 5, cases=None, models=None,
              progress=None, watchdog: float = WATCHDOG_S, facts=None, children: dict | None = None
              ) -> AttentionReport:
    """Forward+backward of every SDPA backend at the families' shapes, then the real transformers with the
    backends that could be chosen; cached per machine fingerprint.

    Args:
        cases: bare cases (default: every family's `attention_cases`).
        models: in-model cases (default: every architecture's on CUDA, none on the CPU).
        progress: called with each `CaseResult` as it arrives.
        facts: the probe's (for the fingerprint; probed when None).
        children: from `prestart` (used where they fit, the rest stopped).
    """
    t0 = time.perf_counter()
    cases = tuple(cases) if cases is not None else all_cases()
    models = (all_model_cases() if device.startswith("cuda") else ()) if models is None else tuple(models)
    fp = _key(device, cases, models, facts)
    cached = _cached(fp) if use_cache else None  # a damaged cache is simply re-measured
    if cached is not None:
        close_children(children)
        return cached
    report = AttentionReport(fingerprint=fp)
    # two children per model case start now (or came started), so their imports (torch, diffusers) overlap
    # the bare shapes
    children = children or {}
    spares = {m: children.get("models", {}).pop(m, None) or [spawn(models=True), spawn(models=True)]
              for m in models}
    bare = children.pop("bare", None)
    close_children(children)
    try:
        jobs = [(b, c.name) for b in measured_backends(fp) for c in cases]
        report.results += run_jobs(jobs, device, repeats, cases, watchdog, progress=progress, spare=bare)
        if models:
            for rows in in_parallel(lambda m: _model_case(report, m, device, watchdog, progress, spares[m]),
                                    models):  # architectures in parallel children
                report.results += rows
    finally:
        for p in (p for ps in spares.values() for p in ps):
            close(p)
    report.choice = {fam: choose(report, fam) for fam in family_names()}
    report.seconds = round(time.perf_counter() - t0, 1)
    text = json.dumps(report.to_dict(), indent=2)
    write_whole(_cache_file(fp), lambda tmp: tmp.write_text(text))  # an unwritable cache only costs a re-run
    return report


def in_parallel(fn, items) -> list:
    """`fn` of each item, each in a thread of its own, the results in order (the first error raised). The threads
    are daemons: a process that exits meanwhile (a refused run, Ctrl-C) does not wait for a measurement in progress,
    as it would for a ThreadPoolExecutor's workers."""
    items = list(items)
    out, errors = [None] * len(items), [None] * len(items)

    def one(k, x):
        try:
            out[k] = fn(x)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors[k] = e

    threads = [threading.Thread(target=one, args=(k, x), daemon=True, name="lorakit-attention-case")
               for k, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return out


def _model_case(report: AttentionReport, case: str, device: str, watchdog: float, progress,
                spares: list | None = None) -> list[CaseResult]:
    """The in-model case of one architecture, with candidate backends fastest first, until every family of the
    architecture has a backend that passed everything. Each candidate runs twice, in two fresh processes at
    once (a kernel that fails only now and then, as cuDNN inside FLUX did, gets two chances to show it)."""
    fams = [f for f in family_names() if model_case(f) == case]
    bare = {f: set(family_cases(f)) - {case} for f in fams}

    def passes_bare(backend: str, fam: str) -> bool:
        rs = [r for r in report.results if r.backend == backend and r.case in bare[fam]]
        return len(rs) == len(bare[fam]) and all(r.ok for r in rs)

    def speed(backend: str) -> float:
        union = set().union(*bare.values())
        return sum(r.ms or 0.0 for r in report.results if r.backend == backend and r.case in union and r.ok)

    rows, satisfied = [], set()
    for backend in sorted(ALL_BACKENDS, key=speed):
        wanted = [f for f in fams if f not in satisfied and passes_bare(backend, f)
                  and not known_bad(report.fingerprint, backend, f)]
        if not wanted:
            continue
        tries = in_parallel(lambda job: run_jobs([job], device, 5, watchdog=watchdog * 2,  # two fresh processes
                                                 spare=spares.pop() if spares else None)[0],  # at once
                            [(backend, case)] * 2)
        bad = [t for t in tries if not t.ok]
        row = bad[0] if bad else min(tries, key=lambda t: t.ms or 0.0)
        rows.append(row)
        if progress:
            progress(row)
        if row.ok:
            satisfied.update(wanted)
        if satisfied == set(fams):
            break
    return rows


if __name__ == "__main__":  # the child process of run_jobs
    _child_main(sys.argv[1])
