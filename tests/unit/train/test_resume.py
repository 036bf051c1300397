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


def test_resume_auto_starts_fresh_then_continues_and_finds_the_final_checkpoint(tmp_path, tiny):
    cfg = _cfg(tmp_path, tiny)
    first = run(resolve(cfg), resume="auto", stop_at=4)  # nothing there: a fresh start, said
    assert first["steps"] == 4 and any("--resume auto: no checkpoint" in w for w in first["warnings"])
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
