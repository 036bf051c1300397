"""A text encoder larger than the card runs with its blocks streamed: each decoder layer visits alone, wherever the
layers sit in the module, and the outputs are the same as the resident encoder's."""

import pytest
import torch

from lorakit.io.stream import block_lists, folder_gib, stream
from lorakit.models import tiny


@pytest.fixture
def encoder():
    proc = tiny.mistral3_processor()
    return tiny.mistral3(proc, seed=3, layers=4).eval(), proc


def _group_of(module):
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook("group_offloading") if registry is not None else None
    return hook.group if hook is not None else None


def test_the_layers_are_found_where_a_transformers_encoder_keeps_them(encoder):
    te, _ = encoder
    assert block_lists(te) == [te.model.language_model.layers]  # the vision tower's: a small share, it stays


def test_a_transformer_keeps_its_blocks_at_the_top(tiny):
    """FLUX's blocks are the transformer's own children: nothing to look inside (an attention's `to_out` list,
    inside every block, is no list of blocks)."""
    from lorakit.io.modules import load_component

    transformer = load_component(tiny("flux") / "transformer")
    assert block_lists(transformer) == [transformer.transformer_blocks, transformer.single_transformer_blocks]


def test_each_layer_visits_alone_and_the_outputs_are_the_same(encoder):
    te, proc = encoder
    ids = proc.tokenizer(["a red cube on a table"], return_tensors="pt")
    with torch.no_grad():
        before = te(**ids, output_hidden_states=True).hidden_states
    layers = te.model.language_model.layers
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers]
    facts = stream(te, "cpu", pinned=False)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers] == [(a + 1, b + 1) for a, b in hooks]
    assert not te.model.language_model.embed_tokens._forward_pre_hooks  # the rest stays where it was put
    with torch.no_grad():
        after = te(**ids, output_hidden_states=True).hidden_states
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert facts["pinned"] is False and facts["pinned_gib"] == 0 and facts["blocks"] == len(layers)
    held = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    assert facts["streamed_gib"] == facts["pageable_gib"] == round(held / 2**30, 2)


def test_a_visit_copies_in_and_its_end_drops_the_copies(encoder, monkeypatch):
    """What a visit does, on a CPU stand-in for the device: each of the block's host tensors is sent when it runs,
    and afterwards the block rests on the very same host tensors (nothing copied back)."""
    te, proc = encoder
    stream(te, "cpu", pinned=False)
    layer = te.model.language_model.layers[0]
    host = {id(p): p.data.data_ptr() for p in layer.parameters()}
    sent, real = [], torch.Tensor.to

    def to(t, *a, **k):  # a CPU "device" copies nothing: record what a visit sends
        sent.append(t.data_ptr())
        return real(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", to)
    with torch.no_grad():
        te(**proc.tokenizer(["a cube"], return_tensors="pt"))
    monkeypatch.setattr(torch.Tensor, "to", real)
    assert set(host.values()) <= set(sent)
    assert all(p.data.data_ptr() == host[id(p)] for p in layer.parameters())


def test_the_pipelines_own_group_offload_moves_the_language_model_whole(encoder):
    """Why `io.stream` names the paths: diffusers' block-level offload looks at the top module's children only, and
    a transformers encoder's one child there (`model`) is moved as one group — 45 GiB at once for FLUX.2 [dev]'s."""
    from diffusers.hooks import apply_group_offloading

    te, _ = encoder
    apply_group_offloading(te, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    assert all(_group_of(layer) is None for layer in te.model.language_model.layers)
    assert te.model in _group_of(te).modules


def test_folder_gib_counts_floats_at_the_runs_dtype(tmp_path):
    from lorakit.io import save_sharded

    save_sharded({"w": torch.zeros(256, 1024, dtype=torch.float32), "i": torch.zeros(1024, dtype=torch.int64)},
                 tmp_path, base="model")
    assert folder_gib(tmp_path, 2) == round((256 * 1024 * 2 + 1024 * 8) / 2**30, 2)
    assert folder_gib(tmp_path / "none", 2) is None
