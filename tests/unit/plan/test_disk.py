"""A full fine-tune's checkpoints and export must fit on the output folder's disk: refused before anything loads."""

import pytest
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.config import dump_yaml
from lorakit.errors import EnvironmentFault
from lorakit.plan import disk
from lorakit.plan.resolve import resolve
from lorakit.train.loop import run
from tests.unit.plan.test_memory import FLUX, cfg_for, fake_model
from tests.unit.train.test_loop import make_cfg

GB = 1e9


def _flux_full(tmp_path, **output):
    model = fake_model(tmp_path, FLUX, int(23.8e9))  # FLUX.1-dev's transformer: 11.9 B parameters in bf16
    cfg = cfg_for(model, "flux", "datacenter", 1024)
    return cfg.model_copy(update={"method": "full", "output": cfg.output.model_copy(update=output),
                                  "schedule": cfg.schedule.model_copy(update={"steps": 1000})})


def test_the_peak_counts_the_kept_checkpoints_one_more_being_written_the_final_and_the_export(tmp_path):
    cfg = _flux_full(tmp_path, save_every=300, keep_last=3)  # 1000 steps: final/ is a checkpoint of its own
    n = disk.need(cfg, 11.9e9)
    assert n["checkpoint"] == pytest.approx(11.9e9 * 6)  # bf16 weights and lorakit's bf16 moments: 71.4 GB
    assert n["at_once"] == 4 and n["total"] == pytest.approx(4 * 71.4 * GB + 23.8 * GB)
    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"save_every": 100})})  # step 1000 saved:
    n = disk.need(cfg, 11.9e9)
    assert n["at_once"] == 4 and n["total"] == pytest.approx(4 * 71.4 * GB)  # final/ is links to its files
    only_final = disk.need(cfg.model_copy(update={"output": cfg.output.model_copy(update={"save_every": 0})}), 11.9e9)
    assert only_final["total"] == pytest.approx(71.4 * GB + 23.8 * GB)
    factored = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"name": "adafactor"})})
    assert disk.need(factored, 11.9e9)["checkpoint"] == pytest.approx(23.8 * GB)  # the weights alone
    resumed = disk.need(cfg, 11.9e9, existing=3)  # three already on the disk: one more at a time
    assert resumed["total"] == pytest.approx(71.4 * GB)


def test_a_full_fine_tune_that_cannot_fit_is_refused_naming_the_folder_the_need_and_what_fits(tmp_path, monkeypatch):
    cfg = _flux_full(tmp_path, save_every=100, keep_last=3, dir=str(tmp_path / "out"))
    monkeypatch.setattr(disk, "free_bytes", lambda p: 128 * GB)  # a 128 GB disk
    with pytest.raises(EnvironmentFault) as e:
        disk.check(cfg, tmp_path / "out")
    msg = str(e.value)
    assert str(tmp_path / "out") in msg and "286 GB" in msg and "128 GB free" in msg
    assert "output.keep_last=1 (143 GB)" in e.value.hint and "output.save_every=0 (95 GB, fits)" in e.value.hint
    monkeypatch.setattr(disk, "free_bytes", lambda p: 400 * GB)
    assert disk.check(cfg, tmp_path / "out")["total"] < 400 * GB
    lora = cfg.model_copy(update={"method": "lora"})
    monkeypatch.setattr(disk, "free_bytes", lambda p: 1)
    assert disk.check(lora, tmp_path / "out") is None  # a LoRA's checkpoints are megabytes


def test_dry_run_and_the_run_itself_refuse_before_any_weights_load(tmp_path, tiny, monkeypatch):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=4, method="full")
    path = tmp_path / "full.yaml"
    path.write_text(dump_yaml(cfg))
    ok = CliRunner().invoke(app, ["train", str(path), "--dry-run"])  # room: said in the plan
    assert ok.exit_code == 0 and "checkpoints and export take about" in ok.output.replace("\n", " "), ok.output
    monkeypatch.setattr(disk, "free_bytes", lambda p: 1000)
    r = CliRunner().invoke(app, ["train", str(path), "--dry-run"])
    assert r.exit_code == 1 and "checkpoints need about" in r.output and str(cfg.output.dir) in r.output.replace("\n", ""), r.output
    with pytest.raises(EnvironmentFault, match="checkpoints need about"):
        run(resolve(cfg))
    assert not (tmp_path / "out" / "checkpoints").exists()
