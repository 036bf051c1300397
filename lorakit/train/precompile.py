"""The blocks' graphs compiled ahead, in a process of their own, on a background compile's first run on a machine.

The background compile (`train.compile_bg`) runs the first steps eager while a worker thread compiles the blocks.
The compiler holds Python's interpreter for long stretches, so the run's own thread was starved beside it: FLUX.1-dev
1024² on an H100 (2026-11-27, `tools/race.py lorakit`, a first run on the machine), steps 2-100 took 180 s where 100
steps at the steady pace take 44, and the worker needed 111 s. Here a child process does that compiling: it
rehearses the run's block calls — step 1's batch, the other bucket shapes in the order `train.warm` hands them to
the worker, one sampling step of each grid prompt — on a copy of the transformer with two blocks of each repeated
list and random weights, prepared by the same code (storage, LoRA, dtypes, compile options, attention backend).
Torch compiles the same graphs there, in the same order, and keeps them in this machine's compile cache.
Meanwhile the run trains eager with the interpreter to itself; its worker waits for the child's training graphs
(step 1 and the other shapes: the child says so in a file and goes on with the grid's), then hands the calls back to
the run's thread, which takes each one's graphs from the cache between two steps, and the blocks switch to compiled
code there (`train.compile_bg`); the grid's calls take theirs at the next grid. Waiting for the child's end instead
kept the steps uncompiled through the grid's compile and the process's exit: FLUX.1-dev 1024² on an H200
(2026-11-30), the child's step 1 took 51.0 s, its grid 18.8 s, and the run switched 79.5 s after handing it over.

Where the family has several kinds of block (FLUX's double and single blocks) and the card has room, a child per
kind compiles at once, each its kind's graphs, the other kinds' blocks running uncompiled in it (`kinds_apart`).
On a first run with these settings the child starts before the caching (its imports overlap it) and builds its
copy once the caching is done (the copy overlaps the model's load); on the family's first run on the machine
`lorakit train` starts it with the config's check (`start_early`) and it builds its copy as the caching begins. On a
GPU it lowers its CPU priority below the run's and starts Inductor's compile workers once its imports are done (their
imports then overlap the run's checks and caching: FLUX.1-dev, one H200, 2026-12-01, begun 2.6 s after the hand-over
against 6.0 with the workers started after the copy); it is handed its inputs once the model is
prepared and the attention backend chosen (`Rehearsal.go`), and ends with the run (also when the run's process is
gone). One that fails leaves the compiling to the worker, as before; the run says why (the end of its log). Its own
side is `train.rehearse`."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path

from lorakit.hardware import probe as probe_mod
from lorakit.hardware.attention import cached_family_report
from lorakit.hardware.gpu import run_environment
from lorakit.models.batch import Batch
from lorakit.models.registry import BLOCK_KINDS, family_info
from lorakit.plan.decide import repeated_block_kinds
from lorakit.plan.memory import PLAN_MARGIN_GIB
from lorakit.train import dims, sampling, warm
from lorakit.train.inputs import draw

BLOCKS = 2  # of each repeated list: the first block's inputs need no gradient, the next ones' do
WAIT_S = 1800.0  # the longest the worker waits for the process (a hung compile must not keep a run uncompiled)
ENV = "LORAKIT_PRECOMPILE"  # "0": the worker thread compiles alone; "1": the CPU too (where its blocks compile)
NICE = 10  # the child and its compile workers yield the CPU to the run's thread where both want it
WARM = "--warm"  # the child's argument on a GPU: its priority lowered and its compile workers started at once


def wanted(cfg, device: str, world: int) -> bool:
    """Does this run compile its blocks in the background, alone (no CUDA graphs, no swapped blocks; one process,
    or each rank of a LoRA run with its own process: FSDP's blocks are not the copy's), on a GPU (or anywhere, with
    LORAKIT_PRECOMPILE=1)? Each rank of a data parallel run compiling in its worker thread starved it, and every
    rank waits for the slowest: Qwen-Image 1024² LoRA on 2x H200 (2026-11-29, a first run, batch 1 x accumulation
    2 per rank), steps 2-10 took 2.6-37.8 s each against 0.8 s steady."""
    m, env = cfg.memory, os.environ.get(ENV, "")
    return ((device.startswith("cuda") or env == "1") and env != "0" and m.compile and m.compile_background is True
            and (world == 1 or cfg.method == "lora") and not m.cuda_graphs and not m.blocks_to_swap)


# what a launcher tells a rank: the child is no rank (nothing in it joins the run's process group)
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def child_gib(est: dict) -> float:
    """GPU memory the process holds beside the run, from the run's estimate: its CUDA context, `BLOCKS` blocks of
    (at most) two kinds out of the run's blocks, and their working sets in one pass (FLUX.1-dev 1024²: about 4.2 GiB;
    measured on an H100, 2026-11-27: the card's peak 53.4 GiB against 49.5 without it)."""
    kept = min(2 * BLOCKS, est["blocks"])
    return 1.0 + est["parts"]["base"] * kept / est["blocks"] + kept * est["block_gib"]


def lacks_room(est: dict | None, budget: float, processes: int = 1) -> str | None:
    """Why the card has no room for the process(es) beside the run's uncompiled steps (None: it has)."""
    if not est:
        return None
    need = est.get("uncompiled_gib", est["gib"]) + processes * child_gib(est)
    if need > budget - PLAN_MARGIN_GIB:
        return f"no room beside the run for a separate compile process (about {need:.1f} GiB of {budget:.0f})"
    return None


def cores_for_kinds(device: str, world: int = 1) -> bool:
    """A GPU run whose machine has 8 cores for each of its `world` ranks: where a process per kind of block pays."""
    return device.startswith("cuda") and (os.cpu_count() or 1) // max(world, 1) >= 8


def kinds_apart(cfg, device: str, est: dict | None, budget: float | None, world: int = 1) -> list[str] | None:
    """The kinds of block that compile in a process each, at once (None: one process compiles them all): on a GPU
    with 8 cores for each of the `world` ranks, where the family has more than one kind and the card room for each.
    FLUX.1-dev 1024² on an H200 (2026-11-30, a first run): one process compiled the double and the single blocks
    one after the other in 31.7 s, and the run's steps 2-25 ran uncompiled at 0.593 s against 0.428 meanwhile; a
    process per kind, 21.4-24.7 s, the run compiled from step 4-7 (2x H200 host, `tools/race.py lorakit`)."""
    if not cores_for_kinds(device, world):
        return None
    kinds = repeated_block_kinds(cfg.model.family)
    if len(kinds) < 2 or (budget is not None and lacks_room(est, budget, len(kinds))):
        return None
    return kinds


EARLY: dict = {}  # "folder", "parts": the processes `start_early` started, not yet a Rehearsal's


def start_early(cfg, device: str, world: int = 1) -> int:
    """Start a first run's compile processes once its config is read (`lorakit train`, before the plan imports a
    model library), so that their imports (torch, diffusers: 9.2 s on one H200, 2026-11-30, begun with the run's
    setup) run beside the run's checks, and their copies are built as the caching begins (`Rehearsal` takes them):
    FLUX.1-dev 1024² there, started with the setup, they began compiling 6.0 s after the run handed over its inputs
    and had the graphs in the cache 2.3 s after the step-0 grid, too late to be taken during it. Started where the
    run may want them — `wanted` with memory.compile_background auto or true, a plan that keeps the base in bf16 —
    on the family's first run on this machine (its attention not measured here yet; another first run with these
    settings starts them with its setup, as before), one per kind of block where the machine has 8 cores for each
    (`kinds_apart`), all at once (their count from the registry's `BLOCK_KINDS`: found from diffusers, the second
    one waited for its import, 7.6 s of the check under cProfile on one H200, 2026-12-01); those the run does not
    take end with `drop_early`, or with this process. Returns how many."""
    m = cfg.memory
    maybe = cfg.model_copy(update={"memory": m.model_copy(update={"compile_background": True})})
    if EARLY or m.compile_background is False or m.base_quant != "none" or not wanted(maybe, device, world):
        return 0
    if probe_mod.facts_cached() and cached_family_report(cfg.model.family, device) is not None:
        return 0  # the family has run here before
    # the environment the run's setup makes, which the processes inherit (without its compile cache they filled
    # Inductor's default and the run found nothing: FLUX.1-dev, one H200, 2026-11-30, "0 of 4 graphs from the cache")
    run_environment(m, device)
    EARLY["folder"] = Path(tempfile.mkdtemp(prefix="lorakit-compile-"))
    kinds = BLOCK_KINDS.get(family_info(cfg.model.family).transformer_class) or \
        len(repeated_block_kinds(cfg.model.family))  # a class the registry does not know: from diffusers
    gpu = device.startswith("cuda")
    EARLY["parts"] = [_Process(EARLY["folder"] / str(n), warm=gpu)
                      for n in range(kinds if kinds > 1 and cores_for_kinds(device, world) else 1)]
    atexit.register(drop_early)
    return len(EARLY["parts"])


def drop_early() -> None:
    """End the processes `start_early` started that no run took, and remove their folder."""
    for p in EARLY.pop("parts", []):
        p.close()
    folder = EARLY.pop("folder", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class _Process:
    """One child process (see the module), compiling the graphs of `kinds` (None: of every kind of block)."""

    def __init__(self, folder: Path, kinds: list[str] | None = None, warm: bool = False):
        """`warm`: the child compiles on a GPU (`WARM`: its compile workers start once its imports are
        done)."""
        self.folder, self.kinds = folder, kinds
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = self.folder / "compile.log"
        self._result: dict | None = None
        self._lock = threading.Lock()
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this lorakit
        if root not in site.getsitepackages() + [site.getusersitepackages()]:  # a source checkout: found from there
            env["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
        cmd = [sys.executable, "-m", "lorakit.train.rehearse", *([WARM] if warm else [])]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                         env=env)

    def build(self, cfg, device: str) -> None:
        """Have the child build its copy of the run's transformer (it has its imports done by then, or does them)."""
        self.send({"config": cfg.model_dump(mode="json"), "device": device, "kinds": self.kinds,
                   "result": str(self.folder / "result.json"), "training": str(self.folder / "training.json")})

    def send(self, line: dict | None) -> None:
        try:
            if line is not None:
                self.proc.stdin.write(json.dumps(line) + "\n")
                self.proc.stdin.flush()
            else:
                self.proc.stdin.close()
        except (OSError, ValueError):  # the child is gone: `wait` says why
            pass

    def wait(self, end: float, timeout: float, training: bool = False) -> None:
        """Block until the child ends (with `training`: or its training graphs are in the cache), the GIL released
        meanwhile; one still running at `end` (`time.monotonic`, `timeout` seconds after the wait began) is ended."""
        while self.proc.poll() is None and not (training and self.training()):
            left = end - time.monotonic()
            if left <= 0:
                self.proc.kill()
                self.proc.wait()
                with self._lock:
                    self._result = {"ok": False, "why": f"no result after {timeout:.0f} s, ended"}
                break
            try:
                self.proc.wait(min(0.2, left) if training else left)
            except subprocess.TimeoutExpired:
                pass

    def training(self) -> dict | None:
        """What the child said once its training graphs were in the cache (None: not yet, or never)."""
        try:
            return json.loads((self.folder / "training.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def result(self) -> dict:
        with self._lock:
            if self._result is None and self.proc.poll() is not None:
                try:
                    self._result = json.loads((self.folder / "result.json").read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    tail = self.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:] \
                        if self.log.is_file() else []
                    self._result = {"ok": False, "why": (f"{' + '.join(self.kinds)}: " if self.kinds else "")
                                    + f"exited with code {self.proc.returncode}"
                                    + (": " + " | ".join(ln.strip()[:200] for ln in tail) if tail else "")}
            return dict(self._result) if self._result is not None else {"ok": None}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.result()


def merged(got: list[dict]) -> dict:
    """The processes' news as one: a failure where one failed, nothing yet where one has not answered, else the
    graphs of all, the seconds and each part's seconds of the slowest."""
    failed = [g for g in got if g.get("ok") is False]
    if failed or len(got) == 1:
        return dict(failed[0] if failed else got[0])
    if any(g.get("ok") is None for g in got):
        return {"ok": None}
    parts: dict = {}
    for g in got:
        for k, v in (g.get("parts") or {}).items():
            parts[k] = max(parts.get(k, 0.0), v)
    out = {"ok": True, "seconds": max(g["seconds"] for g in got), "graphs": sum(g.get("graphs", 0) for g in got),
           "parts": parts, "processes": len(got)}
    slow = max(got, key=lambda g: g.get("late", 0.0))  # the process that began last
    out |= {k: slow[k] for k in ("late", "start") if k in slow}
    grid = max(g.get("grid_prompts", 0) for g in got)
    return out | ({"grid_prompts": grid} if grid else {})


class Rehearsal:
    """The child processes (see the module): one per kind of block in `kinds` (each compiles its kind's graphs,
    the others' blocks run uncompiled there; all at once), else one for all; started now (their imports), told to
    build their copies (now, or by `build` once the run's caching is done), handed their inputs by `go`, waited for
    by the worker."""

    def __init__(self, cfg, device: str, kinds: list[str] | None = None, build: bool = True):
        self.said, self.built = False, False
        apart = kinds if kinds and len(kinds) > 1 else [None]
        early = EARLY.pop("parts", [])  # started by `start_early`: theirs first, the rest now
        self.folder = EARLY.pop("folder", None) or Path(tempfile.mkdtemp(prefix="lorakit-compile-"))
        for p in early[len(apart):]:
            p.close()
        self.parts = early[:len(apart)] + [_Process(self.folder / str(n), warm=device.startswith("cuda"))
                                           for n in range(len(early), len(apart))]
        for p, k in zip(self.parts, apart, strict=True):
            p.kinds = [k] if k else None
        if build or early:  # started early: their imports are done, their copies built now, beside the caching
            self.build(cfg, device)

    def build(self, cfg, device: str) -> None:
        """Have the children build their copies of the run's transformer, with `cfg` as it stands now (once)."""
        if not self.built:
            self.built = True
            for p in self.parts:
                p.build(cfg, device)

    def go(self, tr, conds, varying: dict | None = None, carried: dict | None = None,
           packs: dict | None = None) -> None:
        """Hand the children the run's inputs (step 1's, the other shapes', the grid's prompts), the attention
        backend in force, the sizes the run's blocks compile symbolic, the inputs they take with gradients and
        those they join (`train.dims`): they compile now."""
        import torch

        path = self.folder / "inputs.pt"
        torch.save(plain(rehearsal_inputs(tr, conds)), path)  # read back with weights_only=True
        for p in self.parts:
            p.send({"inputs": str(path), "attention": tr.cfg.memory.attention,
                    "dims": dims.to_json(varying or {}, carried, packs), "sent": time.time()})
            p.send(None)

    def wait(self, timeout: float = WAIT_S, training: bool = False) -> dict:
        """Block until the children end — with `training`, until their training graphs are in the cache, or they
        ended — the GIL released meanwhile; those still running after `timeout` seconds are ended. Returns {"ok",
        "seconds", "graphs", "parts"} or {"ok": False, "why"}."""
        end = time.monotonic() + timeout
        for p in self.parts:
            p.wait(end, timeout, training)
        return self.state()

    def state(self) -> dict:
        """The training graphs' news where each child gave it (a failure in the grid's compile after it leaves
        those calls to the run), else the results."""
        return merged([p.training() or p.result() for p in self.parts])

    def result(self) -> dict:
        return merged([p.result() for p in self.parts])

    @property
    def where(self) -> str:
        n = len(self.parts)
        return "a separate process" if n == 1 else f"{n} separate processes (a kind of block each, at once)"

    @property
    def done(self) -> bool:
        return all(p.proc.poll() is not None for p in self.parts)

    def news(self) -> str | None:
        """Once the children's training graphs are in the cache, or one has ended without them: what they did, in
        one line, said once (None before, and after it was said)."""
        if self.said:
            return None
        r = self.state()
        if r.get("ok") is None:
            return None
        self.said = True
        if r.get("ok"):
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in (r.get("parts") or {}).items())
            grid = "; the grid's follow there" if r.get("grid_prompts") else ""
            late = ""
            if r.get("late", 0) >= 1:  # its imports and its copy were not done when the run handed over
                st = r.get("start") or {}
                start = f" (its imports {st['imports']:.1f} s, its copy {st['copy']:.1f} s" + (
                    f", started {st['before']:.1f} s before the hand-over, built {abs(st['built']):.1f} s "
                    f"{'before' if st['built'] >= 0 else 'after'} it" + (
                        f", its inputs read {st['read']:.1f} s after it" if "read" in st else "") + ")"
                    if "before" in st else ")") if st else ""
                late = f", begun {r['late']:.1f} s after the run handed over its inputs{start}"
            return (f"the blocks' {r.get('graphs', '?')} graphs compiled in {self.where} in {r['seconds']:.1f} s "
                    f"{f'({parts}{late}) ' if parts else ''}(into this machine's compile cache); the run takes them "
                    f"from there (while a grid renders, else between two steps){grid}")
        return f"the separate compile process failed ({r.get('why')}); the worker compiles the blocks itself"

    def close(self) -> None:
        """End the children still running and remove their folder. Called again, it returns at once."""
        for p in self.parts:
            p.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def rehearsal_inputs(tr, conds) -> dict:
    """What the child runs, in the run's order: step 1's inputs, the other shapes `train.warm` passes to the
    worker after it, the grid's conditions (their images left out)."""
    from dataclasses import replace

    first = draw(tr, tr.step, 0)
    size = warm.pixels(tr.adapter, first.batch.latents.shape)
    return {"first": (first.batch, first.sigmas, first.noise), "warm": warm.to_warm(tr, {size}),
            "conds": [replace(c, control_images=[]) for c in conds or []]}


def plain(x):
    """The inputs as tensors, numbers, strings, lists and dicts (what `torch.load(weights_only=True)` reads): each
    Batch or Condition a dict naming its class."""
    if isinstance(x, (Batch, sampling.Condition)):
        return {"class": type(x).__name__, **{f.name: plain(getattr(x, f.name)) for f in fields(x)}}
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x
