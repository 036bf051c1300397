"""The maintained instruments of tools/ still work against the package as it is: each runs here on the CPU as far
as it can without a GPU or a peer trainer (tools/README.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))


@pytest.mark.slow
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


@pytest.mark.slow
def test_peer_musubi_keeps_the_steps_of_a_side_that_never_reached_its_own_exit(tmp_path):
    """A side stopped at the plan's limit runs no exit handler: its steps, written as they came, are still read."""
    import peer_musubi as pm

    (tmp_path / "fake_trainer.py").write_text(
        "import os, time\nfrom tqdm import tqdm\nbar = tqdm(range(5), desc='steps')\n"
        "for _ in range(3):\n    time.sleep(0.05)\n    bar.update(1)\nos._exit(9)  # as a kill would: no atexit\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(TOOLS.parent)])}
    rec = pm.measured("fake", ["fake_trainer"], tmp_path, None, env, 120)
    assert rec["rc"] == 9 and "torch_peak_allocated_gib" not in rec  # no stats file: the exit handler never ran
    assert len(rec["step_times"]) == 3 and rec["step_times"] == sorted(rec["step_times"])


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
    assert line.endswith("| - | 0 |") and line.count("|") == race.HEAD.splitlines()[0].count("|")


def test_the_opening_target_sets_the_step_0_grid_aside(tmp_path):
    """Step 100 within the first step + 100 x 1.15 x the steady step, the step-0 grid's own seconds aside (read from
    the run's phases.jsonl; a grid after step 100 is not set aside)."""
    import race

    run = tmp_path / "run"
    run.mkdir()
    phases = [{"time": 31.0, "event": "start", "name": "samples (step 0)"},
              {"time": 49.0, "event": "end", "name": "samples (step 0)", "seconds": 18.0},
              {"time": 500.0, "event": "end", "name": "samples (step 300)", "seconds": 17.0}]
    (run / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in phases))
    times = [30.0, 49.5] + [49.5 + 0.4 * i for i in range(1, 99)]  # step 1 at 30 s, the grid, then 0.4 s steps
    grid = race.step_0_grid(run, times[99])
    rec = race.timeline(0.0, times, None, grid)
    assert grid == 18.0 and rec["median_s"] == 0.4 and rec["step_100_allowed_s"] == round(30 + 46 + 18, 1)
    assert rec["opening_s"] == round(times[99] - 94.0, 1) and race.opening(rec) == "met (5.3 s under)"
    assert race.step_0_grid(run, 40.0) == 0.0 and race.step_0_grid(tmp_path, None) == 0.0  # later; no grid here
    slow = race.timeline(0.0, times[:50] + [t + 10.0 for t in times[50:]], None, grid)  # a 10 s stall at step 51
    assert slow["opening_s"] == 4.7 and race.opening(slow) == "4.7 s over"
    assert "opening_s" not in race.timeline(0.0, times, None)  # a peer's run: its grid is not known


def test_the_clock_check_compares_the_slowest_tenth_of_the_steps_with_the_rest():
    """The GPU's samples (time, SM MHz, watts, clock-event reasons) during the slowest tenth of the step intervals
    against the others: a card that slowed its clock under its power cap shows it there."""
    import race

    times = [float(i) for i in range(22)]  # 20 intervals after the first two steps, 1 s each ...
    times = times[:12] + [t + 0.5 for t in times[12:14]] + [t + 1.0 for t in times[14:]]  # ... two of them 1.5 s
    rows = [(t / 10, 1980, 690.0, 0) for t in range(0, 230)]
    rows = [(t, 1600, 700.0, 0x4) if 11.0 < t < 13.5 else r for r, t in ((r, r[0]) for r in rows)]
    got = race.clock_check(times, rows)
    assert got["sm_mhz_slow"] < got["sm_mhz_rest"] and got["power_capped_slow"] > got["power_capped_rest"]
    assert race.clock_check(times, []) == {} and race.clock_check(times[:2], rows) == {}


@pytest.mark.slow
def _gone(pid: int, seconds: float = 5.0) -> bool:
    """Has process `pid` ended within `seconds`?"""
    import os
    import time

    for _ in range(int(seconds * 10)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_race_stops_a_launcher_and_its_children_at_the_limit_and_reads_the_run_s_own_gpu(tmp_path, monkeypatch):

    import race

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")  # a launcher and the run it starts
    rec = race.measure([sys.executable, "-c", code], tmp_path / "log.txt", timeout=2)
    assert rec["stopped_at_limit_s"] == 2 and rec["rc"] == -9 and rec["whole_s"] < 30
    assert _gone(int(pid_file.read_text())), "the launcher's child outlived the limit"  # not left on the card
    assert race.measure([sys.executable, "-c", "pass"], tmp_path / "l2.txt")["stopped_at_limit_s"] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert race.gpu_index() == 1  # two races side by side, one card each: each reads its own card's memory
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3a")
    assert race.gpu_index() == 0


def test_a_race_driver_stopped_by_sigterm_ends_the_run_and_still_returns_its_record(tmp_path):
    import signal
    import time

    pid_file, out = tmp_path / "child.pid", tmp_path / "rec.json"
    run = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
           f" open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    driver = (f"import json, sys; sys.path[:0] = [{str(TOOLS)!r}, {str(TOOLS.parent)!r}]; import race; "
              f"rec = race.measure([sys.executable, '-c', {run!r}], __import__('pathlib').Path({str(tmp_path / 'l')!r}),"
              f" timeout=120); open({str(out)!r}, 'w').write(json.dumps(rec))")
    d = subprocess.Popen([sys.executable, "-c", driver])
    for _ in range(300):  # the measured run has started its child
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.1)
    d.send_signal(signal.SIGTERM)  # as an outer `timeout` ends the driver before the run's own limit
    assert d.wait(timeout=60) == 0
    rec = json.loads(out.read_text())
    assert rec["stopped_by_signal_s"] is not None and rec["stopped_at_limit_s"] is None and rec["rc"] == -9
    assert _gone(int(pid_file.read_text())), "the run's child outlived the driver's SIGTERM"


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
    assert rec["rc"] == 0 and rec["steps"] == 4 and 0 < rec["first_step_s"] <= rec["lora_s"]  # 0.1 s apart <= rec["whole_s"]
    assert rec["median_s"] > 0 and "| lorakit run 1 | cpu |" in r.stdout
    sp = rec["spread"]  # the loop around the step, each bucket shape's steps (after the first two)
    assert sp["loop_ms_median"] >= 0 and sum(v["steps"] for v in sp["by_shape"].values()) == 2
    assert 0 <= sp["wait_ms_median"] <= sp["wait_ms_p90"]  # the host's wait for the (here: CPU's) work
    assert set(sp["by_shape"]) <= {"64x64", "80x48", "48x80"}


@pytest.mark.slow
def test_host_slack_times_each_variant_quiet_and_busy_and_leaves_the_trainer_as_it_was(tmp_path, tiny):
    import host_slack

    from lorakit.train.trainer import Trainer

    before = Trainer.update_before_check
    out = tmp_path / "slack.json"
    rows = host_slack.main(["--family", "flux", "--res", "64", "--profile", "cpu", "--device", "cpu", "--tiny",
                            "--steps", "2", "--busy", "1", "--out", str(out)])
    assert [(r["variant"], r["host"]) for r in rows] == [(v, h) for v in host_slack.VARIANTS
                                                         for h in ("quiet", "1 busy processes")]
    for r in rows:  # the host's part is inside the step, the update inside the host's time after backward
        assert 0 < r["host_s"] <= r["step_s"] <= r["step_p90_s"] and 0 < r["update_s"] < r["step_s"]
        assert len(r["steps_s"]) == 2
    assert json.loads(out.read_text())["rows"] == rows
    assert Trainer.update_before_check is before
    with pytest.raises(SystemExit):
        host_slack.main(["--variants", "as-run,faster"])


def test_the_spread_splits_the_loop_from_the_step_and_the_shapes_apart():
    import race

    recs = [{"step": k, "loss": 1.0, "size": "64x64" if k % 2 else "80x48", "step_s": 0.5 if k % 2 else 1.0,
             "s_per_step": (0.5 if k % 2 else 1.0) + 0.002} for k in range(1, 23)]
    sp = race.spread(recs)
    assert sp["loop_ms_median"] == 2.0 and sp["loop_ms_p90"] == 2.0
    assert sp["by_shape"]["64x64"] == {"steps": 10, "median_s": 0.502, "p90_s": 0.502, "p90_over_median": 1.0}
    assert sp["by_shape"]["80x48"]["median_s"] == 1.002 and sp["by_shape"]["80x48"]["steps"] == 10
    assert race.spread(recs[:2]) == {} and "wait_ms_median" not in sp  # records before wait_s: none said
    for k, r in enumerate(recs):  # the host's wait for the GPU, where the records carry it
        r["wait_s"] = 0.001 * k
    sp = race.spread(recs)
    assert sp["wait_ms_median"] == 11.5 and sp["wait_ms_p90"] == 19.0  # of steps 3-22 (the first two left out)


@pytest.mark.slow
def test_full_path_on_two_processes_stops_resumes_converts_and_samples(tmp_path):
    """tools/full_path.py on 2 gloo ranks: `lorakit train --gpus 2` sent SIGTERM ends with 75 and leaves no rank
    behind (it used to end alone while its ranks trained on), `--resume latest` records every step once, the newest
    checkpoint converts, and diffusers' own class loads both folders into the stock pipeline, which samples."""
    import race

    from lorakit.bench.hub import write_model

    # race.py's synth and data, in this process (their commands run in the test above)
    write_model("flux", tmp_path / "m" / "flux", device="cpu", scale="tiny")
    race.draw_dataset(tmp_path / "d", count=6, res=64)
    r = subprocess.run([sys.executable, str(TOOLS / "full_path.py"), "run", "--family", "flux", "--models",
                        str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--work", str(tmp_path / "w"), "--gpus",
                        "2", "--steps", "12", "--save-every", "4", "--stop-after", "5", "--tiny"],
                       capture_output=True, text=True, timeout=900)
    rep = json.loads((tmp_path / "w" / "full_path.json").read_text())
    assert r.returncode == 0, json.dumps(rep)[-3000:]
    assert rep["train"]["rc"] == 75 and 5 <= rep["train"]["steps_done"] < 12 and rep["train"]["ranks_left"] == 0
    assert rep["resume"]["rc"] == 0 and rep["every_step_once"]
    assert rep["convert"]["rc"] == 0 and rep["sample"]["rc"] == 0
    assert Image.open(tmp_path / "w" / "sample.png").size == (64, 64)
    assert all(0 <= rep[k]["after_last_line_s"] < rep[k]["wall_s"] for k in ("train", "resume", "convert", "sample"))
    names = [n for n, _ in rep["checkpoints"]]  # every 4 steps, the stop's, then the end's (links to step 12's)
    assert names[:1] == ["checkpoint (step 4)"] and names[-2:] == ["checkpoint (step 12)", "final checkpoint (step 12)"]


def _fake_aitk(root: Path, steps: int = 3) -> Path:
    """A stand-in for an ai-toolkit checkout, as far as peer_aitoolkit reads it: the example config's keys, a
    progress bar class, and a run.py that trains `steps` steps and writes the LoRA file where ai-toolkit does."""
    ex = root / "config" / "examples"
    ex.mkdir(parents=True)
    proc = {"type": "sd_trainer", "training_folder": "output", "device": "cuda:0",
            "network": {"type": "lora", "linear": 16, "linear_alpha": 16},
            "save": {"dtype": "float16", "save_every": 250},
            "datasets": [{"folder_path": "/x", "caption_ext": "txt", "resolution": [512, 768, 1024]}],
            "train": {"steps": 2000, "optimizer": "adamw8bit", "gradient_checkpointing": True},
            "model": {"name_or_path": "black-forest-labs/FLUX.1-dev", "is_flux": True, "quantize": True},
            "sample": {"sample_every": 250, "width": 1024, "height": 1024, "prompts": ["a", "b", "c"],
                       "sample_steps": 20}}
    (ex / "train_lora_flux_24gb.yaml").write_text(yaml.safe_dump({"job": "extension", "config": {
        "name": "example", "process": [proc]}}))
    qwen = {**proc, "model": {"name_or_path": "Qwen/Qwen-Image", "arch": "qwen_image", "quantize": True,
                              "qtype": "uint3|ostris/accuracy_recovery_adapters/qwen_image_torchao_uint3.safetensors",
                              "quantize_te": True, "qtype_te": "qfloat8", "low_vram": True}}
    (ex / "train_lora_qwen_image_24gb.yaml").write_text(yaml.safe_dump({"job": "extension", "config": {
        "name": "example", "process": [qwen]}}))
    (root / "toolkit").mkdir()
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "progress_bar.py").write_text(
        "from tqdm import tqdm\n\n\nclass ToolkitProgressBar(tqdm):\n"
        "    def __init__(self, *a, **k):\n        super().__init__(*a, **k)\n        self.paused = False\n\n"
        "    def update(self, *a, **k):\n        if not self.paused:\n            super().update(*a, **k)\n")
    (root / "run.py").write_text(
        "import sys, time, yaml\nfrom pathlib import Path\nfrom toolkit.progress_bar import ToolkitProgressBar\n"
        "cfg = yaml.safe_load(open(sys.argv[1]))['config']\nproc = cfg['process'][0]\n"
        "bar = ToolkitProgressBar(total=proc['train']['steps'])\n"
        "bar.paused = True\nbar.update(0)\nbar.paused = False\n"  # a paused bar (sampling) is no step
        "for _ in range(proc['train']['steps']):\n    time.sleep(0.05)\n    bar.update(1)\n"
        "out = Path(proc['training_folder']) / cfg['name']\nout.mkdir(parents=True)\n"
        "from safetensors.torch import save_file\nimport torch\n"
        "save_file({'m.lora_down.weight': torch.zeros(1), 'm.lora_up.weight': torch.zeros(1)},"
        " str(out / (cfg['name'] + '.safetensors')))\n")
    return root


@pytest.mark.slow
def test_peer_aitoolkit_writes_its_documented_config_with_the_race_changes_and_times_its_steps(tmp_path):
    import argparse

    import peer_aitoolkit as pa
    import race

    src = _fake_aitk(tmp_path / "aitk", steps=3)
    a = argparse.Namespace(aitk=str(src), family="flux", models=str(tmp_path / "m"), data=tmp_path / "d", steps=3,
                           setting="datacenter", tiny=False, cap=None, limit=120, aitk_path=None,
                           aitk_cudnn_sdpa=False)
    work = tmp_path / "w"
    work.mkdir()
    path, changed = pa.aitk_config(a, work / "aitk-datacenter")
    proc = yaml.safe_load(path.read_text())["config"]["process"][0]
    assert proc["datasets"][0]["resolution"] == [1024] and proc["train"]["steps"] == 3
    assert proc["network"]["network_kwargs"]["only_if_contains"] == [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
        "attn.add_v_proj", "attn.to_add_out"]
    assert proc["model"]["quantize"] is False and proc["train"]["optimizer"] == "adamw8bit"  # as documented
    assert proc["save"]["save_every"] == proc["sample"]["sample_every"] == 3
    assert any("resolution" in c for c in changed) and any("quantize" in c for c in changed)
    a.setting = "24gb"
    proc = yaml.safe_load(pa.aitk_config(a, work / "aitk-24gb")[0].read_text())["config"]["process"][0]
    assert proc["model"]["quantize"] is True  # the 24 GB example as it is
    a.setting = "datacenter"
    (work / "aitk-datacenter").mkdir()
    rec = pa.aitk_run(a, work)  # the launcher runs the stand-in's run.py and times its progress bar
    assert rec["rc"] == 0, rec["log_tail"]
    assert rec["steps"] == 3 and rec["lora_modules"] == 1 and 0 < rec["first_step_s"] <= rec["lora_s"]  # 0.1 s apart
    assert "gpu" in rec  # the card each side ran on (None here: no GPU)
    assert race.ratios([rec, {**rec, "side": "lorakit", "lora_s": rec["lora_s"] / 2}], "ai-toolkit")["whole_job"] == 2.0


def test_peer_aitoolkit_keeps_the_qwen_24gb_quantisation_without_its_hub_adapter(tmp_path):
    import argparse

    import peer_aitoolkit as pa

    src = _fake_aitk(tmp_path / "aitk")
    a = argparse.Namespace(aitk=str(src), family="qwen-image", models=str(tmp_path / "m"), data=tmp_path / "d",
                           steps=300, setting="24gb", tiny=False)
    path, changed = pa.aitk_config(a, tmp_path / "aitk-24gb")
    model = yaml.safe_load(path.read_text())["config"]["process"][0]["model"]
    assert model["quantize"] is True and model["qtype"] == "uint3" and model["qtype_te"] == "qfloat8"
    assert any("accuracy recovery adapter" in c and "uint3|ostris/" in c for c in changed)
    local = tmp_path / "ara.safetensors"  # an adapter on the machine stays as documented
    local.write_bytes(b"x")
    doc = yaml.safe_load((src / "config/examples/train_lora_qwen_image_24gb.yaml").read_text())
    doc["config"]["process"][0]["model"]["qtype"] = f"uint3|{local}"
    (src / "config/examples/train_lora_qwen_image_24gb.yaml").write_text(yaml.safe_dump(doc))
    path, changed = pa.aitk_config(a, tmp_path / "aitk-24gb")
    assert yaml.safe_load(path.read_text())["config"]["process"][0]["model"]["qtype"] == f"uint3|{local}"
    assert not any("accuracy recovery adapter" in c for c in changed)


def _fake_simpletuner(site: Path) -> Path:
    """A stand-in for an installed SimpleTuner, as far as peer_simpletuner reads it: its example configs, its step
    counter, and a train.py that reads the config as `CONFIG_BACKEND=json` does, counts its steps and writes the
    LoRA file where SimpleTuner does."""
    pkg = site / "simpletuner"
    for name, cfg in (("flux.peft-lora", {"base_model_precision": "int8-quanto", "checkpoint_step_interval": 10,
                                          "lora_rank": 16, "lora_alpha": 16, "max_train_steps": 100,
                                          "model_family": "flux", "optimizer": "adamw_bf16",
                                          "validation_steps": 50}),
                      ("qwen_image.peft-lora", {"base_model_precision": "no_change", "lora_rank": 32,
                                                "lora_alpha": 32, "model_family": "qwen_image",
                                                "model_flavour": "v2.1", "resume_from_checkpoint": "",
                                                "crepa_enabled": True, "validation_step_interval": 250,
                                                "assistant_lora_path": "SimpleTuner/Qwen-Image-2.1-assistant",
                                                "disable_assistant_lora": False, "dynamo_backend": "inductor"})):
        (pkg / "examples" / name).mkdir(parents=True)
        (pkg / "examples" / name / "config.json").write_text(json.dumps(cfg))
    (pkg / "helpers" / "training").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers" / "__init__.py").write_text("")
    (pkg / "helpers" / "training" / "__init__.py").write_text("")
    (pkg / "helpers" / "training" / "iteration_tracker.py").write_text(
        "class IterationTracker:\n    def record_step(self, global_step):\n        self.last = global_step\n")
    (pkg / "train.py").write_text(
        "import json, os, time\nfrom pathlib import Path\n"
        "from simpletuner.helpers.training.iteration_tracker import IterationTracker\n"
        "assert os.environ['CONFIG_BACKEND'] == 'json'\n"
        "cfg = json.loads(Path(os.environ['CONFIG_PATH'] + '.json').read_text())\n"
        "assert json.loads(Path(cfg['data_backend_config']).read_text())[0]['caption_strategy'] == 'textfile'\n"
        "t = IterationTracker()\n"
        "for k in range(cfg['max_train_steps']):\n    time.sleep(0.05)\n    t.record_step(k + 1)\n"
        "out = Path(cfg['output_dir'])\nout.mkdir(parents=True)\n"
        "from safetensors.torch import save_file\nimport torch\n"
        "save_file({'m.lora_A.weight': torch.zeros(1), 'm.lora_B.weight': torch.zeros(1)},"
        " str(out / 'pytorch_lora_weights.safetensors'))\n")
    return site


@pytest.mark.slow
def test_peer_simpletuner_runs_its_example_config_with_the_race_changes_through_accelerate_and_times_its_steps(
        tmp_path):
    import argparse

    import peer_simpletuner as ps
    import race

    site = _fake_simpletuner(tmp_path / "site")
    a = argparse.Namespace(st_path=[str(site)], st_python=sys.executable, family="qwen-image",
                           models=str(tmp_path / "m"), data=tmp_path / "d", steps=3, setting="datacenter",
                           tiny=False, cap=None, limit=120, st_inductor_first=False,
                           st_dynamo_wrapper=None, st_no_compile=False)
    work = tmp_path / "w"
    (work / "q").mkdir(parents=True)
    path, changed = ps.st_config(a, work / "q", ps.st_example_dir(a))
    cfg = json.loads(path.with_suffix(".json").read_text())
    assert cfg["peft_lora_target_modules"] == ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                               "add_v_proj", "to_add_out"]  # its default trains 4 of the 8
    assert (cfg["lora_rank"], cfg["lora_alpha"], cfg["max_train_steps"]) == (16, 16, 3)
    assert cfg["base_model_precision"] == "no_change" and cfg["resume_from_checkpoint"] is None
    assert cfg["checkpoint_step_interval"] == cfg["validation_steps"] == cfg["validation_step_interval"] == 3
    assert cfg["model_flavour"] == "v1.0" and cfg["crepa_enabled"] is False  # the folder is Qwen-Image; no hub
    assert cfg["assistant_lora_path"] is None and cfg["disable_assistant_lora"] is True
    assert any("rank/alpha 32/32" in c for c in changed) and any("crepa_enabled True off" in c for c in changed)
    assert not any("base_model_precision" in c for c in changed)  # unquantised already: nothing changed, none said
    a.setting = "24gb"
    (work / "q24").mkdir()
    cfg = json.loads(ps.st_config(a, work / "q24", ps.st_example_dir(a))[0].with_suffix(".json").read_text())
    assert cfg["base_model_precision"] == "int2-quanto"  # its quickstart's 24 GB settings
    assert cfg["quantize_via"] == "cpu" and cfg["offload_during_startup"] is True
    assert "dynamo_wrapper" not in cfg  # its own default unless asked
    a.st_dynamo_wrapper = "python"
    cfg = json.loads(ps.st_config(a, work / "q24", ps.st_example_dir(a))[0].with_suffix(".json").read_text())
    assert cfg["dynamo_wrapper"] == "python"
    a.st_dynamo_wrapper, a.st_no_compile = None, True
    cfg = json.loads(ps.st_config(a, work / "q24", ps.st_example_dir(a))[0].with_suffix(".json").read_text())
    assert cfg["dynamo_backend"] == "no"
    a.st_no_compile = False
    a.setting = "datacenter"
    backend = json.loads(Path(cfg["data_backend_config"]).read_text())
    assert backend[0]["resolution"] == 1024 and backend[0]["crop"] is False and backend[1]["default"] is True
    a.family, a.setting = "flux", "24gb"
    (work / "f").mkdir()
    cfg = json.loads(ps.st_config(a, work / "f", ps.st_example_dir(a))[0].with_suffix(".json").read_text())
    assert cfg["base_model_precision"] == "int8-quanto" and cfg["flux_lora_target"] == "all"  # as documented
    assert cfg["optimizer"] == "adamw_bf16" and cfg["model_flavour"] == "dev"
    a.setting = "datacenter"
    rec = ps.st_run(a, work)  # accelerate launch -> the launcher -> the stand-in's train.py, its steps timed
    assert rec["rc"] == 0, rec["log_tail"]
    assert "accelerate.commands.launch --mixed_precision=bf16 --num_processes=1" in rec["cmd"]
    assert rec["steps"] == 3 and rec["lora_modules"] == 1 and 0 < rec["first_step_s"] <= rec["lora_s"]
    assert race.ratios([rec, {**rec, "side": "lorakit", "lora_s": rec["lora_s"] / 2}], "SimpleTuner")["whole_job"] == 2.0
    a.st_path = [str(tmp_path / "nothing")]
    with pytest.raises(SystemExit, match="SimpleTuner is not importable"):
        ps.st_example_dir(a)


def test_graph_sizes_plans_each_shape_and_length_then_the_padded_one_then_new_lengths_without_the_checks():
    import graph_sizes

    steps = graph_sizes.plan([(64, 64), (80, 48)], [12, 13], pad=32, repeat=2, steady=3)
    assert [s[4] for s in steps[:8]] == [f"{w}x{h} text {n}" for w, h in ((64, 64), (80, 48)) for n in (12, 13)
                                         for _ in range(2)]
    assert [s[:4] for s in steps[8:11]] == [(64, 64, 12, 0)] * 3  # steady: the first size again
    assert [s[:4] for s in steps[11:16]] == [(64, 64, 12, 32)] * 5  # padded: repeat + steady
    assert [(s[:3], s[5]) for s in steps[16:]] == [((64, 64, 14), False)] * 2 + [((80, 48, 14), False)] * 2
    assert all(s[5] for s in steps[:16])  # torch's pool checks on until the last part


@pytest.mark.slow
def test_graph_sizes_feeds_the_step_the_sizes_and_text_it_names(tmp_path, tiny):
    import graph_sizes
    import torch

    from lorakit.bench.ways import synthetic_batch
    from lorakit.models.base import family_adapter

    out = tmp_path / "sizes.json"
    rows = graph_sizes.main(["--family", "qwen-image", "--profile", "cpu", "--device", "cpu", "--tiny", "--no-graphs",
                             "--shapes", "64x64,80x48", "--lengths", "5,6", "--pad", "8", "--repeat", "2",
                             "--steady", "1", "--out", str(out)])
    assert [r["size"] for r in rows] == ["64x64"] * 4 + ["80x48"] * 4 + ["64x64"] * 4 + ["64x64"] * 2 + ["80x48"] * 2
    assert all(r["s"] > 0 and r["loss"] == r["loss"] for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
    base = synthetic_batch("qwen-image", "tiny", 64)
    padded = graph_sizes.batch_of(base, family_adapter("qwen-image"), 80, 48, 5, 8, 0)
    assert padded.latents.shape[-2:] == (6, 10) and padded.text["prompt_embeds"].shape[1] == 8
    assert padded.text["prompt_embeds_mask"].tolist() == [[1] * 5 + [0] * 3]
    assert torch.all(padded.text["prompt_embeds"][:, 5:] == 0)
