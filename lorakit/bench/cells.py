"""A cell of the user-path matrix (`bench.matrix`): one family x profile, what it recorded, how it is judged where
the CPU and GPU share one memory, and the table the cells make."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PROFILES = ("datacenter", "rtx5090", "rtx4090", "dgx-spark")
CAPS = {"rtx5090": 32.0, "rtx4090": 24.0, "dgx-spark": 110.0}  # GiB the profile's GPU has (emulated on a larger one)
SHARED_GIB = {"dgx-spark": 128e9 / 2**30}  # memory the CPU and the GPU share: a stage's GPU peak + private host memory

@dataclass
class Cell:
    family: str
    profile: str
    cap_gib: float | None
    status: str = "pending"  # pass | refused | failed | skipped (time) | pending
    note: str = ""
    stages: dict = field(default_factory=dict)  # stage -> {"s", "rss_gib", "rc", ...}
    first_step_s: float | None = None  # `lorakit train` started -> its first optimizer step finished
    first_step_warm_s: float | None = None  # the same, run again on this machine (train-warm)
    s_per_step_median: float | None = None
    s_per_step_p90: float | None = None
    peak_gpu_gib: float | None = None
    psnr_vs_stock: float | None = None
    refused: str = ""  # `lorakit train`'s refusal at the defaults, where its hint named settings (then run with them)
    sets: list = field(default_factory=list)  # those settings ("memory.blocks_to_swap=5"): the later stages use them
    shared_gib: float | None = None  # shared-memory profiles: the largest GPU peak + private host memory of a stage


def spread(steady: list[float]) -> tuple[float, float]:
    """(median, p90) of sorted step times, rounded to the millisecond."""
    return round(statistics.median(steady), 3), round(steady[min(len(steady) - 1, int(0.9 * len(steady)))], 3)


def shared_check(cell: Cell) -> None:
    """Where the CPU and the GPU share one memory (DGX Spark: 128 GB), a stage needs its GPU peak and its private
    host memory at once: the largest sum of lorakit's stages (the stock pipeline is the reference) must fit, else
    the cell fails, saying which stage needs how much."""
    sums = {}
    for name, st in cell.stages.items():
        gpu = cell.peak_gpu_gib if name == "train" else st.get("peak_gpu_gib")
        if name != "stock" and gpu is not None and st.get("private_gib") is not None:
            sums[name] = round(gpu + st["private_gib"], 1)
    if not sums:
        return
    top = max(sums, key=sums.get)
    cell.shared_gib, limit = sums[top], SHARED_GIB[cell.profile]
    if sums[top] > limit:
        cell.status = "failed"
        cell.note = (f"{top} needs {sums[top]} GiB of GPU and private host memory at once, more than the "
                     f"{limit:.1f} GiB the {cell.profile}'s CPU and GPU share")


def table(cells: list[Cell]) -> str:
    """The matrix as a Markdown table."""
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else (fmt.format(x) if isinstance(x, (int, float)) else str(x))

    head = ("| family | profile (cap) | result | cache s | train s | first step s (warm) | s/step median / p90 | "
            "peak GPU GiB | peak host RSS / private GiB (stage) | infer s | PSNR vs stock dB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for c in cells:
        st = c.stages
        rss = max((s.get("rss_gib") or 0 for s in st.values()), default=None)
        own = {k: s["private_gib"] for k, s in st.items() if s.get("private_gib") is not None and k != "stock"}
        top = max(own, key=own.get) if own else None  # lorakit's stages (the stock pipeline is the reference)
        memory = f"{f(rss)} / {f(own[top]) + f' ({top})' if top else '-'}"
        uncompiled = " (uncompiled)" if "uncompiled" in c.note else ""
        result = c.status if c.status == "pass" else f"{c.status}: {c.note[:160]}"
        if c.shared_gib is not None and c.status == "pass":
            result += f" ({c.shared_gib:g} of the {SHARED_GIB[c.profile]:.1f} GiB shared memory)"
        if c.note.startswith("this GPU has") and c.status == "pass":
            result += f" ({c.note})"
        if c.sets:  # refused at the defaults, then run with the settings the refusal named
            named = "--set " + " --set ".join(c.sets)
            result = (f"refused also with {named}: {c.note[:160]}" if c.status == "refused" else
                      f"{c.status} with {named} (refused at the defaults: {c.refused[:120]})"
                      + (f"; {c.note[:120]}" if c.note and c.status != "pass" else ""))
        rows.append(f"| {c.family} | {c.profile}{f' ({c.cap_gib:g} GiB)' if c.cap_gib else ''} | {result} | "
                    f"{f(st.get('cache', {}).get('s'))} | {f(st.get('train', {}).get('s'))} | {f(c.first_step_s)}"
                    f"{f' ({c.first_step_warm_s:.1f})' if c.first_step_warm_s is not None else ''} | "
                    f"{f(c.s_per_step_median, '{:.3f}')} / {f(c.s_per_step_p90, '{:.3f}')}{uncompiled} | "
                    f"{f(c.peak_gpu_gib)} | {memory} | {f(st.get('infer', {}).get('s'))} | {f(c.psnr_vs_stock)} |")
    text = head + "\n" + "\n".join(rows) + "\n"
    runs = [(c, stage, c.stages[stage]["phases"]) for c in cells for stage in ("train", "train-warm")
            if c.stages.get(stage, {}).get("phases")]
    if runs:  # where each training run's first minutes went
        text += "\nPhases of `lorakit train` (seconds; at: seconds since the command began):\n\n"
        for c, stage, ph in runs:
            text += f"- {c.family} x {c.profile}, {stage}: " + "; ".join(_phase(*p) for p in ph) + "\n"
    return text


def _phase(name: str, secs: float, at: float, step=None, of_which: str | None = None) -> str:
    """One phase of a run in the table's words (`matrix.phases`; results written before 2026-11-26 lack `of_which`)."""
    return f"{name} {secs:.1f} (at {at:.0f}{f'; {of_which}' if of_which else ''})"
