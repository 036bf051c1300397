"""The blocks' sizes that vary with the data, symbolic from the first compile (train/dims.py). torch.compile's
`aot_eager` backend stands in for Inductor on the CPU: the same Dynamo capture, guards and graphs."""

import functools
import json
import time

import pytest
import torch
from torch._dynamo.utils import counters

from lorakit.config import assemble
from lorakit.data.demo import make_demo_dataset
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.train import dims
from lorakit.train.compile_bg import BackgroundCompile
from lorakit.train.lora import add_lora
from lorakit.train.swap import repeated_blocks
from tests.unit.train.test_compile_bg import _Heard, _model, _step, captions_of_lengths, run_fresh
from tests.unit.train.test_loop import make_cfg


def test_only_the_dimensions_whose_sizes_differ_are_found():
    a = {("hidden_states",): (1, 64, 8), ("temb",): (1, 8), ("mask",): (1, 5), ("rope", 0): (69, 4)}
    b = {("hidden_states",): (1, 96, 8), ("temb",): (1, 8), ("rope", 0): (101, 4)}
    c = {("hidden_states",): (1, 48, 8), ("temb",): (1, 8), ("rope", 0): (53, 4, 1)}
    assert dims.differing([a, b]) == ((("hidden_states",), 1), (("rope", 0), 0))
    assert dims.differing([a, b, c]) == ((("hidden_states",), 1),)  # another rank: left alone
    assert dims.differing([a, a]) == ()
    found = {"Block": ((("hidden_states",), 1), (("rope", 0), 0))}
    carried = {"Block": (("encoder_hidden_states",), ("hidden_states",))}
    packs = {"Single": (1, ("encoder_hidden_states", "hidden_states"))}
    back = dims.from_json(json.loads(json.dumps(dims.to_json(found, carried, packs))))  # to the compile process
    assert back == (found, carried, packs) and dims.from_json(None) == ({}, {}, {})
    assert dims.said_packs(packs) == "Single: encoder_hidden_states + hidden_states along dim 1"
    assert dims.said_carried(carried) == "Block: encoder_hidden_states, hidden_states"
    assert dims.said(found) == "Block: hidden_states dim 1, rope[0] dim 0"


def test_a_call_by_position_and_by_keyword_has_the_same_paths():
    """diffusers' gradient checkpointing passes a block's inputs by position, its calls without gradients by keyword:
    the marks found on one reach the other."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    block = FluxTransformerBlock(dim=16, num_attention_heads=2, attention_head_dim=8)
    h, e, temb, rope = torch.zeros(1, 6, 16), torch.zeros(1, 3, 16), torch.zeros(1, 16), (torch.zeros(9, 8),) * 2
    by_key = dims.named(block, (), {"hidden_states": h, "encoder_hidden_states": e, "temb": temb,
                                    "image_rotary_emb": rope})
    by_pos = dims.named(block, (h, e, temb, rope), {})
    assert dims._shapes(by_key) == dims._shapes(by_pos)
    marks = ((("hidden_states",), 1), (("image_rotary_emb", 1), 0))
    dims.mark(block, (h, e, temb, rope), {}, marks)
    assert h._dynamo_weak_dynamic_indices == {1} and rope[1]._dynamo_weak_dynamic_indices == {0}
    assert not hasattr(e, "_dynamo_weak_dynamic_indices")
    copy = dims.carry_marks(h, h.clone())
    assert copy._dynamo_weak_dynamic_indices == {1} and copy._dynamo_weak_dynamic_indices is not \
        h._dynamo_weak_dynamic_indices


def _lora_model(tiny, family: str):
    folder = tiny(family)
    adapter = load_adapter(family, folder, dtype=torch.float32)
    cfg, _ = assemble(None, [f"model.family={family}"], "datacenter")
    x = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                               torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    tr = load_component(folder / "transformer", "cpu", torch.float32)
    add_lora(tr, adapter, cfg)
    return tr.train(), adapter, x


def test_slices_of_one_tensor_are_found_and_separate_inputs_are_joined_into_the_same_layout():
    """FLUX.1's single blocks: the first gets the text and image streams as two tensors, the later ones as two
    slices of the previous block's output; joined, the first call's inputs have the later calls' sizes, strides and
    offsets (what a compiled graph is specialised to), and the gradient reaches both."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    out = torch.randn(1, 7, 4)
    e, h = out[:, :3], out[:, 3:]
    s = dims.settled(e)  # the batch dim's stride as the slice's own sizes give it: the same elements
    assert e.stride() == (28, 4, 1) and s.stride() == (12, 4, 1) and s.data_ptr() == e.data_ptr() and torch.equal(s, e)
    assert dims.settled(out) is out and dims.settled(torch.zeros(2, 3, 4)[:, :1]).stride() == (12, 4, 1)
    assert dims.settled(torch.zeros(100).as_strided((1, 1, 4), (50, 7, 1))).stride() == (4, 4, 1)
    assert dims.tiling([e, h]) == 1 and dims.tiling([h, e]) is None and dims.tiling([e]) is None
    assert dims.tiling([e.clone(), h.clone()]) is None and dims.tiling([out[:, :3], out[:, 4:]]) is None
    block = FluxSingleTransformerBlock(dim=4, num_attention_heads=1, attention_head_dim=4)
    e0, h0 = torch.randn(1, 3, 4, requires_grad=True), torch.randn(1, 4, 4, requires_grad=True)
    for args, kwargs in (((h0, e0), {}), ((), {"hidden_states": h0, "encoder_hidden_states": e0})):
        inputs = dims.named(block, args, kwargs)
        a, k = dims.packed(block, args, kwargs, inputs, (1, ("encoder_hidden_states", "hidden_states")))
        got = dims.named(block, a, k)
        assert got == inputs and got["hidden_states"] is not h0
        for name, want in (("encoder_hidden_states", dims.settled(e)), ("hidden_states", dims.settled(h))):
            t = got[name]
            assert (t.shape, t.stride(), t.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
        assert torch.equal(got["encoder_hidden_states"], e0) and torch.equal(got["hidden_states"], h0)
        assert dims.packed(block, a, k, got, (1, ("encoder_hidden_states", "hidden_states"))) == (a, k)  # joined
    (got["hidden_states"].sum() + 2 * got["encoder_hidden_states"].sum()).backward()
    assert torch.equal(h0.grad, torch.ones_like(h0)) and torch.equal(e0.grad, torch.full_like(e0, 2))


@pytest.mark.slow
def test_flux_single_blocks_call_one_graph_for_every_bucket_shape(tiny):
    """FLUX.1 with three double and three single blocks, LoRA, two bucket shapes, compiled as the run compiles them
    (`found` on both shapes, then `install`): one graph per block kind for both shapes. Without joining the first
    single block's inputs it compiled a second single-block graph; joined but with the slices' batch stride as it
    comes (the whole tensor's size, which the other shape changes), a second one at the other shape."""
    from diffusers import FluxTransformer2DModel

    folder = tiny("flux")
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    config = dict(load_component(folder / "transformer").config)
    torch.manual_seed(0)
    tr = FluxTransformer2DModel(**{**{k: v for k, v in config.items() if not k.startswith("_")},
                                   "num_layers": 3, "num_single_layers": 3})
    cfg, _ = assemble(None, ["model.family=flux"], "datacenter")
    add_lora(tr, adapter, cfg)
    tr.train()
    xs = [adapter.example_inputs(config, res, 8, torch.Generator().manual_seed(0)) for res in (64, 96)]
    torch._dynamo.reset()
    counters.clear()
    try:
        for b in repeated_blocks(tr):
            b._compiled_call_impl = torch.compile(b._call_impl, backend="aot_eager")
        carried, packs = {}, {}
        runs = [functools.partial(adapter.predict, tr, x.latents.clone(), torch.tensor([0.6]), x.text) for x in xs]
        dims.install(tr, dims.found(tr, runs, "cpu", carried, packs), carried, packs)
        assert packs == {"FluxSingleTransformerBlock": (1, ("encoder_hidden_states", "hidden_states"))}
        made = []
        for x in xs:
            adapter.predict(tr, x.latents.clone(), torch.tensor([0.6]), x.text).square().mean().backward()
            made.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert made == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "carried", "packs", "graphs"), [
    ("qwen-image", {"QwenImageTransformerBlock": (("encoder_hidden_states",), ("hidden_states",))}, {}, (2, 1)),
    ("wan2.1-t2v", {"WanTransformerBlock": (("hidden_states",),)}, {}, (2, 1)),  # the text is cross-attended
    ("flux", {"FluxSingleTransformerBlock": (("encoder_hidden_states",), ("hidden_states",))},
     {"FluxSingleTransformerBlock": (1, ("encoder_hidden_states", "hidden_states"))}, (3, 2)),
])
def test_the_first_block_takes_its_carried_inputs_with_gradients_so_every_block_of_a_kind_calls_one_graph(
        tiny, family, carried, packs, graphs):
    """With LoRA the first block of a list gets the image and text streams from frozen embedders, without gradients,
    and every later block with them: two graphs for the same code. Marked as carried, they require gradients in the
    first block too: one graph, the same output and LoRA gradients. FLUX.1's first single block gets them as two
    tensors where the later ones get slices of one: joined first, one graph for the kind (the double block: the
    other)."""
    def step(tr, adapter, x):
        v = adapter.predict(tr, x.latents.clone(), torch.tensor([0.6]), x.text)
        v.square().mean().backward()
        # a weight whose output is unused (the last block's text stream): None eager, zeros compiled
        return v.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad
                            for n, p in tr.named_parameters() if p.requires_grad}

    want = step(*_lora_model(tiny, family))
    made = []
    for use in (False, True):
        torch._dynamo.reset()
        counters.clear()
        tr, adapter, x = _lora_model(tiny, family)
        for b in repeated_blocks(tr):
            b._compiled_call_impl = torch.compile(b._call_impl, backend="aot_eager")
        found, joined = {}, {}
        run = functools.partial(adapter.predict, tr, x.latents.clone(), torch.tensor([0.6]), x.text)
        assert dims.found(tr, [run], "cpu", found, joined) == {} and found == carried  # one pass: no sizes vary
        assert joined == packs
        if use:
            assert dims.install(tr, {}, found, joined) == sum(type(b).__name__ in carried for b in repeated_blocks(tr))
        got = step(tr, adapter, x)
        made.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for n, g in want[1].items():
            torch.testing.assert_close(got[1][n], g, rtol=1e-6, atol=1e-9, equal_nan=True, msg=n)
    torch._dynamo.reset()
    assert tuple(made) == graphs


def _runs_compiled(monkeypatch, tmp_path):
    import lorakit.plan.resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "compile_decision", lambda *a: (True, None))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))


class _Facts(_Heard):
    def phase_end(self, name, seconds, facts):
        self.phases.append((name, facts.get("step"), dict(facts)))


@pytest.mark.slow
def test_three_bucket_shapes_and_every_caption_length_run_the_graphs_compiled_at_step_1(tmp_path, tiny, monkeypatch):
    """Qwen-Image (its text length follows the caption) on three aspect ratios, the blocks compiled in the run: the
    image and text token counts are found to vary before step 1 and compile symbolic there, so the pass over the
    other shapes right after step 1 compiles nothing (without the marks: a second graph per block, 25 s of that
    phase on this CPU) and no later step waits for the compiler."""
    _runs_compiled(monkeypatch, tmp_path)
    cfg = make_cfg(tmp_path, "qwen-image", tiny("qwen-image"), steps=8, lora={"dropout": 0.0},
                   sampling={"enabled": False}, output={"save_every": 0}, memory={"compile_background": False})
    make_demo_dataset(tmp_path / "d", count=4, size=[(64, 64), (96, 64), (64, 96)])
    captions_of_lengths(tmp_path / "d")
    heard = _Facts()
    r = run_fresh(cfg, heard)
    assert r["steps"] == 8 and r["compiled_from"] == 1
    symbolic = [f["symbolic"] for name, _, f in heard.phases if name == "sizes that vary"]
    assert symbolic and "hidden_states dim 1" in symbolic[0] and "encoder_hidden_states dim 1" in symbolic[0]
    warmed = [f for name, _, f in heard.phases if name.startswith("compile 2 more bucket shape")]
    assert warmed and warmed[0]["new_graphs"] == 0, heard.phases
    assert not [step for name, step, _ in heard.phases if name == "compile"], "a step waited for the compiler"
    assert len({json.loads(x)["size"] for x in open(r["metrics"])}) == 3


@pytest.mark.slow
def test_checkpointed_blocks_compiling_in_the_background_run_the_workers_graphs_from_the_switch_on(
        tmp_path, tiny, monkeypatch):
    """Qwen-Image with every block recomputed in backward (its inputs reach the first block as views), the blocks
    compiled in the background on three aspect ratios and captions of four lengths: the worker's copies of the first
    block's inputs require grad as the run's do (`train.dims.with_grad`), so once the blocks switch no step waits for
    the compiler (the copies without it: a graph of another grad requirement, and a compile at step 5 here). (Each
    step boundary after the worker began waits for it to finish: the switch comes at step 3 whatever the load.)"""
    _runs_compiled(monkeypatch, tmp_path)
    advance = BackgroundCompile.advance

    def settled(self, load=False):
        deadline = time.monotonic() + 300
        while self._go.is_set() and self._thread.is_alive() and len(self._done) < self.pending:
            assert time.monotonic() < deadline, "the worker did not finish"
            time.sleep(0.05)
        return advance(self, load)

    monkeypatch.setattr(BackgroundCompile, "advance", settled)
    cfg = make_cfg(tmp_path, "qwen-image", tiny("qwen-image"), steps=8, lora={"dropout": 0.0},
                   sampling={"enabled": False}, output={"save_every": 0},
                   memory={"compile_background": True, "gradient_checkpointing": True})
    make_demo_dataset(tmp_path / "d", count=4, size=[(64, 64), (96, 64), (64, 96)])
    captions_of_lengths(tmp_path / "d")
    heard = _Facts()
    r = run_fresh(cfg, heard)
    assert r["steps"] == 8
    carried = [f["with_grad"] for name, _, f in heard.phases if name == "sizes that vary"]
    assert carried == ["QwenImageTransformerBlock: encoder_hidden_states, hidden_states"]
    switched = [m for m in heard.lines if m.startswith("compiled in the background (")]
    assert switched and switched[0].endswith("the blocks run compiled from step 3")
    assert not [step for name, step, _ in heard.phases if name == "compile"], "a step waited for the compiler"


@pytest.mark.slow
def test_a_bucket_met_after_the_background_compile_runs_its_symbolic_graphs(tiny):
    """With the image token count marked, what the worker compiled for step 1's bucket serves a bucket first met
    after the compiled blocks came into use: no compile in the run's thread, the eager results."""
    torch._dynamo.reset()
    counters.clear()
    folder = tiny("flux")
    adapter = load_adapter("flux", folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    config = dict(load_component(folder / "transformer").config)
    small, large = (adapter.example_inputs(config, res, 8, gen) for res in (64, 96))
    ref = _model(folder, adapter)
    want = _step(ref, adapter, large)

    tr = _model(folder, adapter)
    tr.load_state_dict(ref.state_dict())
    bg = BackgroundCompile(repeated_blocks(tr), {"backend": "aot_eager"}, "cpu")
    try:
        passes = [functools.partial(adapter.predict, tr, b.latents, torch.tensor([0.6]), b.text)
                  for b in (small, large)]
        found = dims.found(tr, passes, "cpu")
        assert set(found) == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
        assert dims.install(tr, found) == len(repeated_blocks(tr))
        _step(tr, adapter, small)  # eager, the worker given its calls (their copies marked as the run's)
        deadline = time.monotonic() + 120
        while not bg.advance():
            assert time.monotonic() < deadline, "the worker did not finish"
            time.sleep(0.05)
        assert bg.sealed and bg.own_graphs() == 0
        assert all(isinstance(b._compiled_call_impl, dims.Marked) for b in repeated_blocks(tr))
        out, grads = _step(tr, adapter, large)  # a bucket the worker never saw
        assert bg.eager_calls == 0 and bg.own_graphs() == 0  # its graphs, symbolic: nothing compiled here
        torch.testing.assert_close(out, want[0])
        for n, g in want[1].items():
            torch.testing.assert_close(grads[n], g, msg=n)
    finally:
        bg.close()
        torch._dynamo.reset()
