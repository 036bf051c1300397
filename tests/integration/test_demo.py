import json

import pytest
from PIL import Image
from typer.testing import CliRunner

from lorakit.cli.app import app


@pytest.mark.slow
def test_demo_runs_end_to_end_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "demo"
    r = CliRunner().invoke(app, ["demo", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert [s["name"] for s in data["stages"]][:5] == ["build tiny pipeline", "demo dataset", "doctor", "config",
                                                       "cache (text embeddings + latents)"]
    assert data["stages"][4]["detail"].startswith("4 items (4 encoded")
    assert data["stages"][5]["name"] == "train (LoRA)" and data["stages"][5]["detail"].startswith("60 steps")
    assert (out / "samples_lora.png").is_file() and (out / "run" / "loss_curve.png").is_file()
    with Image.open(data["files"]["samples_base"]) as im:  # a 4 x 2 grid of 64² samples under a label
        assert im.width >= 256 and im.height == 128 + 36
        assert im.crop((0, 36, 256, 164)).getextrema() != ((255, 255),) * 3  # the grid itself is drawn
    assert "noise, by design" in data["stages"][6]["detail"]
    assert (out / "config.resolved.yaml").read_text().startswith("profile: cpu")
    assert json.loads((out / "doctor.json").read_text())["summary"]["fail"] == 0
    assert len(list((out / "data").glob("*.txt"))) == 4


def test_demo_unknown_family(tmp_path):
    r = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--family", "flux2"])
    assert r.exit_code == 2 and "did you mean 'flux'" in r.output
