"""A full fine-tune's background (asynchronous) save: it holds the weights of its own step while training goes on,
and the update that changes them waits for its copy (train/checkpoint.py, train/shards.py)."""

import time

import torch

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.convert.checkpoint import export_checkpoint
from lorakit.io import load
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train import checkpoint, shards
from lorakit.train.data import CachedData
from lorakit.train.trainer import Trainer
from tests.unit.train.test_loop import make_cfg


def _trainer(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=6, method="full", lora={"dropout": 0.0},
                   sampling={"enabled": False})
    build(cfg, adapter=load_adapter("flux", tiny("flux")))
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, cfg.seed)
    return Trainer(cfg, load_adapter("flux", tiny("flux")), load_component(tiny("flux") / "transformer"), data,
                   tmp_path / "o", "cpu", torch.float32)


def test_a_background_save_holds_its_steps_weights_while_the_next_update_waits_for_the_copy(tmp_path, tiny,
                                                                                           monkeypatch):
    made = []

    def slow_stager(cuda):  # lorakit's stager, its copy held back 0.5 s: an update that did not wait would race it
        st = real(cuda)
        stage = st._stage

        def late(sd, **kw):
            time.sleep(0.5)
            return stage(sd, **kw)

        st._stage = late
        made.append(st)
        return st

    real = shards.Stager
    monkeypatch.setattr(shards, "Stager", slow_stager)
    tr = _trainer(tmp_path, tiny)
    tr.train_step()
    then = {k: v.detach().clone() for k, v in tr.transformer.state_dict().items()}
    t = time.perf_counter()
    ck = tr.save(background=True)
    assert time.perf_counter() - t < 0.4  # the call returns before the copy is taken
    assert tr.pending is not None and tr.pending.staged is not None
    tr.train_step()  # its update waits for the copy
    checkpoint.wait(tr)
    assert (ck / "state.pt").is_file()
    export_checkpoint(ck, tmp_path / "exported")
    saved = load(tmp_path / "exported")
    assert saved.keys() == then.keys()
    assert all(torch.equal(saved[k], then[k]) for k in saved)  # step 1's weights, not step 2's
    now = tr.transformer.state_dict()
    assert any(not torch.equal(now[k], then[k]) for k in then)  # and step 2 did change them
    assert tr.staging_wait_s > 0.2
    # a second background save reuses the stager (its buffers); the run's end frees it
    tr.save(background=True)
    assert len(made) == 1
    checkpoint.release(tr)
    assert tr.pending is None and getattr(tr, "_stager", None) is None


def test_without_torchs_state_dict_stager_a_background_save_copies_inside_the_call(tmp_path, tiny, monkeypatch):
    def missing(cuda):  # an older torch
        raise ImportError("cannot import name 'StateDictStager'")

    monkeypatch.setattr(shards, "Stager", missing)
    tr = _trainer(tmp_path, tiny)
    tr.train_step()
    then = {k: v.detach().clone() for k, v in tr.transformer.state_dict().items()}
    ck = tr.save(background=True)
    assert tr.pending is not None and tr.pending.staged is None  # nothing left for the update to wait for
    tr.train_step()
    checkpoint.release(tr)
    export_checkpoint(ck, tmp_path / "exported")
    saved = load(tmp_path / "exported")
    assert all(torch.equal(saved[k], then[k]) for k in saved)

