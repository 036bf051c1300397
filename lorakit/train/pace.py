"""Who sets a run's pace, measured in the run: the host (Python launching the step's kernels) or the GPU.

A step ends with one wait of the host for the GPU: `Trainer.train_step` reads the loss after it has queued the
backward, the update and the next inputs (`Trainer.wait_s`). Where the GPU is the slower, the host gets there early
and waits for the rest of the GPU's work; where the host is, the GPU is done by then, and the wait is near nothing.
Once `WINDOW` steady steps are in (not the first, not one that compiled), a run whose median wait is under `SHARE`
of its median step says so, once, with the settings that launch fewer kernels from Python where this run could
take them (`hints`); not where blocks are swapped (the step waits for their copies before the loss). Whether they
pay is the machine's: Qwen-Image 1024², rtx4090 profile, an H200 held to 24 GiB (2026-12-02/03, `tools/race.py
lorakit`): on hosts where the loop around the step took 1.1 ms the default step was 0.56-0.57 s, the host's launches
~0.44 s of it, and the C++ wrapper's 0.48; on one where it took 0.6 ms the default ran at the GPU's pace, 0.403 s
(the C++ wrapper 0.411). A real 24 GB card's slower GPU hides the host behind it."""

from __future__ import annotations

import statistics

from lorakit.plan.decide import compiled_recompute_decision, cpp_wrapper_decision

WINDOW = 20  # steady steps measured before the run is judged
SHARE = 0.05  # a median wait under this share of the median step: the GPU waited for the host, not the reverse
SKIP = 2  # steps after the first left out (the allocator and the caches settle)


def hints(cfg, device: str, graphs_possible: bool) -> list[str]:
    """The settings this run could take that launch fewer kernels from Python, each with what it costs: the C++
    wrapper (where its decision would let it on, and the compiled recompute's decision would keep it under it with
    this attention) and CUDA graphs (where the plan could replay them)."""
    m, out = cfg.memory, []
    asked = cfg.model_copy(update={"memory": m.model_copy(update={"cpp_wrapper": True})})
    keeps_recompute = not m.compiled_recompute or compiled_recompute_decision(
        cfg, device, True, 1, False, cpp_attention=m.attention)[0]  # on now: compiled, recomputing, no worker
    if m.cpp_wrapper is not True and keeps_recompute and cpp_wrapper_decision(
            asked, device, bool(m.compile), bool(m.cuda_graphs), False)[0]:
        out.append("--set memory.cpp_wrapper=true (the blocks' kernels launched from C++; a machine's first run "
                   "compiles ~40-65 s longer)")
    if graphs_possible and not m.cuda_graphs:
        out.append("--set memory.cuda_graphs=true (each block replayed in one launch; each bucket shape and text "
                   "length records its graphs once)")
    return out


class Pace:
    """Step records in, one notice out (`take`), and the figures for the run's result (`facts`)."""

    def __init__(self, on: bool, hints: list[str]):
        self.on, self.hints = on, hints
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.seen = 0  # steady steps offered so far (the first SKIP are left out)
        self.judged: dict | None = None

    def take(self, rec: dict, steady: bool) -> str | None:
        """A step's record (`wait_s` of `step_s`); `steady`: not the first step, nor one that compiled or ran
        blocks uncompiled. Returns the notice, once, where the host set the pace."""
        if not self.on or self.judged is not None or not steady or "wait_s" not in rec or "step_s" not in rec:
            return None
        self.seen += 1
        if self.seen <= SKIP:
            return None
        self.waits.append(rec["wait_s"])
        self.steps.append(rec["step_s"])
        if len(self.steps) < WINDOW:
            return None
        wait, step = statistics.median(self.waits), statistics.median(self.steps)
        host = step > 0 and wait < SHARE * step
        self.judged = {"host_sets_pace": host, "wait_median_s": round(wait, 4), "step_median_s": round(step, 4),
                       "steps": len(self.steps), "last_step": rec.get("step")}
        if not host:
            return None
        first = rec.get("step", 0) - len(self.steps) + 1
        ms = f"{wait * 1000:.{0 if wait >= 0.01 else 1}f}"  # a wait under 10 ms with its tenth: not "0 ms"
        said = (f"the host sets this run's pace: the GPU runs each step's kernels as fast as Python launches them "
                f"(the host waited for the GPU {ms} ms of a {step:.3f} s step, median of steps "
                f"{first}-{rec.get('step')})")
        return said + ("; fewer launches: " + " or ".join(self.hints) if self.hints else "")

    def facts(self) -> dict | None:
        return self.judged
