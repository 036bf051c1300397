"""`lorakit push`: a finished run becomes a Hub-ready folder whose model card huggingface_hub parses; offline it is
written and the upload command said; a folder that is not a finished run is bad input."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import make_demo_dataset
from tests.unit.models.test_sources import COMMIT, _hub_cache


@pytest.mark.slow
def test_a_run_pushed_offline_is_a_folder_with_a_card_the_hub_parses(tmp_path, tiny):
    hub = tmp_path / "hub-cache"
    _hub_cache(hub, "black-forest-labs/FLUX.1-dev", tiny("flux"))
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    out = tmp_path / "out"
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": "black-forest-labs/FLUX.1-dev"},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128,
                    "trigger": "sks"},
           "schedule": {"steps": 2}, "sampling": {"steps": 2, "prompts": ["a sks circle"]},
           "output": {"dir": str(out)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    lk = [sys.executable, "-m", "lorakit"]
    r = subprocess.run([*lk, "train", str(tmp_path / "run.yaml"), "--json"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    p = subprocess.run([*lk, "push", str(out), "me/my-flux-lora", "--license", "apache-2.0", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout)
    assert res["uploaded"] is False and res["how"].startswith("hf upload me/my-flux-lora ")
    assert res["warnings"] == [] and "lora.safetensors" in res["files"] and "README.md" in res["files"]
    card = ModelCard.load(out / "hub" / "README.md")
    d = card.data.to_dict()
    assert d["base_model"] == "black-forest-labs/FLUX.1-dev" and d["license"] == "apache-2.0"
    assert {"lora", "diffusers", "lorakit", "flux", "text-to-image"} <= set(d["tags"])
    assert d["instance_prompt"] == "sks"
    (w,) = d["widget"]
    assert w["text"] == "a sks circle" and (out / "hub" / w["output"]["url"]).is_file()
    assert "pipe.load_lora_weights('me/my-flux-lora', weight_name='lora.safetensors')" in card.text
    assert "| steps | 2 |" in card.text
    assert (out / "hub" / "lora.safetensors").read_bytes() == (out / "lora.safetensors").read_bytes()
    assert COMMIT in yaml.safe_load((out / "config.resolved.yaml").read_text())["model"]["path"]


def test_push_refuses_what_is_not_a_finished_run_or_a_repo_name(tmp_path):
    r = CliRunner().invoke(app, ["push", str(tmp_path), "me/x"])  # refused before anything reaches the Hub
    assert r.exit_code == 2 and "is not a finished lorakit run (no config.resolved.yaml, lora.safetensors)" in r.stderr
    r = CliRunner().invoke(app, ["push", str(tmp_path), "not a repo"])
    assert r.exit_code == 2 and "not a Hub repo name" in r.stderr


@pytest.mark.slow
def test_output_hub_repo_pushes_a_finished_run(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    out = tmp_path / "out"
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 2}, "sampling": {"enabled": False},
           "output": {"dir": str(out), "hub_repo": "me/auto-pushed", "hub_license": "mit"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "lorakit", "train", str(tmp_path / "run.yaml")], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"output.hub_repo: {out / 'hub'} written; hf upload me/auto-pushed " in r.stdout
    assert "warning: output.hub_repo: no base_model in the card" in r.stdout  # a local folder: said, not guessed
    assert ModelCard.load(out / "hub" / "README.md").data.to_dict()["license"] == "mit"
    bad = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml"), "--dry-run", "--force", "--set",
                                   "output.hub_repo=not a repo"])
    assert bad.exit_code == 2 and "output.hub_repo" in bad.stderr


def test_a_push_that_cannot_reach_the_hub_says_so_not_to_log_in(tmp_path, tiny, monkeypatch):
    """`push` without a network hinted `hf auth login`; now the hint names what failed: the connection, or the
    credentials."""
    import pytest

    from lorakit import hub
    from lorakit.errors import EnvironmentFault

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"family": "flux", "path": "/x"}}))
    (run / "lora.safetensors").write_bytes(b"")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "offline", lambda: False)

    failure = {}

    class Api:  # huggingface_hub's client as it fails on this machine (no network here to fail for real)
        def create_repo(self, *a, **k):
            raise failure["error"]

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    for err, said in ((ConnectionError("Failed to resolve 'huggingface.co'"), "could not be reached"),
                      (RuntimeError("401 Client Error"), "hf auth login")):
        failure["error"] = err
        with pytest.raises(EnvironmentFault) as e:
            hub.push(run, "me/x")
        assert said in e.value.hint and "the folder is written" in e.value.hint
    failure["error"] = ConnectionError("offline")
    with pytest.raises(EnvironmentFault) as e:
        hub.push(run, "me/x")
    assert "hf auth login" not in e.value.hint
