"""Turning a loaded transformer into what a run trains: partial gradient checkpointing."""

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


def test_a_compile_the_run_cannot_do_is_said_not_dropped():
    """The rtx4090/rtx5090 profiles compile by default; with block swapping (or FSDP) the blocks are not compiled,
    and the run says so."""
    from lorakit.config import resolve
    from lorakit.train.prepare import compile_decision

    cfg, _ = resolve(None, ["model.family=flux", "memory.blocks_to_swap=4"], profile="rtx4090")
    assert cfg.memory.compile is True
    assert "block swapping" in compile_decision(cfg, "cuda", False, object(), True)[1]
    assert "FSDP" in compile_decision(cfg, "cuda:1", True, None, True)[1]
    assert compile_decision(cfg, "cuda", False, None, True) == (True, None)
    assert compile_decision(cfg, "cpu", False, object(), True) == (False, None)  # the CPU never compiles: no news
    cfg, _ = resolve(None, ["model.family=flux", "memory.compile=false"], profile="rtx4090")
    assert compile_decision(cfg, "cuda", False, object(), True) == (False, None)


def test_cuda_graphs_need_compiled_blocks_that_do_not_recompute():
    """memory.cuda_graphs replays compiled blocks; without them, or while blocks recompute for checkpointing, the
    run says why it runs without graphs (the CPU compiles nothing and says nothing)."""
    from lorakit.config import resolve
    from lorakit.train.prepare import graphs_decision

    cfg, _ = resolve(None, ["model.family=flux", "memory.cuda_graphs=true"], profile="datacenter")
    assert graphs_decision(cfg, "cuda", True, 0) == (True, None)
    off, why = graphs_decision(cfg, "cuda", True, 12)
    assert not off and "12 of them recompute" in why
    assert graphs_decision(cfg, "cpu", False, 0) == (False, None)
    assert graphs_decision(cfg, "cuda", False, 0) == (False, None)  # compile asked for; compile_decision says why
    cfg, _ = resolve(None, ["model.family=flux", "memory.cuda_graphs=true", "memory.compile=false"],
                     profile="datacenter")
    off, why = graphs_decision(cfg, "cuda", False, 0)
    assert not off and "memory.compile: true" in why
    cfg, _ = resolve(None, ["model.family=flux", "memory.cuda_graphs=true", "schedule.grad_accum=4"],
                     profile="datacenter")
    off, why = graphs_decision(cfg, "cuda", True, 0)
    assert not off and "schedule.grad_accum=4" in why
    cfg, _ = resolve(None, ["model.family=flux"], profile="datacenter")
    assert graphs_decision(cfg, "cuda", True, 0) == (False, None)
