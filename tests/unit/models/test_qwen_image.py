"""Qwen-Image's real-valued rotary (`before_compile`): the same numbers, and a block graph without complex
tensors for inductor."""

import pytest
import torch

from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter


def _complex_nodes(graphs) -> list:
    out = []
    for gm in graphs:
        for node in gm.graph.nodes:
            v = node.meta.get("example_value")
            if isinstance(v, torch.Tensor) and v.is_complex():
                out.append(node.name)
    return out


def _captured_block_graphs(adapter, transformer, batch):
    """The graphs dynamo captures for the first block during one prediction (what inductor would compile)."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    block = transformer.transformer_blocks[0]
    torch._dynamo.reset()
    block.compile(backend=backend, fullgraph=True)
    try:
        adapter.predict(transformer, batch.latents, torch.tensor([0.6]), batch.text, controls=batch.controls)
    finally:
        block._compiled_call_impl = None
        torch._dynamo.reset()
    return graphs


@pytest.mark.slow
def test_real_rotary_equals_the_complex_one_and_leaves_no_complex_op_in_a_block(tiny):
    family = "qwen-image-edit-plus"  # image + control tokens: both rotary paths (target and condition)
    folder = tiny(family)
    adapter = load_adapter(family, folder, dtype=torch.float32)
    batch = adapter.example_inputs(dict(load_component(folder / "transformer").config), 64, 8,
                                   torch.Generator().manual_seed(0))
    stock = load_component(folder / "transformer", "cpu", torch.float32)
    ours = load_component(folder / "transformer", "cpu", torch.float32)
    s = torch.tensor([0.6])
    with torch.no_grad():
        before = adapter.predict(stock, batch.latents, s, batch.text, controls=batch.controls)
        assert _complex_nodes(_captured_block_graphs(adapter, stock, batch))  # the stock block: complex product

        adapter.before_compile(ours)
        after = adapter.predict(ours, batch.latents, s, batch.text, controls=batch.controls)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
        graphs = _captured_block_graphs(adapter, ours, batch)
        assert graphs and not _complex_nodes(graphs)
        # a stock transformer in the same process still takes complex frequencies and computes what it did
        assert torch.equal(adapter.predict(stock, batch.latents, s, batch.text, controls=batch.controls), before)
