"""Block swapping: swapped blocks' weights rest on the host, visit the device only while their block runs, and
training gives the same losses as without swapping."""

import math

import pytest
import torch

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train.data import CachedData
from lorakit.train.swap import BlockSwapper, repeated_blocks
from lorakit.train.trainer import Trainer
from tests.unit.train.test_loop import make_cfg


def _trainer(tmp_path, tiny, family, device, **memory):
    cfg = make_cfg(tmp_path, family, tiny(family), steps=4, lora={"dropout": 0.0}, sampling={"enabled": False},
                   memory=memory)
    a = load_adapter(family, tiny(family))
    build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0)
    torch.manual_seed(0)
    return Trainer(cfg, a, load_component(tiny(family) / "transformer"), data, tmp_path / "o", device,
                   torch.float32)


def test_swapper_moves_weights_only_for_the_visit():
    # on the CPU a visit is a copy: the block computes with a visiting copy, not the resting host tensors
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            seen.append((self.lin.weight.data_ptr(), self.scale.data_ptr()))
            return self.lin(x) * self.scale

    class Model(torch.nn.Module):
        _repeated_blocks = ["Block"]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])

    seen = []
    m = Model()
    x = torch.randn(2, 4)
    want = x
    for blk in m.blocks:
        want = blk(want)
    seen.clear()
    sw = BlockSwapper(m, 2, "cpu", pin=False)
    sw.place_rest(m)
    resting = {i: (m.blocks[i].lin.weight.data_ptr(), m.blocks[i].scale.data_ptr()) for i in (2, 3)}
    y = x
    for blk in m.blocks:
        y = blk(y)
    torch.testing.assert_close(y, want)  # same weights, same result
    for i in (2, 3):
        assert seen[i][0] != resting[i][0] and seen[i][1] != resting[i][1]  # computed with the visiting copies
        assert (m.blocks[i].lin.weight.data_ptr(), m.blocks[i].scale.data_ptr()) == resting[i]  # back at rest
    assert not sw.ready  # nothing left in flight
    assert sw.said() == "2 blocks in host memory" and not sw.pinned and sw.arena.reserved == 0
    # on a GPU whose host had room for part of them: both amounts said
    sw.cuda, sw.arena.pin, sw.arena.alone, sw.arena.pageable = True, True, 3 * 2**30, 2**30
    assert sw.said() == ("2 blocks in page-locked host memory (3.0 GiB) and pageable (1.0 GiB: the host had no room "
                         "to page-lock more; slower visits)") and not sw.pinned
    with pytest.raises(Exception, match="at most 3"):
        BlockSwapper(Model(), 4, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_swapping_blocks_gives_the_same_losses(tmp_path, tiny, family):
    plain = _trainer(tmp_path / "a", tiny, family, "cpu", gradient_checkpointing=True)
    swapped = _trainer(tmp_path / "b", tiny, family, "cpu", blocks_to_swap=1)
    assert swapped.swapper is not None and len(swapped.swapper.blocks) == 1
    assert len(repeated_blocks(swapped.transformer)) >= 2
    a = [plain.train_step() for _ in range(4)]
    b = [swapped.train_step() for _ in range(4)]
    assert all(math.isfinite(x) for x in b)
    sw = swapped.swapper  # between steps every swapped weight rests in its host copy
    assert all(getattr(m, n).data_ptr() == h.data_ptr() for es in sw.host.values() for m, _, n, h in es)
    assert not sw.visiting and not sw.ready
    assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


@pytest.mark.gpu
def test_swapping_on_the_gpu_keeps_the_losses_and_the_weights_at_rest(tmp_path, tiny):
    plain = _trainer(tmp_path / "a", tiny, "flux", "cuda", gradient_checkpointing=True)
    a = [plain.train_step() for _ in range(3)]
    swapped = _trainer(tmp_path / "b", tiny, "flux", "cuda", blocks_to_swap=2)
    b = [swapped.train_step() for _ in range(3)]
    assert a == pytest.approx(b, rel=1e-5)
    sw = swapped.swapper
    assert all(getattr(m, n).device.type == "cpu" for es in sw.host.values() for m, _, n, _ in es)
    assert sw.pinned and all(getattr(m, n).is_pinned() for es in sw.host.values() for m, _, n, _ in es)
    assert sw.arena.reserved < sw.arena.copied + sw.arena.chunk  # packed: only the last chunk's tail unused
    assert all(p.is_cuda for p in swapped.params)


@pytest.mark.gpu
def test_an_8bit_base_never_holds_the_swapped_blocks_on_the_gpu(tiny):
    """Each swapped block's layers go home as soon as they are rounded to 8 bits: all blocks in 8 bits at once would
    not fit the card that swaps (FLUX.2 [dev], 30 GiB in 8 bits, on a 24 GiB card: out of memory in preparing)."""
    from lorakit.train.quant import block_linears, quantize_blocks
    from lorakit.train.swap import swapped_names

    tr = load_component(tiny("flux") / "transformer")
    away = swapped_names(tr, 2)
    assert len(away) == 2 and all(n in dict(tr.named_modules()) for n in away)
    quantize_blocks(tr, torch.bfloat16, "cuda", host=away)
    for name in block_linears(tr):
        w = tr.get_submodule(name).weight
        assert w.is_cuda != name.startswith(tuple(a + "." for a in away)), name
