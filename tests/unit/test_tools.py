"""The maintained instruments of tools/ still work against the package as it is: each runs here on the CPU as far
as it can without a GPU or a peer trainer (tools/README.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))


def test_e2e_writes_a_hub_layout_model_and_the_drawn_dataset_a_race_uses(tmp_path):
    r = subprocess.run([sys.executable, str(TOOLS / "e2e.py"), "synth", "data", "--family", "flux", "--profile",
                        "cpu", "--models", str(tmp_path / "m"), "--work", str(tmp_path / "w"), "--tiny"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    synth = json.loads((tmp_path / "w" / "flux-cpu" / "synth.json").read_text())
    assert set(synth["components"]) >= {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert (tmp_path / "m" / "flux" / "model_index.json").is_file()
    images = [p for p in (tmp_path / "w" / "data-flux").iterdir() if p.suffix != ".txt"]
    assert len(images) == 20 and all(p.with_suffix(".txt").is_file() for p in images)


def test_peer_musubi_times_steps_and_writes_a_lorakit_config_the_cli_accepts(tmp_path, tiny):
    import argparse

    import peer_musubi as pm

    from lorakit.config import validate

    times = [0.0, 5.0] + [5.0 + 0.5 * k for k in range(1, 40)]  # a slow first interval, then 0.5 s steps
    got = pm.median_step(times, skip=1)
    assert got["median_s_per_step"] == 0.5 and got["p90_s_per_step"] == 0.5 and got["steady_intervals"] == 39
    assert pm.median_step([1.0])["median_s_per_step"] is None
    a = argparse.Namespace(models=str(tmp_path), data=tmp_path, res=64, steps=3)
    (tmp_path / "qwen-image").mkdir()
    out = tmp_path / "run"
    cfg = yaml.safe_load(pm.lorakit_config(a, "datacenter", tmp_path / "cache", out).read_text())
    checked = validate(cfg)  # lorakit's own schema takes it as written
    assert checked.lora.rank == 16 and len(checked.lora.targets) == len(pm.MUSUBI_MODULES) == 14
    assert set(pm.SETTINGS) == {"unconstrained", "24gb"}


def test_race_times_steps_by_the_wall_clock_stalls_included(tmp_path):
    import race

    times = [10.0, 20.0, 20.5, 21.0, 24.0, 24.5, 25.0]  # step 1 late (compiling), a 3 s stall before step 5
    got = race.steady(times)
    assert got["intervals"] == 5 and got["median_s"] == 0.5 and got["p90_s"] == 3.0  # the stall is not left out
    assert race.steady([1.0, 2.0])["median_s"] is None
    data = race.draw_dataset(tmp_path / "d", count=6, res=64)
    from PIL import Image

    sizes = {Image.open(p).size for p in data.glob("*.png")}
    assert sizes == {(64, 64), (80, 48), (48, 80)} and len(list(data.glob("*.txt"))) == 6
    line = race.row({"side": "lorakit", "run": 1, "profile": "rtx4090", "cap_gib": 24, "first_step_s": 20.0,
                     "step_100_s": 70.0, "lora_s": 160.0, "whole_s": 162.0, "median_s": 0.5, "p90_s": 0.52,
                     "p90_over_median": 1.04, "gpu_peak_gib": 20.1, "private_peak_gib": 3.2, "rc": 0})
    assert line.startswith("| lorakit run 1 | rtx4090 (24 GiB) | 20.0 | 70.0 | 160.0 |") and "(1.04)" in line


@pytest.mark.slow
def test_race_runs_lorakit_as_a_user_does_and_reports_the_whole_job(tmp_path):
    work = tmp_path / "w"
    for args in (["synth", "--family", "flux", "--models", str(tmp_path / "m"), "--tiny"],
                 ["data", "--out", str(tmp_path / "d"), "--count", "6", "--res", "64"],
                 ["lorakit", "--family", "flux", "--models", str(tmp_path / "m"), "--data", str(tmp_path / "d"),
                  "--work", str(work), "--profile", "cpu", "--steps", "4", "--tiny"]):
        r = subprocess.run([sys.executable, str(TOOLS / "race.py"), *args], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = json.loads((work / "race.json").read_text())
    assert rec["rc"] == 0 and rec["steps"] == 4 and 0 < rec["first_step_s"] < rec["lora_s"] <= rec["whole_s"]
    assert rec["median_s"] > 0 and "| lorakit run 1 | cpu |" in r.stdout
