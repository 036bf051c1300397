"""Turning a loaded transformer into what a run trains: partial gradient checkpointing."""

import pytest
import torch

from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train.prepare import checkpoint_blocks
from lorakit.train.swap import repeated_blocks


def test_only_the_first_n_blocks_recompute_and_the_gradients_are_the_same(tiny, monkeypatch):
    family = "flux"
    folder = tiny(family)
    adapter = load_adapter(family, folder, dtype=torch.float32)
    batch = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                                   torch.Generator().manual_seed(0))
    recomputed = []
    stock = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kw):
        recomputed.append(fn.__self__)
        return stock(fn, *args, **kw)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    grads = {}
    for n in (None, 1, 0):
        tr = load_component(folder / "transformer", "cpu", torch.float32).train()
        tr.x_embedder.weight.requires_grad_(True)  # a parameter before every block: gradients flow through all
        blocks = repeated_blocks(tr)
        assert len(blocks) > 1
        assert checkpoint_blocks(tr, n) == (len(blocks) if n is None else n)
        recomputed.clear()
        x = batch.latents.clone()
        v = adapter.predict(tr, x, torch.tensor([0.6]), batch.text)
        v.square().mean().backward()
        assert recomputed == (blocks if n is None else blocks[:n])
        grads[n] = tr.x_embedder.weight.grad
    torch.testing.assert_close(grads[1], grads[None], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[0], grads[None], rtol=1e-5, atol=1e-7)


def test_the_preparation_says_what_each_part_took(tiny):
    from lorakit.dist import Dist
    from lorakit.plan.resolve import resolve
    from lorakit.train.prepare import prepare

    folder = tiny("flux")
    cfg = resolve({"profile": "cpu", "model": {"family": "flux", "path": str(folder)},
                   "memory": {"base_quant": "fp8", "gradient_checkpointing": True}}, paths=()).cfg
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    p = prepare(cfg, adapter, load_component(folder / "transformer"), "cpu", torch.float32, Dist())
    assert list(p.took) == ["8-bit base", "the rest placed", "LoRA", "checkpointing, trained weights"]
    assert all(isinstance(v, float) and v >= 0 for v in p.took.values()) and p.quantized > 0


def _sharded_steps(rank, world, store, folder, out):
    """One rank: the tiny FLUX transformer under FSDP2 (gloo), its blocks uncompiled, then compiled; rank 0 saves
    the losses, a gathered gradient and how many graphs torch made."""
    import torch.distributed as td

    from lorakit.train.prepare import compile_sharded, fully_shard

    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        adapter = load_adapter("flux", folder, dtype=torch.float32)
        batch = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                                       torch.Generator().manual_seed(0))
        got = {}
        for compiled in (False, True):
            tr = load_component(folder / "transformer", "cpu", torch.float32).train().requires_grad_(True)
            fully_shard(tr, "cpu", keep=1 if compiled else 0)  # compiled: the last block also stays gathered
            blocks = compile_sharded(tr, {"backend": "aot_eager"}) if compiled else 0
            kept = [b._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None for b in repeated_blocks(tr)]
            torch._dynamo.utils.counters.clear()
            for _ in range(2):  # the second pass: each block's graph found again
                v = adapter.predict(tr, batch.latents.clone(), torch.tensor([0.6]), batch.text)
                v.square().mean().backward()
            got[compiled] = {"loss": v.square().mean().detach(), "blocks": blocks,
                             "grad": tr.single_transformer_blocks[1].proj_out.weight.grad.full_tensor(),
                             "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "kept": kept}
        if rank == 0:
            torch.save(got, out)
        td.barrier()  # both ranks done talking before either leaves: gloo aborts a rank whose peer left mid-way
    finally:
        td.destroy_process_group()


@pytest.mark.slow
def test_under_fsdp_each_block_compiles_once_per_kind_and_trains_as_uncompiled(tiny, tmp_path):
    """FSDP2 renames a block's class (FSDP<class>); the blocks are still found, compiled around FSDP's hooks, and
    a block kind's graph serves all its blocks (tiny FLUX: one double block, two single ones -> two graphs); the
    last block kept gathered from forward to backward trains the same."""
    import torch.multiprocessing as mp

    out = tmp_path / "got.pt"
    mp.spawn(_sharded_steps, args=(2, tmp_path / "store", tiny("flux"), out), nprocs=2)
    got = torch.load(out, weights_only=True)
    assert got[True]["blocks"] == 3
    assert got[True]["kept"] == [False, False, True] and got[False]["kept"] == [False] * 3  # memory.gathered_blocks
    assert got[True]["graphs"] == 2 and got[False]["graphs"] == 0
    torch.testing.assert_close(got[True]["loss"], got[False]["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True]["grad"], got[False]["grad"], rtol=1e-4, atol=1e-6)
