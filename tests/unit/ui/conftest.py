"""Run folders as `lorakit train` leaves them: finished, interrupted (SIGINT after two steps), running (a process
holds the folder lock), failed (nothing saved) — built once per module from the tiny FLUX pipeline."""

from __future__ import annotations

import json
import shutil

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


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny):
    """root/{done, team/stopped, broken}: a finished run; one stopped after its step-2 checkpoint (no final: what a
    kill leaves, `--resume latest` continues it); one whose config exists but that never saved anything. Built in
    this process (the CLI's own command), once per test worker."""
    from typer.testing import CliRunner

    from lorakit.cli.app import app

    root = tmp_path_factory.mktemp("runs")
    work = tmp_path_factory.mktemp("work")
    cli = CliRunner()
    r = cli.invoke(app, ["train", str(run_yaml(work, tiny, root / "done")), "--json"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(app, ["train", str(run_yaml(work, tiny, root / "team" / "stopped", steps=3,
                                               sampling={"enabled": False})), "--json"])
    assert r.exit_code == 0, r.output
    shutil.rmtree(root / "team" / "stopped" / "checkpoints" / "final")
    broken = root / "broken"
    (broken / "checkpoints").mkdir(parents=True)
    (broken / "config.resolved.yaml").write_text((root / "done" / "config.resolved.yaml").read_text())
    (broken / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.5, "s_per_step": 30.0}) + "\n"  # compiling
                                          + json.dumps({"step": 2, "loss": 1.4, "s_per_step": 0.1}) + "\n")
    return root
