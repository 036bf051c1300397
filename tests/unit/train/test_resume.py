"""What a resume may continue, said before anything loads: the checkpoint `--resume` names (auto for a scheduler's
first start and its requeues), a LoRA of the same shape, the same learning-rate schedule."""

import json

import pytest

from lorakit.errors import InputError
from lorakit.plan.resolve import resolve
from lorakit.train.loop import run
from tests.unit.train.test_loop import make_cfg


def _lrs(path):
    return {r["step"]: r["lr"] for r in map(json.loads, open(path))}


def _cfg(tmp_path, tiny, **over):
    return make_cfg(tmp_path, "flux", tiny("flux"), steps=8, sampling={"enabled": False},
                    output={"dir": str(tmp_path / "out"), "save_every": 2, "keep_last": 4}, **over)


@pytest.mark.slow
def test_resume_auto_starts_fresh_then_continues_and_finds_the_final_checkpoint(tmp_path, tiny):
    cfg = _cfg(tmp_path, tiny)
    from lorakit.events import Events

    heard = []
    events = Events()
    events.info = heard.append
    first = run(resolve(cfg), resume="auto", stop_at=4, events=events)  # nothing there: a fresh start, said
    assert first["steps"] == 4 and any("--resume auto: no checkpoint" in m for m in heard)
    assert not any("--resume auto" in w for w in first["warnings"])  # information, not a warning
    second = run(resolve(cfg), resume="auto")
    assert second["steps"] == 8 and not second["interrupted"]
    rows = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 9))  # no step lost or repeated
    cfg_c = _cfg(tmp_path / "c", tiny, schedule={"steps": 8, "lr_schedule": "constant", "warmup_steps": 2})
    run(resolve(cfg_c))
    more = cfg_c.model_copy(update={"schedule": cfg_c.schedule.model_copy(update={"steps": 10})})
    res = run(resolve(more), resume="auto")  # finished at 8 (checkpoints/final), continued to 10
    assert res["steps"] == 10
    assert "schedule: steps 8 -> 10; the learning rate continues unchanged" in res["resumed"]["note"]


def test_resume_latest_or_a_missing_folder_is_refused_before_anything_is_built(tmp_path, tiny):
    cfg = _cfg(tmp_path, tiny)
    with pytest.raises(InputError, match="--resume latest: no intact checkpoint in .*use --resume auto"):
        run(resolve(cfg), resume="latest")
    with pytest.raises(InputError, match="--resume /nonexistent: no such checkpoint folder"):
        run(resolve(cfg), resume="/nonexistent")
    assert not (tmp_path / "out" / "cache").exists()  # refused before the cache was built


def test_a_lora_of_another_rank_is_named_with_both_shapes(tmp_path, tiny):
    cfg = _cfg(tmp_path, tiny)
    run(resolve(cfg), stop_at=2)
    other = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 4})})
    with pytest.raises(InputError, match=r"holds a LoRA of another shape: .* is \[16, \d+\] there, \[4, \d+\] in this "
                                         r"run \(rank 16 against rank 4\)") as e:
        run(resolve(other), resume="latest")
    assert "lora.rank" in e.value.hint


def test_a_changed_schedule_is_refused_by_name_unless_the_new_one_is_asked_for(tmp_path, tiny):
    cfg = _cfg(tmp_path, tiny)  # cosine over 8 steps
    run(resolve(cfg), stop_at=4)
    shorter = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"steps": 6})})
    with pytest.raises(InputError, match=r"another learning-rate schedule \(steps 8 -> 6\): resuming would move the "
                                         r"learning rate at step 4"):
        run(resolve(shorter), resume="latest")
    asked = shorter.model_copy(update={"schedule": shorter.schedule.model_copy(update={"reschedule_on_resume": True})})
    res = run(resolve(asked), resume="latest")
    assert res["steps"] == 6 and "follows the new schedule from step 4" in res["resumed"]["note"]
    lr = _lrs(tmp_path / "out" / "metrics.jsonl")
    from lorakit.train.optim import lr_lambda

    f = lr_lambda(asked)
    assert lr[5] == pytest.approx(5e-3 * f(5)) and lr[6] == pytest.approx(5e-3 * f(6))


@pytest.mark.slow
def test_a_new_run_into_an_earlier_runs_folder_is_refused_unless_forced(tmp_path, tiny):
    """A new run there used to start over silently: metrics truncated, some checkpoints overwritten, the old LoRA and
    higher checkpoints kept — and a later `--resume auto` continued the old run's highest step."""
    import yaml
    from typer.testing import CliRunner

    from lorakit.cli.app import app

    cfg = _cfg(tmp_path, tiny, schedule={"steps": 4})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    cli = CliRunner()
    assert cli.invoke(app, ["train", str(path)]).exit_code == 0
    out = tmp_path / "out"
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    for extra in ([], ["--dry-run"]):  # the dry run says what the run would say
        r = cli.invoke(app, ["train", str(path), "--set", "schedule.steps=2", *extra])
        assert r.exit_code == 2 and "holds a finished run" in r.output and "--force" in r.output, r.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # untouched
    r = cli.invoke(app, ["train", str(path), "--set", "schedule.steps=2", "--force"])
    assert r.exit_code == 0, r.output
    assert "--force: output.dir" in r.output and "removed, starting over" in r.output
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl") if "loss" in json.loads(x)]
    assert steps == [1, 2]  # only the new run's
    assert "step-000004" not in {p.name for p in (out / "checkpoints").iterdir()}  # the old run's are gone
    r = cli.invoke(app, ["train", str(path), "--set", "schedule.steps=2", "--resume", "auto", "--dry-run"])
    assert r.exit_code == 0, r.output  # resuming is what a scheduler's requeue does: not refused
