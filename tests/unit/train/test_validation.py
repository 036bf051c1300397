"""The best checkpoint by held-out loss, and early stopping (validation.best / validation.patience)."""

import json

import pytest

from lorakit.io import read_header
from lorakit.plan.resolve import resolve
from lorakit.train.checkpoint import read_state
from lorakit.train.loop import run
from lorakit.train.validation import Best
from tests.unit.train.test_loop import make_cfg

# lr 2e-2 on the tiny FLUX: the held-out item's loss falls, then rises as the three training items are overfit
OVERFIT = dict(steps=20, optim={"lr": 2e-2}, schedule={"lr_schedule": "constant", "warmup_steps": 0},
               validation={"items": 1, "every": 1})


def _val(metrics) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in open(metrics)]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


@pytest.mark.slow
def test_the_best_step_is_where_the_held_out_loss_was_lowest(tmp_path, tiny):
    res = run(resolve(make_cfg(tmp_path / "a", "flux", tiny("flux"), sampling={"enabled": False}, **OVERFIT)))
    val = _val(res["metrics"])
    k, low = min(val, key=lambda x: x[1])
    assert k <= 16 and all(v > low for s, v in val if s > k)  # the run overfits after step k
    best = tmp_path / "a" / "out" / "checkpoints" / "best"
    assert res["best"]["step"] == k and f"at step {k}" in res["best"]["why"]
    assert read_state(best / "state.pt")["step"] == k
    assert read_header(best / "lora.safetensors").metadata["lorakit_step"] == str(k)
    assert res["steps"] == 20  # no patience: the run goes on, and its LoRA is the last step's
    assert read_header(res["lora"]).metadata["lorakit_step"] == "20"

    # patience 3: stops three checks after k, and the LoRA is step k's; its samples are written beside
    res2 = run(resolve(make_cfg(tmp_path / "b", "flux", tiny("flux"), sampling={"steps": 2},
                        **{**OVERFIT, "validation": {"items": 1, "every": 1, "patience": 3}})))
    assert res2["steps"] == k + 3 and not res2["interrupted"]
    assert res2["early_stopped"]["at_step"] == k + 3 and res2["best"]["step"] == k
    best2 = tmp_path / "b" / "out" / "checkpoints" / "best" / "lora.safetensors"
    assert open(res2["lora"], "rb").read() == best2.read_bytes()
    assert res2["best"]["samples"].endswith(f"best-step-{k:06d}.png")
    from lorakit.cli.common import console
    from lorakit.cli.train import _render

    with console.capture() as cap:  # what `lorakit train` prints says which step won and why it stopped
        _render(res2)
    text = " ".join(cap.get().split())
    assert f"stopped early at step {k + 3}" in text and f"best: step {k} (lowest val_loss of" in text


def test_best_counts_checks_without_improvement():
    b = Best(patience=2, min_delta=0.01)
    assert b.offer(1, 1.0) and not b.stop
    assert not b.offer(2, 0.995)  # within min_delta: not a new best
    assert not b.stop
    assert not b.offer(3, 1.2) and b.stop
    assert b.report()["step"] == 1 and "+20.0 %" in b.report()["why"]
    again = Best(patience=2)
    again.load(b.state())
    assert again.state() == b.state() and again.stop


def test_patience_needs_held_out_items(tmp_path, tiny):
    from lorakit.errors import ConfigError

    with pytest.raises(ConfigError, match="validation.patience needs held-out items"):
        make_cfg(tmp_path, "flux", tiny("flux"), validation={"patience": 2})


def test_the_loss_curve_draws_val_loss_where_it_was_measured(tmp_path):
    import json

    from PIL import Image

    from lorakit.train.report import loss_curve

    rows = [{"step": s, "loss": 1.0 - s / 100} for s in range(1, 41)]
    for r in rows[9::10]:
        r["val_loss"] = 1.2 - r["step"] / 200
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    img = Image.open(loss_curve(m, tmp_path / "curve.png")).convert("RGB")
    orange = sum(1 for p in img.getdata() if p == (230, 120, 20))
    assert orange > 50  # the val_loss points and the line joining them
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "val_loss"}) + "\n" for r in rows))
    assert sum(1 for p in Image.open(loss_curve(plain, tmp_path / "p.png")).convert("RGB").getdata()
               if p == (230, 120, 20)) == 0


def test_the_runs_loss_is_said_one_way_wherever_it_is_said():
    """The loss curve's title and the demo's line used to give two different final losses (one raw, one smoothed)."""
    from lorakit.train.report import loss_summary, window

    losses = [2.0] + [1.0] * 38 + [3.0]
    assert window(len(losses)) == 2
    assert loss_summary(losses) == "loss 2.0000 at step 1 -> 2.0000 (mean of the last 2 steps)"
    assert loss_summary([1.5, 1.25], 7) == "loss 1.5000 at step 7 -> 1.2500 at the last step"
