"""The user-path matrix: every family x profile the way a new user walks it, at full size on a GPU machine.

Per family, once: a random-weight model folder in the hub's layout (`bench.hub.write_model`; the components a family
shares with the one before, Qwen-Image's with its Edit models, hard-linked from its folder instead of written again)
and a small dataset in three aspect ratios (edit families: with controls; video: clips). Per family and profile (a cell), each stage a
separate `lorakit` process as a user runs it, stdout to a file, the profile's card emulated with
LORAKIT_MEMORY_CAP_GIB: `lorakit cache`, `lorakit train` (20 steps), `lorakit infer` with the LoRA, and the stock
diffusers pipeline with `load_lora_weights` (same seed, same size; uncapped: the reference), images compared (PSNR).

A cell passes, or is refused by `lorakit train` before loading with an exit-2 message naming a setting that fits;
where the hint names it as `--set key=value`, the cell runs on with it (train and the later stages), so the table
shows whether the named setting does fit.
Recorded per cell: each stage's wall time and peak host RSS, seconds from `lorakit train` to its first finished
optimizer step, median and p90 s/step (of the steps that did not wait for the compiler), each training run's
phases, peak GPU memory, PSNR against stock. Results are written after every stage (`matrix.json`, `matrix.md`), so a run cut short still says what it measured; `limit_s`
stops starting stages once the time is spent. On a machine with several GPUs, `scripts/matrix_lanes.sh` runs one
matrix per GPU at once (ONE_GPU=1: several on one GPU; LORAKIT_BENCH_SHARED_GPU=1 then runs the uncapped stock
pipeline one component at a time, so that it fits beside the other lanes). Each stage's peak private (anonymous) memory is sampled beside its RSS. dgx-spark cells run
under a 110 GiB cap (an H200 has room; a smaller GPU runs them at its own size, said) and must also fit the Spark's
128 GB that CPU and GPU share: a stage's GPU peak plus its private host memory (`shared_check`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from lorakit.bench.cells import CAPS, PROFILES, SHARED_GIB, Cell, shared_check, spread, table
from lorakit.bench.hub import remove_model, reusable, weight_files, write_model
from lorakit.bench.load import drop_cache
from lorakit.data.demo import demo_layout_for, make_demo_dataset
from lorakit.data.video import Window, probe, read_window
from lorakit.errors import InputError
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_names

STAGES = ("cache", "train", "train-warm", "infer", "stock")  # train-warm: the same training again (compile cache warm)
PROMPT = "a red circle in the center on a blue background"
SIZES = {1024: [(1024, 1024), (1216, 832), (832, 1216)], 512: [(512, 512), (640, 384), (384, 640)],
         64: [(64, 64), (80, 48), (48, 80)]}


def _sizes(res: int) -> list:
    return SIZES.get(res) or [(res, res)]


def private_gib(pid: int) -> float | None:
    """A process's memory that only RAM or swap can back, now (GiB): its anonymous memory and its shared anonymous
    memory (page-locked host memory, as CUDA's cudaHostAlloc maps it: a FLUX.2 [dev] `lorakit infer` on a 4x H200 host,
    2026-11-26, held 166 GiB so while its anonymous memory was 1.6) — unlike RSS, which also counts the pages of the files it
    maps (model weights read through the page cache, given back under pressure). None where the kernel does not
    say (not Linux, the process gone)."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    anon = _kib(rollup, "Anonymous:")
    return None if anon is None else (anon + (_kib(status, "RssShmem:") or 0)) / 2**20


def _kib(text: str, key: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return None


def _run(cmd: list[str], log: Path, env: dict, timeout: float) -> tuple[int, float, float, str, float | None]:
    """(exit code, seconds, peak RSS GiB, stdout, peak private GiB) of one command, its output to `log` (as under
    nohup); private memory (`private_gib`) is sampled every half second."""
    t0 = time.perf_counter()
    peak_private, sampled = None, 0.0
    with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                pid, status, usage = os.wait4(p.pid, 0)
                break
            if time.monotonic() - sampled >= 0.5:
                sampled, now = time.monotonic(), private_gib(p.pid)
                if now is not None:
                    peak_private = max(peak_private or 0.0, now)
            time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, usage.ru_maxrss / 2**20, log.read_text(), peak_private


def named_settings(hint: str) -> list[str]:
    """The settings a refusal's hint names for the cell to run on with: of its alternatives ("try A or B"), the
    first that changes only memory settings (the cell keeps its data: the defaults' images at the defaults' size),
    else the first that names any."""
    ways = [re.findall(r"--set\s+(\S+=[^\s)]+)", w) for w in re.split(r"\bor\s+(?=--set)", hint)]
    ways = [w for w in ways if w]
    return next((w for w in ways if all(kv.startswith("memory.") for kv in w)), ways[0] if ways else [])


def _json(text: str) -> dict:
    try:
        return json.loads(text[text.index("{"):]) if "{" in text else {}
    except ValueError:
        return {}


def phases(log: str) -> list:
    """[(phase, seconds, at, step, of_which)] from a `--log-format json` log, in order (at: seconds since the
    command began; step: the optimizer step a compile phase held up; of_which: the parts the phase names, as the
    preparation's and the checkpoint's), after what came before the first phase (the interpreter, the imports: the
    first phase's start)."""
    got = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "phase":
            got.append([rec["name"], rec["seconds"], rec.get("t"), rec.get("step"), rec.get("of_which")])
    if got and got[0][2] is not None:
        start = round(max(got[0][2] - got[0][1], 0.0), 2)
        got.insert(0, [BEFORE, start, start, None, None])
    return got


BEFORE = "before the first phase (imports)"


def psnr(a, b) -> float:
    """Peak signal-to-noise ratio of two 8-bit images in dB (inf when equal)."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("nan")
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _dataset(family: str, folder: Path, res: int, frames: int) -> Path:
    layout = demo_layout_for(family)
    if layout == "video":
        return make_demo_dataset(folder, "video", count=4, size=_sizes(res), frames=frames + 4)
    return make_demo_dataset(folder, layout, count=6 if layout == "flat" else 4, size=_sizes(res))


def _image(files: list[str]):
    """The picture a run wrote: a PNG, or a clip's middle frame."""
    from PIL import Image

    first = files[0]
    if first.endswith(".png"):
        return Image.open(first).convert("RGB")
    info = probe(first)
    return read_window(first, Window(0.0, (info.frames // 2,)))[0]


def run_cell(cell: Cell, model: Path, data: Path, work: Path, steps: int, res: int, frames: int, tiny: bool,
             stages=STAGES, save=lambda: None, cold: bool = False) -> Cell:
    """One family x profile through the stages; `save` is called after each stage. `cold`: the model's files are
    evicted from the page cache before its first stage (a first run reads them from the disk)."""
    work.mkdir(parents=True, exist_ok=True)
    facts = family_adapter(cell.family)
    cfg = {"model": {"family": cell.family, "path": str(model)},
           "data": {"dirs": [str(data)], "resolution": res, **({"frames": frames} if facts.layout == "video" else {}),
                    **({"bucket_min_side": 32, "bucket_max_side": 128} if tiny else {}),
                    **({"control_resolution": res} if tiny and facts.max_controls else {})},
           "schedule": {"steps": steps}, "sampling": {"enabled": False}, "output": {"dir": str(work / "run")}}
    if tiny:
        cfg["model"]["dtype"] = "bf16"
    (work / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "LORAKIT_MEMORY_CAP_GIB"}
    if cell.cap_gib:
        env["LORAKIT_MEMORY_CAP_GIB"] = str(cell.cap_gib)
    lk = [sys.executable, "-m", "lorakit"]
    controls = [str(p) for p in sorted((data / "control").glob("*.png"))[:1]] if facts.max_controls else []
    if facts.first_frame:  # image-to-video: infer and stock start the clip from the same image
        from PIL import Image

        Image.new("RGB", (res, res), (200, 30, 30)).save(work / "first.png")
        controls = [str(work / "first.png")]
    infer_steps = 2 if tiny else 10
    todo = list(stages)
    while todo:
        stage = todo.pop(0)
        if cell.status in ("refused", "failed"):
            break
        if stage == "cache":
            cmd = [*lk, "cache", str(work / "run.yaml"), "--profile", cell.profile, "--json"]
        elif stage in ("train", "train-warm"):  # phases as JSON lines on stderr, the result on stdout
            cmd = [*lk, "train", str(work / "run.yaml"), "--profile", cell.profile, "--json", "--log-format", "json",
                   "--force", *[x for kv in cell.sets for x in ("--set", kv)]]  # the cell's own folder: run again
        elif stage == "infer":
            lora = work / "run" / "lora.safetensors"
            cmd = [*lk, "infer", str(model), "-p", PROMPT, "--steps", str(infer_steps), "--width", str(res),
                   "--height", str(res), "--frames", str(frames), "--lora", str(lora), "-o", str(work / "infer"),
                   *[x for c in controls for x in ("--image", c)], "--json"]
            if tiny:
                cmd += ["--dtype", "bf16", "--device", "cpu"]
        else:
            spec = {"model": str(model), "lora": str(work / "run" / "lora.safetensors"), "family": cell.family,
                    "prompt": PROMPT, "steps": infer_steps, "seed": 0, "width": res, "height": res, "frames": frames,
                    "image": controls, "out": str(work / "stock.png"),
                    "offload": os.environ.get("LORAKIT_BENCH_SHARED_GPU") == "1"}
            cmd = [sys.executable, "-m", "lorakit.bench.stock", json.dumps(spec)]
            env = {k: v for k, v in env.items() if k != "LORAKIT_MEMORY_CAP_GIB"}  # the reference: uncapped
        evicted = None
        if cold and stage == stages[0]:
            evicted = drop_cache(weight_files(model))
        started = time.time()
        rc, secs, rss, out, private = _run(cmd, work / f"{stage}.log", env, timeout=1800)
        rec = {"s": round(secs, 1), "rss_gib": round(rss, 2), "rc": rc, **({"page_cache": evicted} if evicted else {}),
               **({"private_gib": round(private, 2)} if private is not None else {})}
        result = _json(out)
        if rc == 2 and stage.startswith("train"):
            said = f"{result.get('message', '')} ({result.get('hint', '')})"
            named = named_settings(result.get("hint") or "")
            if named and not cell.sets:  # the refusal names what fits: the cell shows whether it does
                cell.refused, cell.sets = said, named
                cell.stages[f"{stage} (refused at the defaults)"] = rec
                todo.insert(0, stage)
                save()
                continue
            cell.status, cell.note = "refused", said
        elif rc != 0:
            err = result.get("message") or (work / f"{stage}.err").read_text()[-400:]
            cell.status, cell.note = "failed", f"{stage}: exit {rc}: {err}"
        elif stage.startswith("train"):
            rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
            first = round(rows[0]["time"] - started, 1) if rows else None
            rec["phases"] = phases((work / f"{stage}.err").read_text())
            if stage == "train-warm":
                cell.first_step_warm_s = first
                cell.stages[stage] = rec
                save()
                continue
            cell.first_step_s = first
            waited = {1} | {ph[3] for ph in rec["phases"] if ph[0] == "compile"}  # steps that waited to compile
            # s/step: the wall time between step records after the second, stalls included (what the clock shows:
            # the compiles a step waited for, eager steps beside the background compile, checkpoints, samples)
            steady = sorted(r["s_per_step"] for r in rows if r["step"] > 2) or sorted(r["s_per_step"] for r in rows)
            quiet = sorted(r.get("step_s", r["s_per_step"]) for r in rows  # for reference: train_step() of the
                           if r["step"] not in waited and not r.get("eager_blocks"))  # compiled steps alone
            rec["compiled_step_s"] = list(spread(quiet)) if quiet else None
            rec["eager_steps"] = sum(1 for r in rows if r.get("eager_blocks"))
            rec["gc_s"] = {r["step"]: r["gc_s"] for r in rows if r.get("gc_s")}  # full collections, per step
            rec["alloc"] = {r["step"]: [r.get("alloc_retries", 0), r.get("cuda_mallocs", 0)] for r in rows
                            if r.get("alloc_retries") or r.get("cuda_mallocs")}  # the allocator's retries, mallocs
            cell.s_per_step_median, cell.s_per_step_p90 = spread(steady)
            by_size: dict = {}  # the same per bucket: a spread that is the buckets' shapes, or unsteady steps
            for r in rows:
                if r["step"] > 2 and r.get("size"):
                    by_size.setdefault(r["size"], []).append(r["s_per_step"])
            rec["by_size"] = {k: [*spread(sorted(v)), len(v)] for k, v in sorted(by_size.items())}
            cell.peak_gpu_gib = result.get("peak_gpu_gib")
            rec["gpu_peaks"] = gpu_peaks(rows)
            rec["timeline"] = result.get("timeline")
        elif stage in ("cache", "infer"):
            rec["peak_gpu_gib"] = result.get("peak_gpu_gib")
            if stage == "infer":
                rec.update(offload=result.get("offload"), files=result.get("files"))
        else:
            ours = _image(cell.stages["infer"]["files"])

            stock = [str(work / ("stock.mp4" if facts.layout == "video" else "stock.png"))]
            cell.psnr_vs_stock = round(psnr(ours, _image(stock)), 1)
            rec.update(peak_gpu_gib=result.get("peak_gpu_gib"), offload=result.get("offload"))
        cell.stages[stage] = rec
        save()
    if cell.status == "pending":
        cell.status = "pass"
    if cell.profile in SHARED_GIB and cell.status == "pass":
        shared_check(cell)
    save()
    return cell


def run_matrix(families, profiles, out: Path, models: Path | None = None, steps: int = 20, tiny: bool = False,
               stages=STAGES, limit_s: float | None = None, keep_models: bool = False, progress=None,
               cold: bool = False, gpu_gib: float | None = None, homes: dict | None = None) -> list[Cell]:
    """Every family x profile (see the module docstring); `gpu_gib`: emulate a smaller GPU (`_size_cells`);
    `homes`: component -> a folder elsewhere for it (`write_model`; each family's in its own subfolder).
    Returns the cells, also in out/matrix.json and .md."""
    unknown = [f for f in families if f not in family_names()] + [p for p in profiles
                                                                    if p not in PROFILES + ("cpu",)]
    if unknown:
        raise InputError(f"bench matrix: unknown family or profile {unknown[0]!r}",
                         f"families: {', '.join(family_names())}; profiles: {', '.join(PROFILES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(models or out / "models")
    t0 = time.monotonic()
    cells = [Cell(f, p, None if tiny else CAPS.get(p)) for f in families for p in profiles]
    _size_cells(cells, None if tiny else _gpu_gib(), None if tiny else gpu_gib)
    synth: dict = {}

    def save():
        (out / "matrix.json").write_text(json.dumps({"cells": [asdict(c) for c in cells], "synth": synth},
                                                    indent=2))
        (out / "matrix.md").write_text(table(cells))

    prev = None  # the last family's folder: kept until the next is written, whose equal components it links
    for family in families:
        video = family_adapter(family).layout == "video"
        res, frames = (64, 5) if tiny else ((512, 17) if video else (1024, 17))
        model = models / family
        if limit_s and time.monotonic() - t0 > limit_s:
            break
        like = _like(family, prev, models, tiny, keep_models)
        if prev is not None and like != prev and not keep_models and not tiny:
            remove_model(prev)  # the next family's folder needs the disk
        if not (model / "lorakit_synthetic.json").is_file():
            if progress:
                progress(f"{family}: writing the model folder" + (f" (linking {like.name}'s equal weights)"
                                                                  if like else ""))
            import torch

            t = time.perf_counter()
            rep = write_model(family, model, device="cpu" if tiny else "cuda", scale="tiny" if tiny else "full",
                              dtype=torch.bfloat16, like=like,
                              homes={c: Path(d) / family / c for c, d in (homes or {}).items()})
            synth[family] = {"s": round(time.perf_counter() - t, 1), "gib": round(rep["bytes"] / 2**30, 1),
                             **({"linked": sorted(n for n, c in rep["components"].items() if "linked_from" in c)}
                                if like else {})}
        if prev is not None and like == prev and not keep_models:
            remove_model(prev)  # its files live on in this folder's links
        prev = model
        data = _dataset(family, out / "data" / family, res, frames)
        for cell in (c for c in cells if c.family == family):
            if limit_s and time.monotonic() - t0 > limit_s:
                cell.status, cell.note = "skipped", "the time given to this call was spent"
                continue
            if progress:
                progress(f"{family} x {cell.profile}")
            run_cell(cell, model, data, out / f"{family}-{cell.profile}", steps, res, frames, tiny, stages, save, cold)
    if prev is not None and not keep_models and not tiny:
        remove_model(prev)
    save()
    return cells


def _size_cells(cells: list[Cell], real: float | None, emulated: float | None) -> None:
    """Each cell's cap on this GPU (`real` GiB): a card larger than it (dgx-spark on an 80 GB H100) runs at the
    GPU's size, said; `emulated` (GiB, smaller than this GPU): the GPU a user has, e.g. the H100's 80 on an H200 —
    the uncapped profiles (datacenter) are held to it and a larger card runs at it, said too."""
    emulated = emulated if emulated and real and emulated < real else None
    size = emulated or real
    for c in cells:
        if c.cap_gib and size and c.cap_gib > size:
            c.note = (f"this GPU has {size:.0f} GiB{' (emulated)' if emulated else ''}, less than the {c.profile}'s "
                      f"{c.cap_gib:g}: run at the GPU's size")
            c.cap_gib = emulated
        elif c.cap_gib is None and emulated:
            c.cap_gib = emulated
            c.note = f"held to {emulated:g} GiB: a smaller GPU emulated on this {real:.0f} GiB one"


def _like(family: str, prev: Path | None, models: Path, tiny: bool, keep_models: bool) -> Path | None:
    """A folder written before whose equal weights the next family's can link, where the rest fits the disk beside
    it (Qwen-Image, then its Edit models: nothing more is written); None where there is none. The last family's folder
    first, then those an earlier run kept in `models` (FLUX.2 [dev] Edit run alone after a kept FLUX.2 [dev]: 45 GiB
    more on a disk with 17 free)."""
    if tiny:
        return None
    import torch

    kept = sorted(p for p in models.iterdir() if p != prev and (p / "lorakit_synthetic.json").is_file()) \
        if models.is_dir() else []
    for cand in ([prev] if prev is not None else []) + kept:
        if cand == models / family or not (cand / "lorakit_synthetic.json").is_file():
            continue
        same, need = reusable(family, cand, dtype=torch.bfloat16)
        if same and (keep_models or need < shutil.disk_usage(models).free - 2**30):
            return cand
    return None


def gpu_peaks(rows: list[dict]) -> dict:
    """The GPU memory peak (GiB) of a run's steps, of its other shapes' compile and of its step-0 grid, from its
    step records (None: not recorded, as on the CPU): which part came nearest the card's edge."""
    return {k: max((r[f"{k}_gpu_gib"] for r in rows if r.get(f"{k}_gpu_gib") is not None), default=None)
            for k in ("step", "compile", "grid")}


def _gpu_gib() -> float | None:
    """This machine's first GPU's memory in GiB (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30
