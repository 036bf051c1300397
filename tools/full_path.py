"""A full fine-tune's whole path on several GPUs, as a user runs it, each phase timed (docs/benchmarks.md).

    python tools/race.py synth --family flux --models M && python tools/race.py data --out D
    python tools/full_path.py run --family flux --models M --data D --work W --gpus 2 [--steps 100 --save-every 50
        --stop-after 70] [--tiny]

Phases, each a command of its own: `train` (`lorakit train CFG --gpus N`, method: full, a checkpoint every
--save-every steps, sent SIGTERM once --stop-after steps are recorded: it must save and end with 75), `resume`
(`--resume latest` to the last step: every step recorded once), `convert` (`lorakit convert checkpoint` of the
newest step checkpoint kept), `sample` (the run's exported transformer loaded by diffusers' own class into the
stock pipeline of the model folder, one image written; the converted folder loaded the same way). Writes
W/full_path.json (each phase's command, exit code, wall time and the seconds from its last output line to its end;
each checkpoint the run wrote, with its seconds) and W/sample.png. `--tiny` runs the same path on
the tiny layout on a CPU (2 gloo processes; the tool's own test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml


def lorakit(*args: str) -> list[str]:
    return [sys.executable, "-m", "lorakit", *args]


def timed(cmd: list[str], log: Path, stop_after: int | None = None, metrics: Path | None = None) -> dict:
    """Run a command with its output to `log`; SIGTERM once `metrics` holds `stop_after` step records."""
    t0 = time.time()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        sent = None
        while p.poll() is None:
            if stop_after and sent is None and metrics.is_file() and steps_in(metrics) >= stop_after:
                p.send_signal(signal.SIGTERM)
                sent = round(time.time() - t0, 1)
            time.sleep(0.2)
    end = time.time()  # the command's last output line to its end: its processes' teardown
    return {"cmd": " ".join(cmd), "rc": p.returncode, "wall_s": round(end - t0, 1), "sigterm_at_s": sent,
            "after_last_line_s": round(max(0.0, end - log.stat().st_mtime), 1)}


def checkpoint_phases(phases: Path) -> list:
    """[name, seconds] of every checkpoint the run's commands wrote, in order (from the run's phases.jsonl)."""
    if not phases.is_file():
        return []
    ends = (json.loads(x) for x in phases.read_text().splitlines() if x.strip())
    return [[e["name"], e["seconds"]] for e in ends if e.get("event") == "end" and "checkpoint (step" in e["name"]]


def steps_in(metrics: Path) -> int:
    return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)


def run(a) -> dict:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "run"
    for old in (out, work / "converted"):  # this tool's own folders: nothing of an earlier run is read as this one's
        shutil.rmtree(old, ignore_errors=True)
    cfg = {"model": {"family": a.family, "path": str(Path(a.models) / a.family)}, "method": "full",
           "data": {"dirs": [str(a.data)]}, "schedule": {"steps": a.steps},
           "output": {"dir": str(out), "save_every": a.save_every}}
    if a.tiny:
        cfg["data"].update(resolution=64, bucket_min_side=32, bucket_max_side=128)
        cfg["sampling"] = {"steps": 2}
        cfg["optim"] = {"lr": 1e-3}
    path = work / "full.yaml"
    path.write_text(yaml.safe_dump(cfg))
    common = ["--gpus", str(a.gpus), "--log-format", "plain", *(["--profile", "cpu"] if a.tiny else [])]
    metrics = out / "metrics.jsonl"
    rep: dict = {"family": a.family, "gpus": a.gpus, "steps": a.steps, "save_every": a.save_every}
    rep["train"] = timed(lorakit("train", str(path), *common), work / "train.log", a.stop_after, metrics)
    rep["train"]["steps_done"] = steps_in(metrics) if metrics.is_file() else 0
    rep["train"]["ranks_left"] = len(subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True
                                                    ).stdout.split())  # after the command ended: none
    rep["resume"] = timed(lorakit("train", str(path), "--resume", "latest", *common), work / "resume.log")
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x] \
        if metrics.is_file() else []
    rep["every_step_once"] = steps == list(range(1, a.steps + 1))
    rep["checkpoints"] = checkpoint_phases(out / "phases.jsonl")
    converted = work / "converted"
    ck = max((out / "checkpoints").glob("step-*"), default=out / "checkpoints" / "step-none")  # the newest kept
    rep["converted_checkpoint"] = ck.name
    rep["convert"] = timed(lorakit("convert", "checkpoint", str(ck), str(converted), "--json"), work / "convert.log")
    exported = next(iter(sorted(out.glob("*-transformer"))), None)
    rep["sample"] = timed([sys.executable, __file__, "sample", "--family", a.family, "--model",
                           str(Path(a.models) / a.family), "--transformer", str(exported), "--also", str(converted),
                           "--res", "64" if a.tiny else "1024", "--steps", "2" if a.tiny else "20",
                           "--out", str(work / "sample.png")], work / "sample.log")
    (work / "full_path.json").write_text(json.dumps(rep, indent=1))
    return rep


def sample(a) -> None:
    """The exported transformer in the stock pipeline (diffusers' own loading), one image; --also: another
    transformer folder that must load the same way, with the same parameter names and shapes."""
    import diffusers
    import torch

    from lorakit.models.base import family_adapter

    ad = family_adapter(a.family)
    cls = getattr(diffusers, ad.info.transformer_class)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    t0 = time.time()
    tr = cls.from_pretrained(a.transformer, torch_dtype=dt)
    shapes = {k: tuple(v.shape) for k, v in tr.state_dict().items()}
    if a.also:
        other = cls.from_pretrained(a.also, torch_dtype=dt)
        if {k: tuple(v.shape) for k, v in other.state_dict().items()} != shapes:
            raise SystemExit(f"{a.also}: not the exported transformer's parameters")
        del other
    pipe = diffusers.DiffusionPipeline.from_pretrained(a.model, transformer=tr, torch_dtype=dt).to(dev)
    pipe.set_progress_bar_config(disable=True)
    kw = {k: v for k, v in ad.call_kwargs(a.res, a.res, 1).items() if k != "num_frames"}
    load_s = time.time() - t0
    img = pipe(prompt="a red circle on a pale background", num_inference_steps=a.steps,
               generator=torch.Generator().manual_seed(0), **kw).images[0]
    img.save(a.out)
    print(json.dumps({"load_s": round(load_s, 1), "sample_s": round(time.time() - t0 - load_s, 1),
                      "size": list(img.size), "parameters": len(shapes)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--family", default="flux")
    r.add_argument("--models", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--gpus", type=int, default=2)
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--save-every", type=int, default=50)
    r.add_argument("--stop-after", type=int, default=70)
    r.add_argument("--tiny", action="store_true")
    s = sub.add_parser("sample")
    for k in ("--family", "--model", "--transformer", "--out"):
        s.add_argument(k, required=True)
    s.add_argument("--also")
    s.add_argument("--res", type=int, default=1024)
    s.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    if a.cmd == "sample":
        sample(a)
        return
    rep = run(a)
    print(json.dumps({k: v for k, v in rep.items()}, indent=1))
    bad = [k for k in ("resume", "convert", "sample") if rep[k]["rc"] != 0] + (
        [] if rep["train"]["rc"] == 75 and not rep["train"]["ranks_left"] else ["train"]) + ([] if rep["every_step_once"] else ["steps"])
    os._exit(1 if bad else 0)


if __name__ == "__main__":
    main()
