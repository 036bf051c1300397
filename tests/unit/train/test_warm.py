"""`train.warm.warm_shapes`: one pass of each other shape before the steps, nothing of them left behind."""

import torch

from lorakit.train import warm
from tests.unit.train.test_inputs import trainer  # noqa: F401 - the fixture


def test_each_warm_pass_starts_without_the_last_ones_gradients_and_leaves_none(trainer):  # noqa: F811
    """With CUDA graphs a pass's LoRA gradients are outputs of the graphs that the next pass overwrites: summing
    the next pass's into them read overwritten memory (Qwen-Image at 24 GiB with graphs, one H200, 2026-12-02:
    "accessing tensor output of CUDAGraphs that has been overwritten" in the other shapes' compile)."""
    tr = trainer()
    seen = []
    real = tr.loss_on

    def loss_on(*a, **k):
        seen.append(sum(p.grad is not None for p in tr.params))
        return real(*a, **k)
    tr.loss_on = loss_on
    batches = [(f"pass {i}", tr.data.load([k])) for i, k in enumerate(it["key"] for it in tr.data.items[:3])]
    rng = torch.random.get_rng_state()
    assert warm.warm_shapes(tr, batches) == ["pass 0", "pass 1", "pass 2"]
    assert seen == [0, 0, 0]
    assert all(p.grad is None for p in tr.params) and torch.equal(torch.random.get_rng_state(), rng)
