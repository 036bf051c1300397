"""Optional Weights & Biases logging: offline, without a network; a resumed run continues the same W&B run."""

import sys

import pytest

from lorakit.plan.resolve import resolve
from lorakit.train.loop import run
from tests.unit.train.test_loop import make_cfg


@pytest.mark.slow
def test_offline_wandb_gets_the_metrics_the_samples_and_the_summary(tmp_path, tiny, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=3, sampling={"steps": 2},
                   logging={"wandb": True, "wandb_mode": "offline", "wandb_project": "t"})
    res = run(resolve(cfg), stop_at=2)
    out = tmp_path / "out"
    first = (out / "wandb_id.txt").read_text()
    res = run(resolve(cfg), resume="latest")
    assert res["steps"] == 3 and not res["warnings"]
    assert (out / "wandb_id.txt").read_text() == first  # the resumed run continues the same W&B run
    runs = sorted((out / "wandb").glob(f"offline-run-*-{first}"))
    assert len(runs) == 2
    # offline runs are W&B's own record log (read by `wandb sync`); its protobuf strings are stored as they are.
    # W&B's service process writes them: on a loaded machine it can still be writing when finish() returns
    # (seen once in CI: the resumed run's log held only its header), so each check waits for it, up to a minute
    def log():
        return [next(r.glob("run-*.wandb")).read_bytes() for r in runs]

    def grids():
        return [sorted(p.name.split("_")[1] for p in (r / "files" / "media" / "images").glob("samples_*.png"))
                for r in runs]

    got = _settled(log, lambda lg: lg[0].count(b"train/loss") >= 2 and lg[1].count(b"train/loss") >= 1
                   and b'"steps"' in lg[1])
    assert got[0].count(b"train/loss") >= 2 and got[1].count(b"train/loss") >= 1  # steps 1-2, then 3
    assert b'"steps"' in got[1] and b"train/val_loss" not in got[1]
    assert _settled(grids, lambda g: g == [["0"], ["3"]]) == [["0"], ["3"]]  # the grids before training and at the end


def _settled(read, done, timeout: float = 60.0):
    """read() until done(value) or the timeout; the last value (the assertions then say what was wrong)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def test_wandb_asked_for_but_not_installed_is_an_environment_fault(tmp_path, tiny, monkeypatch):
    from lorakit.errors import EnvironmentFault

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2, logging={"wandb": True})
    with pytest.raises(EnvironmentFault, match="wandb is not installed"):
        run(resolve(cfg))
