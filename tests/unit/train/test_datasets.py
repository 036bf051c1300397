"""Several datasets: per-dataset weight and repeats, prior-preservation datasets mixed at data.prior_ratio with
their own loss weight."""

from collections import Counter

import pytest
import torch

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.data.demo import make_demo_dataset
from lorakit.errors import ConfigError
from lorakit.models.base import load_adapter
from lorakit.train.data import CachedData
from tests.unit.train.test_loop import make_cfg


def _two(tmp_path, tiny, **data):
    prior = make_demo_dataset(tmp_path / "prior", "flat", count=4, size=64, seed=5)
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2, data=data | {"datasets": [
        {"dir": str(prior), "role": "prior", "loss_weight": 0.5, "trigger": "a photo of a"}]})
    build(cfg, adapter=load_adapter("flux", tiny("flux")))
    st = Store(cache_dir_for(cfg))
    return cfg, st, st.read_manifest()


def test_prior_items_come_at_the_ratio_with_their_loss_weight(tmp_path, tiny):
    cfg, st, man = _two(tmp_path, tiny, prior_ratio=0.5)
    assert sorted(Counter(it["dataset"] for it in man["items"]).items()) == [(0, 4), (1, 4)]
    assert all(it["caption"].startswith("a photo of a ") for it in man["items"] if it["dataset"] == 1)
    data = CachedData(st, man, 1, 0, datasets=cfg.data.all_datasets(), prior_ratio=0.5)
    prior = {it["key"] for it in man["items"] if it["dataset"] == 1}
    seen = Counter()
    for e in range(400):
        for b in data.epoch(e):
            seen["prior" if b[0].split("#")[0] in prior else "train"] += 1
    assert seen["train"] == 400 * 4  # every training item once per epoch
    assert seen["prior"] / seen["train"] == pytest.approx(0.5, abs=0.03)  # half a prior visit per training one
    b = data.load(sorted(prior)[:1] + [it["key"] for it in man["items"] if it["dataset"] == 0][:1])
    assert b.weights.tolist() == [0.5, 1.0]


def test_dataset_weight_scales_its_visits(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2)
    raw = {"dir": str(cfg.data.dirs[0]), "weight": 2.5}
    cfg = make_cfg(tmp_path / "w", "flux", tiny("flux"), steps=2,
                   data={"dirs": [], "datasets": [raw], "repeats": 1})
    build(cfg, adapter=load_adapter("flux", tiny("flux")))
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0, datasets=cfg.data.all_datasets())
    per_epoch = [sum(len(b) for b in data.epoch(e)) for e in range(200)]
    assert set(per_epoch) <= {8, 9, 10, 11, 12} and sum(per_epoch) / 200 == pytest.approx(10, abs=0.4)


def test_weighted_items_weigh_their_loss(tmp_path, tiny):
    from lorakit.io.modules import load_component
    from lorakit.train.trainer import Trainer

    cfg, st, man = _two(tmp_path, tiny)
    data = CachedData(st, man, 1, 0, datasets=cfg.data.all_datasets())
    a = load_adapter("flux", tiny("flux"))
    tr = Trainer(cfg, a, load_component(tiny("flux") / "transformer"), data, tmp_path / "o", "cpu", torch.float32)
    key = next(it["key"] for it in man["items"] if it["dataset"] == 1)
    b = data.load([key])
    noise = torch.randn(b.latents.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weighted = float(tr.loss_on(b, torch.tensor([0.5]), noise))
        b.weights = None
        plain = float(tr.loss_on(b, torch.tensor([0.5]), noise))
    assert weighted == pytest.approx(0.5 * plain, rel=1e-6)


def test_dataset_settings_are_checked(tmp_path, tiny):
    with pytest.raises(ConfigError, match="prior_ratio is set but no dataset has role: prior"):
        make_cfg(tmp_path, "flux", tiny("flux"), data={"prior_ratio": 1.0})
    from lorakit.config import check_paths

    cfg = make_cfg(tmp_path, "flux", tiny("flux"), data={"datasets": [{"dir": str(tmp_path / "none")}]})
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].dir: no such folder"):
        check_paths(cfg, data=True)
