"""The CLI as users meet it: in-process (CliRunner) and as a real subprocess."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app

COMMANDS = ["doctor", "cache", "train", "convert", "bench", "infer", "demo"]
runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_help_lists_the_seven_commands_with_descriptions():
    r = run("--help")
    assert r.exit_code == 0
    for c in COMMANDS:
        line = next(ln for ln in r.output.splitlines() if ln.strip().startswith(c + " "))
        assert len(line.split(None, 1)[1]) > 10  # a one-line description


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.output.startswith("lorakit ")


@pytest.mark.parametrize("cmd", [["doctor"], ["cache"], ["train"], ["infer"], ["demo"], ["convert", "lora"],
                                 ["convert", "cache"], ["convert", "model"], ["convert", "merge"],
                                 ["bench", "load"], ["bench", "step"]])
def test_every_command_has_help_and_json(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0 and "--json" in r.output


def _subprocess(*args, env=None, timeout=60):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "lorakit", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_python_m_lorakit_runs_the_cli():
    r = _subprocess("--help")
    assert r.returncode == 0 and "train" in r.stdout
    r = _subprocess("train", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout


def test_help_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from lorakit.cli.app import app; "
            "CliRunner().invoke(app, ['train', '--help']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.fixture
def bad_config(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"model": {"family": "flux"}, "lora": {"rnk": 4, "rank": "big"}}))
    return p


@pytest.mark.slow
def test_config_error_one_report_exit_2(bad_config):
    r = _subprocess("train", str(bad_config), "--dry-run")
    assert r.returncode == 2
    assert "2 problems" in r.stderr and "lora.rnk" in r.stderr and "lora.rank" in r.stderr
    assert "Traceback" not in r.stderr and "hint:" in r.stderr


@pytest.mark.slow
def test_config_error_as_json(bad_config):
    r = _subprocess("train", str(bad_config), "--dry-run", "--json")
    assert r.returncode == 2
    data = json.loads(r.stdout)
    assert data["error"] == "ConfigError" and len(data["problems"]) == 2


@pytest.mark.slow
def test_traceback_only_with_lorakit_debug(bad_config):
    r = _subprocess("train", str(bad_config), "--dry-run", env={"LORAKIT_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_unknown_profile_suggests(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("model:\n  family: flux\n")
    r = run("train", str(p), "--profile", "rtx4909", "--dry-run")
    assert r.exit_code == 2 and "did you mean 'rtx4090'" in r.output


def test_dry_run_prints_resolved_config(tmp_path, tiny):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    (tmp_path / "data").mkdir()
    p = tmp_path / "ok.yaml"
    p.write_text(f"model:\n  family: qwen-image\n  path: {tmp_path / 'model'}\nlora:\n  rank: 8\n"
                 f"data:\n  dirs: [{tmp_path / 'data'}]\n")
    r = run("train", str(p), "--dry-run", "--profile", "cpu")  # the folder the run would refuse, refused now
    assert r.exit_code == 2 and "holds a None, not the QwenImagePipeline" in r.output
    p.write_text(f"model:\n  family: qwen-image\n  path: {tiny('qwen-image')}\nlora:\n  rank: 8\n"
                 f"data:\n  dirs: [{tmp_path / 'data'}]\n")
    r = run("train", str(p), "--dry-run", "--set", "lora.rank=32", "--profile", "cpu", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["config"]["lora"]["rank"] == 32 and data["profile"]["profile"] == "cpu"
    r = run("train", str(p), "--dry-run", "--profile", "cpu")
    assert "rank: 8" in r.output and "profile: cpu" in r.output


def test_full_size_bench_step_without_a_gpu_says_so_plainly(tmp_path):
    r = run("bench", "step", "--json")
    assert r.exit_code == 2
    data = json.loads(r.output)
    assert data["error"] == "InputError" and "--tiny" in data["hint"]


def test_doctor_on_cpu_exits_0_with_cpu_profile():
    r = run("doctor", "--quick", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["profile"]["name"] == "cpu" and data["summary"]["fail"] == 0
    assert any(c["name"] == "gpu" and c["status"] == "warn" for c in data["checks"])
    r = run("doctor", "--quick")
    assert "profile: cpu" in r.output and "ready" in r.output


def test_doctor_rereads_a_saved_h100_report():
    from pathlib import Path

    report = Path(__file__).resolve().parents[1] / "fixtures" / "doctor-h100-2026-11-22.json"
    r = run("doctor", "--from", str(report), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["profile"]["name"] == "datacenter"
    assert data["facts"]["gpus"][0]["unified"] is False  # a discrete H100 is not unified memory
    choice = data["attention"]["choice"]
    assert choice["flux"] == "flash"  # cuDNN failed inside the FLUX transformer there
    assert choice["qwen-image"] in ("cudnn", "efficient")  # flash cannot take Qwen's mask
    cudnn = next(c for c in data["checks"] if c["name"] == "sdpa cudnn")
    assert cudnn["status"] == "warn" and "model flux" in cudnn["detail"]


def test_doctor_from_a_file_that_is_not_a_report(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[1, 2]")
    r = run("doctor", "--from", str(p))
    assert r.exit_code == 2 and "not a `lorakit doctor --json` report" in r.output


def test_cache_check_lists_every_problem_and_strict_fails(tmp_path):
    from lorakit.data.demo import make_demo_dataset

    ds = make_demo_dataset(tmp_path / "ds", "edit-plus", count=4, size=64)
    (ds / "control_2" / "edit_001.png").unlink()
    (ds / "images" / "edit_002.txt").write_text("")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"family": "qwen-image-edit-plus"},
                                   "data": {"dirs": [str(ds)], "resolution": 64, "bucket_min_side": 32,
                                            "bucket_max_side": 128}}))
    r = run("cache", str(cfg), "--check", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["items"] == 2 and data["datasets"][0]["controls"] == ["control", "control_2"]
    assert sorted(p["code"] for p in data["problems"]) == ["empty-caption", "no-control"]
    assert data["buckets"] == {"64x64": 2}
    r = run("cache", str(cfg), "--check", "--strict")
    assert r.exit_code == 2
    # every file named as "path: problem: detail", never as a Python dict, and not called a config problem
    assert "{'path'" not in r.stderr and "config:" not in r.stderr, r.stderr
    assert "edit_001.png: no-control: " in r.stderr and "  - " in r.stderr and \
        "edit_002.txt: empty-caption: caption file is empty" in r.stderr, r.stderr
    r = run("cache", str(cfg), "--json")  # building needs the model
    assert r.exit_code == 2 and "model.path" in json.loads(r.output)["message"]


@pytest.mark.slow
def test_library_notices_stay_off_a_commands_output(tmp_path, tiny):
    """bitsandbytes' "Failed to load CPU gemm_4bit_forward ... pip install kernels" on every `convert`, and peft's
    "Already found a peft_config ..." when infer loads a second LoRA, leaked into normal output."""
    import subprocess
    import sys
    import warnings

    from lorakit.quiet import quiet_libraries
    from tests.loras import trained_like

    lora = trained_like(tiny, "flux", tmp_path / "a.safetensors", targets="attention")
    r = subprocess.run([sys.executable, "-m", "lorakit", "convert", "lora", str(lora), str(tmp_path / "b.safetensors"),
                        "--to", "comfyui"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "gemm_4bit" not in r.stdout + r.stderr and "kernels" not in r.stdout + r.stderr, \
        r.stdout + r.stderr
    quiet_libraries()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_libraries()
        warnings.warn("Already found a `peft_config` attribute in the model. This will lead to having multiple "
                      "adapters in the model. Make sure to know what you are doing!", stacklevel=1)
    assert not seen
