"""How much of a training step is the host's: lorakit's step (`lorakit bench step`'s build: the family's full
architecture with random weights, one synthetic batch, the profile's settings) timed step by step, with the CPU
quiet and then with busy processes on every core beside it (a shared or busy machine), for each of a few variants.

    python tools/host_slack.py --family qwen-image --profile rtx4090 --cap 24 [--set memory.cuda_graphs=true] \
        [--variants as-run,update-after-loss,fused-adamw] [--steps 25] [--busy 32] [--out F.json]

Per variant and host state, medians over the timed steps: `step_s` (wall, synchronised) and its p90, `host_s` (until
the backward pass returned: the host's launching of forward and backward, waits on a full launch queue included) and
`update_s` (the optimizer call's host time). A step whose `host_s` is close to `step_s`, and which slows down with the
cores busy, is paced by the host; one paced by the GPU keeps its time. Variants: `as-run` (what `lorakit train` does),
`update-after-loss` (the update launched after the host read the loss, as before 2026-12-02 for 8-bit AdamW),
`fused-adamw` (torch's fused AdamW with fp32 moments in place of the profile's optimizer). `--tiny --device cpu` runs
the tiny layout on the CPU (the tool's own test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from race import median_p90  # noqa: E402 - tools/ is this script's own folder

VARIANTS = ("as-run", "update-after-loss", "fused-adamw")


def build(a):
    """lorakit's trainer as `lorakit bench step` builds it; returns (trainer, settings)."""
    from lorakit.bench.step import way_spec
    from lorakit.bench.ways import prepare

    spec = way_spec(a.family, a.res, a.profile, a.steps, 3, "tiny" if a.tiny else "full", a.device, a.cap, a.set)
    _, info = prepare({**spec, "way": "lorakit", "gpus": 1})
    return info["trainer"], info["settings"]


class Timed:
    """The trainer's steps with the host's marks: when backward() returned, how long the update call took."""

    def __init__(self, tr, cuda: bool):
        self.tr, self.cuda, self.marks = tr, cuda, {}
        prepare_next, update = tr.ahead.prepare, tr._update

        def after_backward(*a):  # the step calls it right after loss.backward()
            self.marks["backward"] = time.perf_counter()
            return prepare_next(*a)

        def timed_update():
            t = time.perf_counter()
            update()
            self.marks["update"] = time.perf_counter() - t
        tr.ahead.prepare, tr._update = after_backward, timed_update

    def step(self) -> tuple[float, float, float]:
        import torch

        t = time.perf_counter()
        self.tr.train_step()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, self.marks["backward"] - t, self.marks.get("update", 0.0)


def use(variant: str, tr, before_check) -> None:
    """Put `variant` in force on the trainer (each from the one before: fused-adamw last)."""
    import torch

    from lorakit.train.trainer import Trainer

    Trainer.update_before_check = before_check if variant != "update-after-loss" else property(lambda self: False)
    if variant == "fused-adamw":
        g = tr.opt.param_groups[0]
        tr.state.opt = torch.optim.AdamW(tr.params, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                         weight_decay=g["weight_decay"], fused=tr.device.startswith("cuda"))
        tr.state.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)


def measure(timed: Timed, steps: int) -> dict:
    rows = [timed.step() for _ in range(steps)]
    step, host, update = ([r[i] for r in rows] for i in range(3))
    median, p90 = median_p90(sorted(step))
    return {"step_s": round(median, 4), "step_p90_s": round(p90, 4),
            "host_s": round(statistics.median(host), 4), "update_s": round(statistics.median(update), 4),
            "steps_s": [round(x, 4) for x in step]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="flux")
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--cap", type=float, help="GiB of GPU memory the run may use (as LORAKIT_MEMORY_CAP_GIB)")
    ap.add_argument("--set", action="append", help="a lorakit setting key=value")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--busy", type=int, default=32, help="busy processes beside the step (0: quiet only)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    wanted = a.variants.split(",")
    if unknown := [v for v in wanted if v not in VARIANTS]:
        ap.error(f"--variants: {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    from lorakit.train.trainer import Trainer

    before_check = Trainer.update_before_check
    t0 = time.perf_counter()
    tr, settings = build(a)
    timed = Timed(tr, a.device.startswith("cuda"))
    print(f"built in {time.perf_counter() - t0:.1f} s: {json.dumps(settings)}", flush=True)
    out = []
    try:
        for variant in [v for v in VARIANTS if v in wanted]:
            use(variant, tr, before_check)
            for _ in range(3):  # the graphs of this variant's first steps (compile, CUDA graphs' recording)
                timed.step()
            states = [("quiet", 0)] + ([(f"{a.busy} busy processes", a.busy)] if a.busy else [])
            for state, n in states:
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
                try:
                    time.sleep(1.0 if n else 0.0)
                    row = {"variant": variant, "host": state, **measure(timed, a.steps)}
                finally:
                    for p in busy:
                        p.kill()
                        p.wait()
                out.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "steps_s"}), flush=True)
    finally:
        Trainer.update_before_check = before_check
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": settings, "rows": out}, indent=1))
    return out


if __name__ == "__main__":
    main()
