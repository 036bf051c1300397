"""memory.cuda_graphs: compiled blocks replayed as CUDA graphs train, validate, sample and resume as the same
compiled blocks without graphs do (a GPU test: the CPU neither compiles nor captures)."""

import json

import numpy as np
import pytest
from PIL import Image

from lorakit.plan.resolve import resolve
from lorakit.train.loop import run
from tests.unit.train.test_loop import losses, make_cfg


def _cfg(tmp_path, tiny, graphs: bool):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=8, profile="datacenter", lora={"dropout": 0.0},
                   memory={"compile": True, "cuda_graphs": graphs, "attention": "math",
                           "gradient_checkpointing": False, "checkpoint_blocks": 0},
                   validation={"items": 1, "every": 4},
                   sampling={"enabled": True, "every": 4, "steps": 2, "prompts": ["a red circle"]})
    cfg.model.dtype = "bf16"
    data = tmp_path / "d"
    for p in [p for p in sorted(data.glob("item_00[02].*")) if p.suffix != ".txt"]:  # two of the four items wide: two aspect-ratio buckets
        Image.open(p).convert("RGB").resize((96, 48)).save(p)
    return cfg


def _samples(out):
    return {p.name: np.asarray(Image.open(p).convert("RGB"), dtype=np.float32)
            for p in sorted((out / "samples").rglob("*.png"))}


@pytest.mark.gpu
def test_cuda_graphs_train_validate_sample_and_resume_as_without(tmp_path, tiny):
    plain = run(resolve(_cfg(tmp_path / "a", tiny, False)))
    graphs = run(resolve(_cfg(tmp_path / "b", tiny, True)))
    assert plain["steps"] == graphs["steps"] == 8
    a, b = losses(plain["metrics"]), losses(graphs["metrics"])
    assert b == pytest.approx(a, rel=2e-2, abs=1e-3)
    val = [[json.loads(x)["val_loss"] for x in open(r["metrics"]) if "val_loss" in x] for r in (plain, graphs)]
    assert len(val[0]) == len(val[1]) >= 2 and val[1] == pytest.approx(val[0], rel=2e-2)
    sa, sb = _samples(tmp_path / "a" / "out"), _samples(tmp_path / "b" / "out")
    assert sa and sa.keys() == sb.keys()
    for k in sa:
        assert np.abs(sa[k] - sb[k]).mean() < 4.0, k  # of 255: the same pictures

    part = _cfg(tmp_path / "c", tiny, True)
    assert run(resolve(part), stop_at=4)["interrupted"]
    resumed = run(resolve(part), resume="latest")
    assert resumed["steps"] == 8
    assert losses(resumed["metrics"]) == pytest.approx(b, rel=1e-3, abs=1e-4)
