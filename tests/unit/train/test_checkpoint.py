"""A full fine-tune's background (asynchronous) save: it holds the weights of its own step while training goes on,
and the update that changes them waits for its copy (train/checkpoint.py, train/shards.py)."""

import json
import threading
import time
from pathlib import Path

import pytest
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
    made, update_began = [], threading.Event()

    def slow_stager(cuda):  # lorakit's stager, its copy held back until the next update has begun: an update that
        st = real(cuda)     # did not wait for it would change the weights before they are copied
        stage = st._stage

        def late(sd, *a, **kw):
            update_began.wait(60)
            time.sleep(0.3)
            return stage(sd, *a, **kw)

        st._stage = late
        made.append(st)
        return st

    def staged(tr):
        if tr.pending is not None:  # an update after the background save
            update_began.set()
        real_staged(tr)

    real, real_staged = shards.Stager, shards.staged
    monkeypatch.setattr(shards, "Stager", slow_stager)
    monkeypatch.setattr(shards, "staged", staged)
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
    update_began.set()  # the stager's later copies go ahead at once
    # a second background save reuses the stager (its buffers); the run's end frees it
    tr.save(background=True)
    assert len(made) == 1
    checkpoint.release(tr)
    assert tr.pending is None and getattr(tr, "_stager", None) is None


def test_where_dcp_takes_no_stager_a_background_save_copies_inside_the_call(tmp_path, tiny, monkeypatch):
    def missing(cuda):  # an older torch
        raise ImportError("this torch's torch.distributed.checkpoint.async_save takes no stager")

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


def test_the_stager_copies_dtensor_shards_into_buffers_it_keeps_and_takes_each_saves_own_values(tmp_path):
    """A copy of each local shard into host buffers made at the first save: a second save reuses them (same
    storage), holds that save's values (tensors and the rest), never the live tensors; a state of another make-up
    gets new ones."""
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    td.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.randn(13, 8), mesh, [Shard(0)])
        m = distribute_tensor(torch.randn(13, 8), mesh, [Shard(0)])
        state = {"model": {"w": w}, "optim": {"state": {"w": {"exp_avg": m, "step": torch.tensor(1.0)}},
                                              "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
        st = shards.Stager(False)
        first = st.stage(state).result()
        got = first["model"]["w"]
        assert isinstance(got, DTensor) and got.placements == w.placements and got.shape == w.shape
        assert torch.equal(got.to_local(), w.to_local()) and got.to_local().data_ptr() != w.to_local().data_ptr()
        ptr = got.to_local().data_ptr()
        moment = first["optim"]["state"]["w"]["exp_avg"].to_local()  # packed into one chunk of the arena, each
        chunk = st.arena.chunks[0]  # with a storage of its own bytes alone (DCP would clone a view of the chunk)
        for buf in (got.to_local(), moment):
            assert chunk.data_ptr() <= buf.data_ptr() < chunk.data_ptr() + chunk.numel()
            assert buf.untyped_storage().size() == buf.nbytes
        assert st.arena.copied == 2 * 13 * 8 * 4 + 4 and len(st.arena.chunks) <= 2  # sized by what it holds
        w.to_local().add_(1.0)  # the run goes on: the staged copy keeps its save's values
        assert not torch.equal(first["model"]["w"].to_local(), w.to_local())
        state["optim"]["param_groups"][0]["lr"] = 0.05
        state["optim"]["state"]["w"]["step"] = torch.tensor(2.0)
        second = st.stage(state).result()
        assert second["model"]["w"].to_local().data_ptr() == ptr  # the same buffer, refilled
        assert torch.equal(second["model"]["w"].to_local(), w.to_local())
        assert second["optim"]["param_groups"][0]["lr"] == 0.05 and second["optim"]["state"]["w"]["step"] == 2.0
        state["model"]["w2"] = distribute_tensor(torch.randn(3), mesh, [Shard(0)])  # another make-up
        third = st.stage(state).result()
        assert torch.equal(third["model"]["w2"].to_local(), state["model"]["w2"].to_local())
        st.close()
    finally:
        td.destroy_process_group()


@pytest.mark.gpu
def test_the_stager_keeps_a_gpu_states_copy_in_pinned_host_memory(tmp_path):
    """The staged state's DTensors hold their pinned host buffers, on the GPU's mesh, and nothing is copied back to
    a GPU: DTensor.from_local made a GPU copy of the whole state (on cuda:0, from every rank's staging thread), out
    of memory on 2x H100 (2026-11-27). The copy waits for the update queued on the run's stream."""
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    td.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        w = distribute_tensor(torch.zeros(4096, 4096, device="cuda"), mesh, [Shard(0)])  # 64 MiB
        state = {"model": {"w": w}, "optim": {"state": {"w": {"step": torch.tensor(1.0)}}}}
        st = shards.Stager(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda._sleep(200_000_000)  # the run's stream still busy when the save is asked ...
        w.to_local().add_(1.0)  # ... with the update the save must see
        staged = st.stage(state).result()
        got = staged["model"]["w"]
        assert isinstance(got, DTensor) and got.device_mesh == mesh and got.placements == w.placements
        assert got.to_local().device.type == "cpu" and got.to_local().is_pinned()
        assert torch.cuda.memory_allocated() - before < 2**20  # no GPU copy of the state
        assert bool((got.to_local() == 1.0).all())  # the values after the queued update
        st.close()
    finally:
        td.destroy_process_group()


def _files(folder):
    return {p.relative_to(folder): p.stat() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_full_fine_tune_ending_on_a_saved_step_links_final_to_it_and_a_stop_there_keeps_it(tmp_path, tiny):
    # the last step's step checkpoint is the run's checkpoint: final/ is hard links to its files (its state is not
    # written a second time: 22 GB, 18.7 s for FLUX.2 [klein] 4B on 2x H100), and resumes and exports alike
    from lorakit.plan.resolve import resolve
    from lorakit.train.loop import run

    kw = {"lora": {"dropout": 0.0}, "sampling": {"enabled": False}, "method": "full"}
    res = run(resolve(make_cfg(tmp_path / "a", "flux", tiny("flux"), steps=4, output={"save_every": 2}, **kw)))
    cks = tmp_path / "a" / "out" / "checkpoints"
    step, final = _files(cks / "step-000004"), _files(cks / "final")
    assert res["checkpoint"] == str(cks / "final") and step.keys() == final.keys()
    assert {"state.pt", "config.json", "dcp/.metadata"} <= {str(k) for k in step}
    assert all(final[k].st_ino == step[k].st_ino and final[k].st_nlink == 2 for k in step)
    assert checkpoint.check_intact(cks / "final", full=True) is None
    said = (tmp_path / "a" / "out" / "phases.jsonl").read_text()
    assert "final/ linked to step-000004's files" in said
    assert checkpoint.latest(tmp_path / "a" / "out", full=True)[0] == cks / "final"
    exported = load(tmp_path / "a" / "out" / "lora-transformer")
    export_checkpoint(cks / "final", tmp_path / "x")
    again = load(tmp_path / "x")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)
    # a stop right after a step checkpoint: that checkpoint is the one the run names, not written again
    b = make_cfg(tmp_path / "b", "flux", tiny("flux"), steps=4, output={"save_every": 2}, **kw)
    res = run(resolve(b), stop_at=2)
    ck = tmp_path / "b" / "out" / "checkpoints" / "step-000002"
    assert res["interrupted"] and res["checkpoint"] == str(ck) and not (ck.parent / "final").exists()
    assert all(st.st_nlink == 1 for st in _files(ck).values())
    said = [json.loads(x) for x in (tmp_path / "b" / "out" / "phases.jsonl").read_text().splitlines()]
    ends = [x for x in said if x["event"] == "end" and x["name"] == "checkpoint (step 2)"]
    assert len(ends) == 2 and ends[1]["facts"]["of_which"].startswith("step-000002's save completed")
    # a LoRA run writes its final files whole, apart from the step's
    c = run(resolve(make_cfg(tmp_path / "c", "flux", tiny("flux"), steps=2, output={"save_every": 2},
                             sampling={"enabled": False})))
    lora = _files(Path(c["checkpoint"]))
    assert Path(c["checkpoint"]).name == "final" and all(st.st_nlink == 1 for st in lora.values())
