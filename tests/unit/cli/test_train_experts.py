"""`model.expert: both` (Wan 2.2 A14B): `lorakit train` trains the high-noise expert, then the low-noise one, each
into its own folder from one cache; --resume continues the unfinished one (lorakit/cli/experts.py)."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import make_demo_dataset
from lorakit.io import read_header

runner = CliRunner()


def _config(tmp_path, tiny, **output):
    data = make_demo_dataset(tmp_path / "d", "video", count=2, size=64, frames=6)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "profile": "cpu", "model": {"family": "wan2.2-t2v", "path": str(tiny("wan2.2-t2v")), "expert": "both"},
        "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "frames": 5},
        "schedule": {"steps": 2}, "sampling": {"enabled": False},
        "output": {"dir": str(tmp_path / "out"), **output}}))
    return path


def _train(*args):
    r = runner.invoke(app, ["train", *map(str, args), "--json"])
    return r, (json.loads(r.stdout) if r.exit_code == 0 else None)


@pytest.mark.slow
def test_both_experts_train_one_after_the_other_into_their_folders_from_one_cache(tmp_path, tiny):
    path = _config(tmp_path, tiny)
    r, res = _train(path)
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    assert list(res["experts"]) == ["high", "low"] and not res["interrupted"]
    assert res["loras"] == {e: str(out / e / "lora.safetensors") for e in ("high", "low")}
    for e in ("high", "low"):
        run = res["experts"][e]
        assert run["expert"] == e  # the summary's load line follows it
        assert run["steps"] == 2 and run["consumer_check"] == {"diffusers": "equal", "comfyui": "equal"}
        assert read_header(out / e / "lora.safetensors").metadata["lorakit_expert"] == e  # infer routes it by this
        assert (out / e / "checkpoints" / "final").is_dir()
    assert res["experts"]["high"]["cache"]["encoded"] == 2  # the one cache: built by the first run...
    assert res["experts"]["low"]["cache"]["reused"] == 2 and res["experts"]["low"]["cache"]["encoded"] == 0
    assert (out / "cache").is_dir() and not (out / "high" / "cache").exists()

    r, again = _train(path)  # a second start without --resume: refused by name, as any run into a used folder
    assert r.exit_code == 2 and f"output.dir {out / 'high'} holds a finished run" in r.output

    import shutil

    shutil.rmtree(out / "low")  # the low-noise expert's run never happened (killed before it began)
    r, res = _train(path, "--resume", "latest")
    assert r.exit_code == 0, r.output
    assert res["experts"]["high"]["skipped"].startswith("a finished run")  # not trained again
    assert res["experts"]["low"]["steps"] == 2 and set(res["loras"]) == {"high", "low"}

    r, dry = _train(path, "--dry-run", "--resume", "latest")
    assert r.exit_code == 0 and {e: d["config"]["model"]["expert"] for e, d in dry["experts"].items()} == {
        "high": "high", "low": "low"}


def test_both_experts_refuse_what_would_mix_the_two_runs(tmp_path, tiny):
    r, _ = _train(_config(tmp_path, tiny, hub_repo="me/wan-lora"))
    assert r.exit_code == 2 and "output.hub_repo: model.expert both makes two LoRA files" in r.output
    r, _ = _train(_config(tmp_path, tiny), "--resume", tmp_path / "out" / "high" / "checkpoints" / "final")
    assert r.exit_code == 2 and "each expert's run has its own checkpoints" in r.output

    from lorakit.errors import ConfigError
    from lorakit.plan.resolve import resolve
    from lorakit.train.loop import run

    with pytest.raises(ConfigError, match="model.expert: both is two runs"):  # the library trains one expert a run
        run(resolve(_config(tmp_path, tiny)))


def test_the_summary_names_the_diffusers_call_each_experts_file_needs(capsys):
    from lorakit.cli.train import _render

    run = {"interrupted": False, "steps": 2, "seconds": 1.5, "checkpoint": "ck", "metrics": "m.jsonl"}
    _render({**run, "lora": "low.safetensors", "expert": "low"}, since_start=False)
    _render({**run, "lora": "high.safetensors", "expert": "high"}, since_start=False)
    _render({**run, "lora": "one.safetensors"})
    out = " ".join(capsys.readouterr().out.split())
    assert "low.safetensors (diffusers: pipe.load_lora_weights(path, load_into_transformer_2=True))" in out
    assert "high.safetensors (diffusers: pipe.load_lora_weights(path))" in out
    assert "one.safetensors (diffusers: pipe.load_lora_weights(path))" in out
    assert out.count("since the command began") == 1  # an expert's run says its own time
