"""Attention backend self-test, and putting the chosen backend in force for a whole run.

Why: on an H100 with torch 2.11 + cuDNN 9.19, PyTorch's default SDPA pick for FLUX (cuDNN attention)
crashes in backward, and a `with sdpa_kernel(...)` scope around the forward alone does not cover the
recompute of a checkpointed block, which runs in backward outside the scope. So lorakit:

1. runs forward AND backward of every backend at the families' shapes (`self_test`; the shapes are each
   family adapter's `attention_cases`), caching the result per machine fingerprint;
2. runs each architecture's real transformer blocks ("model <arch>" cases, `attention_model.py`) with the
   backends that could be chosen, fastest first, until every family of the architecture has one that passed;
3. chooses per family the fastest backend that worked at all of that family's cases (`choose`);
4. puts the choice in force with PyTorch's *global* SDPA switches (`apply`), which hold in forward,
   backward and recompute alike, because no scope ends before backward runs.

Every measurement runs in a child process that reports each case as it finishes; a case that does not
answer within the watchdog (20 s) is recorded as hung and the child is replaced, so a kernel that hangs or
corrupts the GPU context costs seconds and takes no other result down.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorakit.hardware import fa4  # no torch at import: the doctor's cached answer stays import-light
from lorakit.models.facts import AttentionCase

BACKENDS = ("flash", "efficient", "cudnn", "math")  # PyTorch's own
ALL_BACKENDS = BACKENDS + ("fa4",)  # fa4: SDPA's flash path through flash-attn-4 (`lorakit.hardware.fa4`)
WATCHDOG_S = 20.0  # one case (after the child's imports) may take this long before it counts as hung
STARTUP_S = 180.0  # a child's imports (torch, diffusers) on a cold machine
VERSION = 6  # bump when what a cached report means changes


@dataclass
class CaseResult:
    backend: str
    case: str
    ok: bool
    ms: float | None = None  # median forward+backward time
    error: str | None = None


@dataclass
class AttentionReport:
    fingerprint: dict
    results: list[CaseResult] = field(default_factory=list)
    choice: dict[str, str | None] = field(default_factory=dict)  # family -> backend
    cached: bool = False
    seconds: float | None = None

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "results": [asdict(r) for r in self.results],
                "choice": self.choice, "cached": self.cached, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> AttentionReport:
        return cls(fingerprint=d["fingerprint"], results=[CaseResult(**r) for r in d["results"]],
                   choice=d["choice"], cached=True, seconds=d.get("seconds"))


# --------------------------------------------------------------------------- what the families need


def _adapter(family: str):
    from lorakit.models.base import family_adapter

    return family_adapter(family)


def model_case(family: str) -> str:
    """The in-model case of a family: its architecture's real transformer blocks."""
    return f"model {_adapter(family).arch}"


def family_cases(family: str) -> tuple[str, ...]:
    """Every case a backend must pass before lorakit trains this family with it."""
    return tuple(c.name for c in _adapter(family).attention_cases) + (model_case(family),)


def family_masked(family: str) -> bool:
    """Does the family pass a text mask into attention (flash refuses masks)?"""
    return any(c.masked for c in _adapter(family).attention_cases)


def all_cases() -> tuple[AttentionCase, ...]:
    """The bare cases of every registered family, once each."""
    from lorakit.models.registry import family_names

    seen: dict[str, AttentionCase] = {}
    for f in family_names():
        for c in _adapter(f).attention_cases:
            seen.setdefault(c.name, c)
    return tuple(seen.values())


def all_model_cases() -> tuple[str, ...]:
    from lorakit.models.registry import arch_names

    return tuple(f"model {a}" for a in arch_names())


def known_bad(fingerprint_: dict, backend: str, family: str | None = None) -> str | None:
    """Why a backend is excluded on this stack for a family (any family when None); None when it is not.
    The rules are the families' own (`Adapter.known_bad_attention`): backends seen failing intermittently there
    (a kernel that passes once can still corrupt memory later)."""
    from lorakit.models.registry import family_names

    for fam in [family] if family else family_names():
        for b, cudnn, capability, why in _adapter(fam).known_bad_attention:
            if (b == backend and str(fingerprint_.get("cudnn") or "").startswith(cudnn)
                    and fingerprint_.get("capability") == capability):
                return f"{why} (for {fam})" if family is None else why
    return None


# --------------------------------------------------------------------------- one case, in the child


def _sdp_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def fingerprint(device: str = "cuda", facts=None) -> dict:
    """What the self-test result depends on: GPU, driver, torch, CUDA, cuDNN (from the probe's `facts`, so a
    cached doctor answers without importing torch; probed when None)."""
    if facts is None:  # a training run: the same answer doctor keyed its report by, probed once per machine
        from lorakit.hardware.probe import probe

        facts = probe(use_cache=True)
    cudnn = facts.cudnn
    if cudnn and "." in cudnn:  # "9.19.0" -> 91900, as torch.backends.cudnn.version() says it
        a, b, c = (int(x) for x in (cudnn.split(".") + ["0", "0"])[:3])
        cudnn = a * 10000 + b * 100 + c
    elif cudnn:
        cudnn = int(cudnn)
    fp = {"torch": facts.torch, "cuda": facts.torch_cuda, "cudnn": cudnn, "device": device,
          "fa4": fa4.installed()}  # installing flash-attn-4 (or another release) means measuring again
    index = int(device.split(":")[1]) if ":" in device else 0
    if device.startswith("cuda") and len(facts.gpus) > index:
        g = facts.gpus[index]
        fp.update(gpu=g.name, capability=f"{g.capability[0]}.{g.capability[1]}", driver=facts.driver)
    else:
        import platform

        fp.update(gpu=None, cpu=platform.processor() or platform.machine())
    return fp


def cache_root() -> Path:
    base = os.environ.get("LORAKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lorakit")
    return Path(base)


def _cache_file(fp: dict) -> Path:
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "attention" / f"{key}.json"


def run_case(backend: str, case: AttentionCase, device: str, repeats: int) -> CaseResult:
    """Forward + backward of one backend, with tensors laid out as the diffusers transformers lay them out.

    diffusers projects q/k/v to (batch, seq, heads, head_dim) and permutes them to (batch, heads, seq,
    head_dim) for SDPA, then permutes the output back and flattens the heads: the kernels see strided
    inputs and a strided output gradient. Contiguous tensors would pass where the real model fails.
    """
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    seq, heads, hd, dtype = case.seq, case.heads, case.head_dim, torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(1, seq, heads, hd, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(3)]
    width = heads * hd * (5 if case.layout == "single" else 1)  # single: attention (1x) + MLP (4x)
    weight = torch.randn(1, seq, width, device=device, dtype=torch.float32, generator=g)
    mlp = torch.randn(1, seq, width - heads * hd, device=device, dtype=dtype, generator=g)
    mask = None
    if case.masked:  # the last 10% of keys are padding, as with padded text
        keep = torch.ones(seq, dtype=torch.bool, device=device)
        keep[int(seq * 0.9):] = False
        mask = keep[None, None, None, :]
    times = []
    try:
        if backend == "fa4":
            fa4.activate()  # SDPA's flash path now runs FlashAttention 4
        with sdpa_kernel([_sdp_backend("flash" if backend == "fa4" else backend)]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "kernel not used because ..." is what we record
            for i in range(repeats + 1):
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                q, k, v = (t.permute(0, 2, 1, 3) for t in base)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out = out.permute(0, 2, 1, 3).reshape(1, seq, heads * hd)
                if case.layout == "single":
                    out = torch.cat([out, mlp], dim=2)
                (out.float() * weight).mean().backward()
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                if i:  # the first run is warm-up
                    times.append((time.perf_counter() - t0) * 1e3)
                if not all(torch.isfinite(t.grad).all() for t in base):
                    return CaseResult(backend, case.name, False, error="non-finite gradients")
                for t in base:
                    t.grad = None
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        return CaseResult(backend, case.name, False, error=_error_line(e))
    finally:
        fa4.deactivate()
    times.sort()
    return CaseResult(backend, case.name, True, ms=round(times[len(times) // 2], 3))


def _error_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {msg[:300]}"


def _context_lost(r: CaseResult) -> bool:
    return not r.ok and any(s in (r.error or "") for s in ("CUDA error", "AcceleratorError", "CUBLAS_STATUS"))


def _child_main(mode: str) -> None:
    """The child process: import what the jobs need, say "ready", read the jobs (one JSON line on stdin), run
    them in order, one JSON line each as it finishes; stop after a job that lost the CUDA context (the parent
    starts a fresh child for the rest). A "models" child also imports diffusers and the families before it is
    ready, so one started early (a spare) has its imports done when its model case comes."""
    import torch  # noqa: F401 - imported before "ready": the watchdog then times the cases only

    fa4.preimport()  # where flash-attn-4 is installed: ~10 s of imports, not a hung kernel
    if mode == "models":
        import diffusers  # noqa: F401

        from lorakit.hardware import attention_model  # noqa: F401
        from lorakit.models.registry import family_names

        family_names()
    print(json.dumps({"ready": True}), flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # an unused spare
    spec = json.loads(line)
    cases = {c["name"]: AttentionCase(**c) for c in spec["cases"]}
    # testing aid: LORAKIT_ATTENTION_TEST_SLEEP="case=seconds" makes that case hang like a stuck kernel
    hang = dict(x.split("=") for x in os.environ.get("LORAKIT_ATTENTION_TEST_SLEEP", "").split(",") if "=" in x)
    for backend, name in spec["jobs"]:
        if name in hang:
            time.sleep(float(hang[name]))
        if name.startswith("model "):
            from lorakit.hardware.attention_model import run_model_case

            r = run_model_case(name, backend, spec["device"], repeats=spec["repeats"])
        else:
            r = run_case(backend, cases[name], spec["device"], spec["repeats"])
        print(json.dumps(asdict(r)), flush=True)
        if _context_lost(r):
            return
        if spec["device"].startswith("cuda"):
            torch.cuda.empty_cache()


def spawn(models: bool = False) -> subprocess.Popen:
    """A child process for `run_jobs` (it starts importing at once and then waits for its jobs)."""
    return subprocess.Popen([sys.executable, "-m", "lorakit.hardware.attention", "models" if models else "bare"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _close(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:
                pass


# --------------------------------------------------------------------------- children, watched


def _read_line(p: subprocess.Popen, timeout: float) -> str | None:
    """The child's next stdout line, or None after `timeout` seconds (or at its end)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return None
        return p.stdout.readline() or None
    finally:
        sel.close()


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
            ready = _read_line(p, startup)
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
                line = _read_line(p, watchdog)
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
                if _context_lost(r):
                    break
        finally:
            _close(p)
    return out


def _dead(job: tuple[str, str], p: subprocess.Popen, why: str | None = None) -> CaseResult:
    if why is None:
        p.wait()
        tail = (p.stderr.read().strip().splitlines() or ["no output"])[-1][:300]
        why = f"test process died (exit {p.returncode}): {tail}"
    return CaseResult(job[0], job[1], False, error=why)


# --------------------------------------------------------------------------- the self-test


def prestart(models=None) -> dict:
    """Children for a coming `self_test`, started now so their imports overlap the parent's own (doctor
    starts them before it probes): one for the bare shapes, two per model case."""
    models = all_model_cases() if models is None else models
    return {"bare": spawn(), "models": {m: [spawn(models=True), spawn(models=True)] for m in models}}


def close_children(children: dict | None) -> None:
    """Stop the children `prestart` made that were not used."""
    for p in [(children or {}).get("bare")] + [p for ps in (children or {}).get("models", {}).values() for p in ps]:
        if p is not None:
            _close(p)


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
    fp = fingerprint(device, facts)
    fp.update(cases=[asdict(c) for c in cases], models=list(models), version=VERSION)
    path = _cache_file(fp)
    if use_cache and path.is_file():
        try:
            report = AttentionReport.from_dict(json.loads(path.read_text()))
            close_children(children)
            return report
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is simply re-measured
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
            with ThreadPoolExecutor(max_workers=len(models)) as ex:  # architectures in parallel children
                for rows in ex.map(lambda m: _model_case(report, m, device, watchdog, progress, spares[m]),
                                   models):
                    report.results += rows
    finally:
        for p in (p for ps in spares.values() for p in ps):
            _close(p)
    from lorakit.models.registry import family_names

    report.choice = {fam: choose(report, fam) for fam in family_names()}
    report.seconds = round(time.perf_counter() - t0, 1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report.to_dict(), indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-run
    return report


def _model_case(report: AttentionReport, case: str, device: str, watchdog: float, progress,
                spares: list | None = None) -> list[CaseResult]:
    """The in-model case of one architecture, with candidate backends fastest first, until every family of the
    architecture has a backend that passed everything. Each candidate runs twice, in two fresh processes at
    once (a kernel that fails only now and then, as cuDNN inside FLUX did, gets two chances to show it)."""
    from lorakit.models.registry import family_names

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
        with ThreadPoolExecutor(max_workers=2) as ex:  # two fresh processes at once
            tries = list(ex.map(lambda job: run_jobs([job], device, 5, watchdog=watchdog * 2,
                                                     spare=spares.pop() if spares else None)[0],
                                [(backend, case)] * 2))
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


def measured_backends(fingerprint_: dict) -> tuple[str, ...]:
    """The backends the self-test measures on this machine: PyTorch's four, and fa4 where flash-attn-4 is
    installed and could run (`fa4.candidate`)."""
    return ALL_BACKENDS if fa4.candidate(fingerprint_) else BACKENDS


def _unmasked_twin(case_name: str) -> str | None:
    """The bare case of the same shape without a mask (for flash on batches whose mask masks nothing)."""
    by_name = {c.name: c for c in all_cases()}
    c = by_name.get(case_name)
    if c is None or not c.masked:
        return None
    return next((o.name for o in by_name.values() if not o.masked and (o.seq, o.layout, o.head_dim, o.heads)
                 == (c.seq, c.layout, c.head_dim, c.heads)), None)


def _px(case: str) -> int | None:
    """The resolution a bare case stands for ("1024px single" -> 1024)."""
    head = case.split("px")[0]
    return int(head) if "px" in case and head.isdigit() else None


def _timed_cases(cases, resolution: int | None) -> set:
    """The bare cases whose times rank the backends: all of them, or, for a run at `resolution`, those of the
    nearest resolution measured (kernels rank differently at 512² and 1024²: FlashAttention 4 is faster than
    PyTorch's flash at 4608 tokens and slower at 1536 on an H100)."""
    bare = {c for c in cases if not c.startswith("model ")}
    sized = {c: _px(c) for c in bare if _px(c)}
    if resolution is None or not sized:
        return bare
    nearest = min(set(sized.values()), key=lambda px: (abs(px - resolution), -px))  # a tie: the larger
    return {c for c, px in sized.items() if px == nearest}


def choose(report: AttentionReport, family: str, resolution: int | None = None, exclude=()) -> str | None:
    """Fastest backend that passed every case relevant to a family and measured (None if none did); with
    `resolution`, fastest at the cases nearest that resolution (it must still pass them all); never one of
    `exclude` (alone or in a pair)."""
    measured = {r.case for r in report.results}
    relevant = set(family_cases(family)) & measured
    timed = _timed_cases(relevant, resolution)
    best, best_ms = None, None
    for backend in (b for b in ALL_BACKENDS if b not in exclude):
        rs = [r for r in report.results if r.backend == backend and r.case in relevant]
        if not relevant or {r.case for r in rs} != relevant or not all(r.ok for r in rs):
            continue
        if known_bad(report.fingerprint, backend, family):
            continue
        total = sum(r.ms or 0.0 for r in rs if r.case in timed)
        if best_ms is None or total < best_ms:
            best, best_ms = backend, total
    if best == "efficient" and family_masked(family):
        # a batch whose prompts have one length carries no mask (train/data.drop_full_mask): a flash kernel
        # (PyTorch's, or FlashAttention 4) can take it, if it passed the same shapes unmasked — the faster of the
        # two that did; the recompute sees the same inputs, so it picks the same kernel
        twins = [t for t in (_unmasked_twin(c) for c in relevant) if t]
        timed_twins = {_unmasked_twin(c) for c in timed}
        fast, fast_ms = None, None
        for b in (b for b in ("flash", "fa4") if b not in exclude):
            plain = [r for r in report.results if r.backend == b and r.case in twins]
            if twins and len(plain) == len(twins) and all(r.ok for r in plain) \
                    and not known_bad(report.fingerprint, b, family):
                ms = sum(r.ms or 0.0 for r in plain if r.case in timed_twins)
                if fast_ms is None or ms < fast_ms:
                    fast, fast_ms = b, ms
        if fast:
            return f"{fast}+efficient"
    return best


def apply(backend: str | None, fallback: bool = False) -> dict:
    """Put one SDPA backend in force globally (forward, backward and recompute alike).

    `fallback`: keep the math backend on as the last resort for attention calls the chosen kernel cannot
    take at all. The self-test showed the chosen kernel takes every call of the family's transformer, so
    PyTorch never picks math there; the VAEs' single 512-wide head (FLUX) or 384-wide (Qwen-Image) in the
    sample decode is such a call, and with every other backend off PyTorch fails it ("Invalid backend").

    Returns:
        the previous switch states, for `restore`.
    """
    import torch

    b = torch.backends.cuda
    prev = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled(), "fa4": fa4.active()}
    if backend is None:
        return prev
    names = backend.split("+")  # "flash+efficient": flash where it can (no mask), efficient where not
    for n in names:
        if n not in ALL_BACKENDS:
            from lorakit.errors import UnknownNameError

            raise UnknownNameError("attention backend", n, list(ALL_BACKENDS))
    fa4.activate() if "fa4" in names else fa4.deactivate()
    b.enable_flash_sdp("flash" in names or "fa4" in names)
    b.enable_mem_efficient_sdp("efficient" in names)
    b.enable_cudnn_sdp("cudnn" in names)
    b.enable_math_sdp("math" in names or fallback)
    return prev


def for_run(cfg, device: str, note=None) -> str | None:
    """The backend a training run uses (memory.attention, else this machine's self-test choice for the
    family, measured once and cached), put in force globally. None on the CPU.

    A cached choice of FlashAttention 4 that cannot run now (the package broken or gone since it was measured)
    gives way to the next fastest measured backend, said through `note`; an explicit memory.attention: fa4 is
    refused instead (`apply`)."""
    if not device.startswith("cuda"):
        return None
    if cfg.memory.attention != "auto":
        choice = cfg.memory.attention
    else:
        report = self_test(device)
        choice = choose(report, cfg.model.family, resolution=cfg.data.resolution)  # fastest at this run's size
        why = fa4.problem(device) if choice and "fa4" in choice.split("+") else None
        if why:
            was, choice = choice, choose(report, cfg.model.family, resolution=cfg.data.resolution, exclude={"fa4"})
            if note:
                note(f"attention: this machine's measurements chose {was} for {cfg.model.family}, but {why}; "
                     f"this run uses {choice or 'PyTorch defaults'} (`lorakit doctor --retest` measures again)")
    apply(choice, fallback=True)
    return choice


def restore(prev: dict) -> None:
    """Undo `apply`."""
    import torch

    b = torch.backends.cuda
    b.enable_flash_sdp(prev["flash"])
    b.enable_mem_efficient_sdp(prev["efficient"])
    b.enable_cudnn_sdp(prev["cudnn"])
    b.enable_math_sdp(prev["math"])
    fa4.activate() if prev.get("fa4") else fa4.deactivate()


if __name__ == "__main__":  # the child process of run_jobs
    _child_main(sys.argv[1])
