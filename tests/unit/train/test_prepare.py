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
