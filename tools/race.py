"""A training run timed as the wall clock shows it — the lorakit side of a race against a peer trainer, and the
measure any peer's command gets (`measure`): command -> first step, command -> step N, command -> the final LoRA
file (the whole job), the steady s/step (median and p90 of the wall time between consecutive steps, stalls
included, after the first two), the GPU's peak memory (NVML, polled) and the process tree's peak private host memory;
for lorakit also the opening target (step 100 within the first step + 100 x 1.15 x the steady step + the step-0 grid)
and where the steady steps' spread lies (`spread`: the loop around the step, each bucket shape's median and p90).

    python tools/race.py synth --family flux --models M                 # the full-size random-weight folder (GPU)
    python tools/race.py data --out D [--count 16] [--res 1024]         # drawn images in three aspect ratios
    python tools/race.py lorakit --family flux --models M --data D --work W --profile datacenter --steps 300 \
        [--cap 24] [--runs 2] [--set key=value ...]

`lorakit` runs `lorakit train` as a user does: its own YAML naming only the model folder, the dataset and the steps
(everything else the profile's defaults, sample grids included), stdout to a file; `--runs 2` runs it again on the
same machine (a second run: warm page and compile caches). Each run's figures go to W/race.json and a table row to
stdout. `--tiny` runs the same on the tiny layout on a CPU (the tool's own test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

SIZES = {1024: [(1024, 1024), (1216, 832), (832, 1216)], 64: [(64, 64), (80, 48), (48, 80)]}
WORDS = ["red", "blue", "green", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle"]


def draw_dataset(out: Path, count: int = 16, res: int = 1024) -> Path:
    """`count` PNGs with captions, in three aspect ratios (the buckets a user's photos give)."""
    from PIL import Image, ImageDraw

    out.mkdir(parents=True, exist_ok=True)
    sizes = SIZES.get(res) or [(res, res), (res * 19 // 16 // 16 * 16, res * 13 // 16 // 16 * 16),
                               (res * 13 // 16 // 16 * 16, res * 19 // 16 // 16 * 16)]
    for k in range(count):
        w, h = sizes[k % 3]
        color, shape = WORDS[k % len(WORDS)], SHAPES[(k // 3) % 3]
        im = Image.new("RGB", (w, h), (240 - 10 * (k % 7), 235, 225))
        d = ImageDraw.Draw(im)
        box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
        if shape == "circle":
            d.ellipse(box, fill=color)
        elif shape == "square":
            d.rectangle(box, fill=color)
        else:
            d.polygon([(w // 2, h // 4), (w // 4, 3 * h // 4), (3 * w // 4, 3 * h // 4)], fill=color)
        im.save(out / f"item_{k:03d}.png")
        (out / f"item_{k:03d}.txt").write_text(f"a {color} {shape} on a pale background")
    return out


def gpu_index() -> int:
    """The GPU a measured run uses: the first of CUDA_VISIBLE_DEVICES when it names one by number (two races side by
    side on a two-GPU host, one card each, with CUDA_DEVICE_ORDER=PCI_BUS_ID: NVML's order), else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def nvml():
    """(pynvml, the run's GPU's handle), or None without NVML (the CPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu_index())
    except Exception:  # noqa: BLE001 - no NVML here (the CPU)
        return None


def _gpu_used_mib() -> int:
    """The run's GPU's used memory (NVML; 0 without one)."""
    got = nvml()
    try:
        return int(got[0].nvmlDeviceGetMemoryInfo(got[1]).used // 2**20) if got else 0
    except Exception:  # noqa: BLE001 - a query this driver refuses
        return 0


def gpu_name() -> str | None:
    """The run's GPU's name (NVML; None without one): each record says the card it ran on (a later call may land on
    another kind of card)."""
    got = nvml()
    try:
        name = got[0].nvmlDeviceGetName(got[1]) if got else None
    except Exception:  # noqa: BLE001 - a query this driver refuses
        return None
    return name.decode() if isinstance(name, bytes) else name and str(name)


class Clocks:
    """The run's GPU's SM clock, power draw and clock-limit reasons, sampled every `every` seconds in a thread while a
    command runs (NVML; nothing without it): whether the slow steps are the card's slower clock (`clock_check`)."""

    def __init__(self, every: float = 0.1):
        import threading

        self.rows: list[tuple[float, int, float, int]] = []  # (time, SM MHz, watts, reasons bitmask)
        self._stop = threading.Event()
        self._nvml = nvml()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        if self._nvml:
            self._thread.start()

    def _run(self, every: float) -> None:
        n, h = self._nvml
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.wait(every):
            try:
                self.rows.append((time.time(), int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                                  n.nvmlDeviceGetPowerUsage(h) / 1000.0, int(reasons(h))))
            except Exception:  # noqa: BLE001 - a query this driver refuses: no samples
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


POWER_CAP = 0x4 | 0x80  # NVML clock-event reasons: the software power cap, the hardware power brake


def clock_check(times: list[float], rows: list, skip: int = 2) -> dict:
    """The GPU's SM clock, power and power-capped share of samples during the slowest tenth of the step intervals
    (`steady`'s) against the rest: where the slow steps ran at a lower clock, the card set their pace."""
    gaps = intervals(times, skip)
    if not gaps or not rows:
        return {}
    slow = set(sorted(gaps, key=lambda g: g[1] - g[0])[-max(1, len(gaps) // 10):])
    parts: dict = {"slow": [], "rest": []}
    k = 0
    for a, b in gaps:
        while k < len(rows) and rows[k][0] < a:
            k += 1
        j = k
        while j < len(rows) and rows[j][0] <= b:
            parts["slow" if (a, b) in slow else "rest"].append(rows[j])
            j += 1
    out = {}
    for name, got in parts.items():
        if got:
            out[f"sm_mhz_{name}"] = round(statistics.mean(r[1] for r in got))
            out[f"power_w_{name}"] = round(statistics.mean(r[2] for r in got))
            out[f"power_capped_{name}"] = round(sum(1 for r in got if r[3] & POWER_CAP) / len(got), 3)
    return out


def _tree(pid: int) -> list[int]:
    """The process and its descendants (compile workers, launched ranks)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        todo += [int(k) for k in kids]
    return out


def measure(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run a training command with its output to `log`; the wall time, the exit code, and the peaks (GPU memory in
    use on the run's GPU, the private host memory of the process tree), sampled every half second. Past `timeout` the
    whole tree is killed (a launcher's children too) and the record says so; so is a SIGTERM to this process (an
    outer `timeout` ending the driver first): the tree is killed as at the limit and the record returned, so the
    driver still writes what it measured (`stopped_by_signal_s`)."""
    import signal

    from lorakit.bench.matrix import private_gib

    base = _gpu_used_mib()
    peak_gpu = peak_private = 0.0
    started = time.time()
    killed = False
    termed: list[float] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: termed.append(time.time()))
    clocks = Clocks()
    try:
        with open(log, "w") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
            while p.poll() is None:
                if (termed or time.time() - started > timeout) and not killed:
                    killed = True
                    for q in reversed(_tree(p.pid)):
                        try:
                            os.kill(q, 9)
                        except OSError:
                            pass
                private = sum(x for x in (private_gib(q) for q in _tree(p.pid)) if x is not None)
                peak_private = max(peak_private, private)
                peak_gpu = max(peak_gpu, (_gpu_used_mib() - base) / 1024)
                time.sleep(0.5)
    finally:
        signal.signal(signal.SIGTERM, previous)
        clocks.stop()
    return {"cmd": " ".join(cmd), "rc": p.returncode, "clocks": clocks.rows, "started": started,
            "whole_s": round(time.time() - started, 1),
            "gpu_peak_gib": round(peak_gpu, 2), "private_peak_gib": round(peak_private, 2), "gpu": gpu_name(),
            "stopped_at_limit_s": timeout if killed and not termed else None,
            "stopped_by_signal_s": round(termed[0] - started, 1) if termed else None}


def intervals(times: list[float], skip: int = 2) -> list[tuple[float, float]]:
    """(start, end) of each interval between consecutive steps after the first `skip` steps."""
    return list(zip(times[skip - 1:], times[skip:], strict=False)) if len(times) > skip else []


def median_p90(values: list[float]) -> tuple[float, float]:
    """(median, p90) of sorted values: the p90 is the value at 90% of the way from the first to the last."""
    return statistics.median(values), values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]


def steady(times: list[float], skip: int = 2) -> dict:
    """Median and p90 of the wall time between consecutive steps after the first `skip` steps (every interval: the
    stalls between steps are the run's, not left out)."""
    gaps = sorted(b - a for a, b in intervals(times, skip))
    if not gaps:
        return {"median_s": None, "p90_s": None, "intervals": 0}
    med, p90 = median_p90(gaps)
    return {"median_s": round(med, 4), "p90_s": round(p90, 4), "p90_over_median": round(p90 / med, 3),
            "intervals": len(gaps)}


def timeline(started: float, times: list[float], lora: Path | None, grid_s: float | None = None) -> dict:
    """A run's figures from the command's start, its step times and its LoRA file: first step, step 100, the LoRA
    written (the whole job), the steady step (`steady`), the opening's target (command -> step 100 within the
    first step + 100 x 1.15 x the steady step + `grid_s`, the step-0 grid's own seconds where the run says them:
    then `opening_s`, step 100 past the target, negative under it) and the LoRA modules the file holds."""
    rec = {"steps": len(times), "first_step_s": round(times[0] - started, 1) if times else None,
           "step_100_s": round(times[99] - started, 1) if len(times) >= 100 else None,
           "lora_s": round(lora.stat().st_mtime - started, 1) if lora is not None and lora.is_file() else None,
           "lora_modules": lora_modules(lora), **steady(times)}
    if rec["first_step_s"] is not None and rec["step_100_s"] is not None and rec["median_s"]:
        allowed = rec["first_step_s"] + 100 * 1.15 * rec["median_s"] + (grid_s or 0.0)
        rec["step_100_allowed_s"] = round(allowed, 1)
        if grid_s is not None:
            rec.update(step_0_grid_s=round(grid_s, 1), opening_s=round(times[99] - started - allowed, 1))
    return rec


def step_0_grid(run: Path, before: float | None) -> float:
    """The seconds of a lorakit run's step-0 grid (its "samples (step 0)" phase in phases.jsonl) where it ended
    before `before` (step 100's time); 0 where it did not run, or ran later. Read as the dashboard reads it (a
    missing file, a half-written last line: nothing)."""
    from lorakit.ui.runs import read_lines

    return sum(r.get("seconds", 0.0) for r in read_lines(run, "phases.jsonl")
               if r.get("event") == "end" and r.get("name") == "samples (step 0)"
               and (before is None or r["time"] <= before))


def lora_modules(path: Path | None) -> int | None:
    """LoRA modules in a trained file, from its header (lorakit and peft: lora_A; kohya-style: lora_down)."""
    from lorakit.io import read_header

    if path is None or not path.is_file():
        return None
    return sum(1 for n in read_header(path).tensors if n.endswith(("lora_A.weight", "lora_down.weight")))


def lorakit_run(a, work: Path, k: int) -> dict:
    """`lorakit train` as a user runs it, timed (see the module)."""
    out = work / f"lorakit-run{k}"
    if out.exists():  # this tool's own folder: nothing of an earlier run is read as this one's
        import shutil

        shutil.rmtree(out)
    cfg = {"model": {"family": a.family, "path": str(Path(a.models) / a.family)},
           "data": {"dirs": [str(a.data)]}, "schedule": {"steps": a.steps}, "output": {"dir": str(out)}}
    if a.tiny:
        cfg["data"].update(resolution=64, bucket_min_side=32, bucket_max_side=128)
        cfg["sampling"] = {"steps": 2}
    path = work / f"lorakit-run{k}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {"LORAKIT_MEMORY_CAP_GIB": str(a.cap)} if a.cap else {}
    cmd = [sys.executable, "-m", "lorakit", "train", str(path), "--profile", a.profile, "--log-format", "plain",
           "--force", *[x for kv in a.set or [] for x in ("--set", kv)]]
    rec = measure(cmd, work / f"lorakit-run{k}.log", env, timeout=getattr(a, "limit", None) or 3600)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    times = [r["time"] for r in rows if "loss" in r]
    rec.update(side="lorakit", run=k, profile=a.profile, cap_gib=a.cap,
               step_s_median=round(statistics.median(r["step_s"] for r in rows if "step_s" in r), 4) if rows else None,
               **timeline(rec["started"], times, out / "lora.safetensors",
                          step_0_grid(out, times[99] if len(times) >= 100 else None)),
               **clock_check(times, rec.pop("clocks")), spread=spread([r for r in rows if "loss" in r]))
    return rec


def spread(steps: list[dict], skip: int = 2) -> dict:
    """Where the steady steps' spread lies, from a lorakit run's step records after the first `skip`: the loop around
    `train_step()` (`s_per_step` less `step_s`: records, samples, checkpoints between steps) and each bucket shape's
    median and p90 of `s_per_step` (a shape slower than the others shows there, not as jitter), and where the
    records have it the host's wait for the GPU in each step (`wait_s`: near nothing where the host set the pace)."""
    steps = [r for r in steps[skip:] if "s_per_step" in r and "step_s" in r]
    if not steps:
        return {}

    def q(v: list[float]) -> dict:
        med, p90 = median_p90(sorted(v))
        return {"steps": len(v), "median_s": round(med, 4), "p90_s": round(p90, 4),
                "p90_over_median": round(p90 / med, 3) if med else None}

    loop = median_p90(sorted(r["s_per_step"] - r["step_s"] for r in steps))
    shapes = sorted({r.get("size") for r in steps if r.get("size")})
    out = {"loop_ms_median": round(1000 * loop[0], 2), "loop_ms_p90": round(1000 * loop[1], 2),
           "by_shape": {k: q([r["s_per_step"] for r in steps if r.get("size") == k]) for k in shapes}}
    waits = sorted(r["wait_s"] for r in steps if "wait_s" in r)
    if waits:
        wait = median_p90(waits)
        out.update(wait_ms_median=round(1000 * wait[0], 2), wait_ms_p90=round(1000 * wait[1], 2))
    return out


SETTINGS = {"datacenter": ("datacenter", None), "24gb": ("rtx4090", 24)}  # peer race setting -> profile, cap GiB


def add_race_args(r, families: list[str], key: str) -> None:
    """The arguments every peer race takes (the peer's own are added by its tool; `key` names its side in `--only`)."""
    r.add_argument("--only", nargs="*", choices=[key, "lorakit"], help="these sides, in this order")
    r.add_argument("--family", choices=families, default="flux")
    r.add_argument("--models", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--setting", choices=sorted(SETTINGS), default="datacenter")
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--limit", type=float, default=3600, help="seconds for each side")
    r.add_argument("--set", action="append", help="a lorakit setting key=value")
    r.add_argument("--tiny", action="store_true")


class StepLog:
    """A peer race's record inside the peer's own process (its launcher): the process held to `cap` GiB as lorakit
    holds its own runs (the CUDA context inside the cap), the time of each optimizer step written to `stats` every 10
    steps (a run stopped at the time limit keeps them) and at exit with torch's peak; `peer_record` reads it."""

    def __init__(self, stats: str, cap: float | None):
        import atexit

        import torch

        self.path, self.rec = Path(stats), {"steps": []}
        if cap and torch.cuda.is_available():
            sys.path.append(str(Path(__file__).resolve().parents[1]))  # lorakit's source, after the peer's packages
            from lorakit.hardware.gpu import apply_cap

            apply_cap("cuda", cap)
            self.rec["cap_gib"] = cap
        atexit.register(self.done)

    def step(self, n: int = 1) -> None:
        self.rec["steps"].extend([time.time()] * n)
        if len(self.rec["steps"]) % 10 == 0:
            self.path.write_text(json.dumps(self.rec))

    def done(self) -> None:
        import torch

        if torch.cuda.is_available():
            self.rec["torch_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        self.path.write_text(json.dumps(self.rec))


def add_launch_args(la) -> None:
    """The arguments every peer launcher takes (`StepLog`'s)."""
    la.add_argument("--stats", required=True)
    la.add_argument("--cap", type=float)


def peer_record(a, cmd: list[str], env: dict, log: Path, stats: Path, lora: Path, side: str, changed: list) -> dict:
    """A peer's side of a race: its command `measure`d, its step times (the launcher's `stats` file: {"steps": [unix
    seconds, ...]}) and its final LoRA file made into `timeline`'s figures, the race's changes and its log's tail."""
    rec = measure(cmd, log, env, timeout=a.limit)
    times = json.loads(stats.read_text())["steps"] if stats.is_file() else []
    rec.update(side=side, run=1, profile=a.setting, cap_gib=a.cap, changed=changed,
               **timeline(rec["started"], times, lora), **clock_check(times, rec.pop("clocks")))
    rec["log_tail"] = log.read_text(errors="replace")[-3000:]
    return rec


def ratios(recs: list[dict], peer: str) -> dict:
    """lorakit against the peer in one race: whole job, steady step, first step (above 1: lorakit faster)."""
    by = {r["side"]: r for r in recs}
    lk, pe = by.get("lorakit"), by.get(peer)
    if not (lk and pe):
        return {}
    out = {}
    for key, name in (("lora_s", "whole_job"), ("median_s", "steady_step"), ("first_step_s", "first_step")):
        if lk.get(key) and pe.get(key):
            out[name] = round(pe[key] / lk[key], 2)
    return out


def race_peer(a, peer: str, key: str, run_peer) -> None:
    """A peer race: each side of `a.only` (default: the peer's `key`, then lorakit) in turn, a table row each, the
    report in W/<family>-<setting>/report.json after every side (a call stopped midway keeps what it has) and the
    ratios at the end. `run_peer(a, work)` runs the peer's side and returns its record (`measure` + `timeline`)."""
    work = Path(a.work) / f"{a.family}-{a.setting}"
    work.mkdir(parents=True, exist_ok=True)
    a.profile, a.cap = SETTINGS[a.setting]
    report = {"family": a.family, "setting": a.setting, "steps": a.steps, "records": []}
    print(HEAD)
    for side in a.only or [key, "lorakit"]:
        if side == key:
            rec = run_peer(a, work)
        else:
            ns = argparse.Namespace(family=a.family, models=a.models, data=a.data, steps=a.steps, tiny=a.tiny,
                                    cap=a.cap, profile=a.profile, set=a.set, limit=a.limit)
            rec = lorakit_run(ns, work, 1)
        report["records"].append(rec)
        print(row(rec), flush=True)
        (work / "report.json").write_text(json.dumps(report, indent=1))
        if rec.get("stopped_by_signal_s") is not None:  # stopped from outside: what was measured is written
            sys.exit(143)
    name = f"lorakit_vs_{key}"
    report[name] = ratios(report["records"], peer)
    (work / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report[name]))


def row(r: dict) -> str:
    def f(v, spec="{:.1f}"):
        return "-" if v is None else spec.format(v)

    cap = f" ({r['cap_gib']:g} GiB)" if r.get("cap_gib") else ""
    return (f"| {r['side']} run {r['run']} | {r['profile']}{cap} | "
            f"{f(r['first_step_s'])} | {f(r.get('step_100_s'))} | {f(r['lora_s'])} | {f(r['whole_s'])} | "
            f"{f(r['median_s'], '{:.3f}')} / {f(r['p90_s'], '{:.3f}')} ({f(r.get('p90_over_median'), '{:.2f}')}) | "
            f"{f(r['gpu_peak_gib'])} | {f(r['private_peak_gib'])} | {opening(r)} | {r['rc']} |")


def opening(r: dict) -> str:
    """The opening target in words: "3.0 s over", "met (2.1 s under)", "-" where not measured."""
    o = r.get("opening_s")
    return "-" if o is None else f"{o:.1f} s over" if o > 0 else f"met ({-o:.1f} s under)"


HEAD = ("| side | profile | first step s | step 100 s | LoRA file s | whole s | s/step median / p90 (p90/median) | "
        "GPU peak GiB | private host peak GiB | opening target | exit |\n"
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth")
    s.add_argument("--family", default="flux")
    s.add_argument("--models", required=True)
    s.add_argument("--tiny", action="store_true")
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--count", type=int, default=16)
    d.add_argument("--res", type=int, default=1024)
    lk = sub.add_parser("lorakit")
    lk.add_argument("--family", default="flux")
    lk.add_argument("--models", required=True)
    lk.add_argument("--data", required=True)
    lk.add_argument("--work", required=True)
    lk.add_argument("--profile", default="datacenter")
    lk.add_argument("--steps", type=int, default=300)
    lk.add_argument("--cap", type=float)
    lk.add_argument("--runs", type=int, default=1)
    lk.add_argument("--first", type=int, default=1, help="the number of the first run (a later call adds runs)")
    lk.add_argument("--set", action="append")
    lk.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    if a.cmd == "synth":
        from lorakit.bench.hub import write_model

        got = write_model(a.family, Path(a.models) / a.family, device="cpu" if a.tiny else "cuda",
                          scale="tiny" if a.tiny else "full")
        print(json.dumps({k: v for k, v in got.items() if k != "components"}))
    elif a.cmd == "data":
        print(draw_dataset(Path(a.out), a.count, a.res))
    else:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
        report = work / "race.json"
        done = json.loads(report.read_text()) if report.is_file() else []
        print(HEAD)
        for k in range(a.first, a.first + a.runs):
            rec = lorakit_run(a, work, k)
            done.append(rec)
            report.write_text(json.dumps(done, indent=1))
            print(row(rec), flush=True)
            if rec.get("stopped_by_signal_s") is not None:  # stopped from outside: no further run
                sys.exit(143)


if __name__ == "__main__":
    main()
