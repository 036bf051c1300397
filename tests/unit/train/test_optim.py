"""Optimizers: bf16 weights trained with stochastic rounding keep the small updates plain AdamW loses."""

import pytest
import torch

from lorakit.train.optim import AdamWBf16, round_stochastic


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16 value, 1 + 2^-7
    r = round_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert r.mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    exact = torch.tensor([0.5, -3.0, 1.0078125])
    assert torch.equal(round_stochastic(exact).float(), exact)


def test_small_updates_accumulate_in_bf16_weights():
    torch.manual_seed(0)
    target = torch.randn(4096)
    start = target.bfloat16() + 0.05

    def fit(make):
        w = torch.nn.Parameter(start.clone())
        opt = make([w])
        for _ in range(600):
            w.grad = (w.float() - target).bfloat16()
            opt.step()
        return (w.float() - target).abs().mean().item()

    plain = fit(lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.0))
    ours = fit(lambda p: AdamWBf16(p, lr=1e-4))
    assert ours < 0.2 * 0.05  # 600 steps of ~1e-4 cover the 0.05 (bf16 spacing here: 0.008)
    assert plain > 0.8 * 0.05  # rounding to nearest swallowed nearly every update


def test_8bit_adamw_makes_bitsandbytes_bits_without_a_wait_per_parameter(monkeypatch):
    """lorakit's AdamW8bit runs bitsandbytes' kernels in its order (8-bit moments, a small tensor's 32-bit ones,
    a step without a gradient) and never calls its per-parameter device wait (1,680 per Qwen-Image step)."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.optim import optimizer as bnb_optimizer

    from lorakit.train.optim import adamw8bit_class

    waits = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: waits.append(t))

    def run(cls):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(16)),
              torch.nn.Parameter(torch.randn(256, 64))]
        opt = cls(ps, lr=1e-2, weight_decay=0.01)
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            for j, p in enumerate(ps):
                p.grad = None if (i, j) == (1, 2) else torch.randn(p.shape, generator=g)
            opt.step()
        return ps, opt

    ref, ref_opt = run(bnb.optim.AdamW8bit)
    assert len(waits) == 11  # bitsandbytes' own step: one wait per parameter with a gradient
    waits.clear()
    ours, opt = run(adamw8bit_class())
    assert waits == []
    assert ref_opt.state[ref[0]]["state1"].dtype == torch.uint8  # the 8-bit path was exercised
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
    for a, b in zip(ref, ours, strict=True):
        assert all(torch.equal(x, y) if torch.is_tensor(x) else x == y
                   for x, y in zip(ref_opt.state[a].values(), opt.state[b].values(), strict=True))
