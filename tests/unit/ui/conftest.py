"""Run folders as `lorakit train` leaves them: finished, interrupted (SIGINT after two steps), running (a process
holds the folder lock), failed (nothing saved) — built once per module from the tiny FLUX pipeline."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from lorakit.data.demo import make_demo_dataset


def run_yaml(folder, tiny, out, steps=4, **over):
    data = make_demo_dataset(folder / "data", "flat", count=2, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": steps}, "sampling": {"steps": 2, "every": 2},
           "output": {"dir": str(out), "save_every": 2}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path = folder / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config, *extra):
    return subprocess.run([sys.executable, "-m", "lorakit", "train", str(config), "--json", *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny):
    """root/{done, stopped, broken}: a finished run, one stopped by SIGINT after 2 of 400 steps, one whose
    config exists but whose training never saved anything."""
    root = tmp_path_factory.mktemp("runs")
    work = tmp_path_factory.mktemp("work")
    r = train(run_yaml(work, tiny, root / "done"))
    assert r.returncode == 0, r.stderr
    cfg = run_yaml(work, tiny, root / "team" / "stopped", steps=400, sampling={"enabled": False},
                   output={"save_every": 1000})
    p = subprocess.Popen([sys.executable, "-m", "lorakit", "train", str(cfg), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    metrics = root / "team" / "stopped" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=120)
    assert p.returncode == 75
    broken = root / "broken"
    (broken / "checkpoints").mkdir(parents=True)
    (broken / "config.resolved.yaml").write_text((root / "done" / "config.resolved.yaml").read_text())
    (broken / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.5, "s_per_step": 0.1}) + "\n")
    return root
