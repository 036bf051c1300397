"""Optimizers: bf16 weights trained with stochastic rounding keep the small updates plain AdamW loses."""

import pytest
import torch

from lorakit.train.adam_kernel import mix32, noise_key, noise_reference, round_with
from lorakit.train.optim import AdamWBf16, clip_grad_norm


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16 value, 1 + 2^-7
    noise = noise_reference(torch.arange(x.numel()), noise_key(0, 1, 1))
    r = round_with(x, noise).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert r.mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    exact = torch.tensor([0.5, -3.0, 1.0078125])
    assert torch.equal(round_with(exact, noise[:3]).float(), exact)
    bits = noise_reference(torch.arange(1 << 16), noise_key(3, 7, 2))  # 16 bits per element, all values alike
    assert bits.min() >= 0 and bits.max() < 1 << 16
    assert bits.float().mean().item() == pytest.approx(2**15, rel=0.01)
    assert mix32(noise_key(3, 7, 2)) != noise_key(3, 8, 2) != noise_key(3, 7, 3)


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


def _bf16_run(steps, weights, seed=0, opt=None, start=0):
    """AdamWBf16 over bf16 weights with drawn gradients, steps start..steps-1."""
    opt = opt or AdamWBf16(weights, lr=1e-3, weight_decay=0.01, seed=seed)
    for i in range(start, steps):
        g = torch.Generator().manual_seed(100 + i)
        for w in weights:
            w.grad = torch.randn(w.shape, generator=g).bfloat16()
        opt.step()
    return opt


def test_a_resumed_bf16_run_rounds_exactly_as_the_uninterrupted_one():
    def weights():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64, 32).bfloat16()), torch.nn.Parameter(torch.randn(7).bfloat16())]

    whole = weights()
    _bf16_run(6, whole)
    first = weights()
    state = _bf16_run(3, first).state_dict()
    again = [torch.nn.Parameter(w.detach().clone()) for w in first]  # a new process: weights and states from files
    opt = AdamWBf16(again, lr=1e-3, weight_decay=0.01)
    opt.load_state_dict(state)
    _bf16_run(6, again, opt=opt, start=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
    other_seed = weights()
    _bf16_run(6, other_seed, seed=1)
    assert not torch.equal(whole[0], other_seed[0])  # the seed is in the noise


def test_the_kernel_updates_as_the_reference_does(monkeypatch):
    """The Triton kernel (run by Triton's interpreter on this CPU) makes the reference's weights bit for bit; its
    moments are the reference's fp32 moments in bf16 (the interpreter truncates where a GPU rounds to nearest)."""
    pytest.importorskip("triton")
    from lorakit.train import adam_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    adam_kernel.kernel.cache_clear()
    try:
        assert "Interpreted" in type(adam_kernel.kernel()).__name__  # built now, for this CPU
        torch.manual_seed(0)
        n = 3 * adam_kernel.BLOCK + 5  # a partial last block
        for dtype in (torch.bfloat16, torch.float32):
            w, g = (torch.randn(n) * 0.02).to(dtype), (torch.randn(n) * 1e-3).bfloat16()
            m, v = (torch.randn(n) * 1e-3).bfloat16(), (torch.rand(n) * 1e-6).bfloat16()
            kw = dict(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, step=3,
                      key=noise_key(7, 3, 11), offset=1000)
            ref = [t.clone() for t in (w, g, m, v)]
            adam_kernel.update_reference(*ref, **kw)
            ours = [t.clone() for t in (w, g, m, v)]
            adam_kernel.update(*ours, **kw)
            if dtype == torch.bfloat16:
                assert torch.equal(ours[0], ref[0])
            else:  # fp32 weights: the same arithmetic, not always the same order of it
                assert torch.allclose(ours[0], ref[0], rtol=0, atol=1e-9)
            mf = m.float() * 0.9 + 0.1 * g.float()
            down = (mf.view(torch.int32) & -65536).view(torch.float32)
            assert bool(((ours[2].float() == down) | (ours[2] == ref[2])).all())
            assert not torch.equal(ours[2], m)
    finally:
        adam_kernel.kernel.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_on_a_gpu_equals_the_reference():
    from lorakit.train import adam_kernel

    torch.manual_seed(0)
    n = 1 << 20
    w, g = (torch.randn(n) * 0.02).bfloat16().cuda(), (torch.randn(n) * 1e-3).bfloat16().cuda()
    m, v = (torch.randn(n) * 1e-3).bfloat16().cuda(), (torch.rand(n) * 1e-6).bfloat16().cuda()
    kw = dict(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, step=3, key=noise_key(7, 3, 11), offset=9)
    ref, ours = [t.clone() for t in (w, g, m, v)], [t.clone() for t in (w, g, m, v)]
    adam_kernel.update_reference(*ref, **kw)
    assert adam_kernel.usable(*ours)
    adam_kernel.update(*ours, **kw)
    # the kernel fuses multiply-adds the reference rounds apart: an fp32 bit apart, which the bf16 rounding of the
    # moments turns into one bf16 step on ~1% of elements (measured on an H200, 2026-11-27); the weights' stochastic
    # rounding almost never
    for a, b in zip(ref, ours, strict=True):  # at most one bf16 step (near zero: of the operands' size)
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=a.float().abs().max().item() * 2**-14)
    assert (ref[0] != ours[0]).float().mean().item() < 1e-3
    assert (ref[2] != ours[2]).float().mean().item() < 0.03 and (ref[3] != ours[3]).float().mean().item() < 0.03


def _sharded_rank(rank, world, path, out):
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    td.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        full = [torch.randn(13, 8).bfloat16(), torch.randn(5).bfloat16()]  # 13 rows: uneven shards
        ps = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
        opt = AdamWBf16(ps, lr=1e-2)
        for i in range(3):
            g = torch.Generator().manual_seed(100 + i)
            for p, t in zip(ps, full, strict=True):
                p.grad = distribute_tensor(torch.randn(t.shape, generator=g).bfloat16(), mesh, [Shard(0)])
            opt.step()
        got = [p.full_tensor() for p in ps]
        g = torch.Generator().manual_seed(7)
        ps = [torch.nn.Parameter(distribute_tensor(t.float(), mesh, [Shard(0)])) for t in full]
        for p, t in zip(ps, full, strict=True):
            p.grad = distribute_tensor(torch.randn(t.shape, generator=g), mesh, [Shard(0)])
        clip_grad_norm(ps, 0.5)
        clipped = [p.grad.full_tensor() for p in ps]
        if rank == 0:
            torch.save({"weights": got, "clipped": clipped}, out)
        td.barrier()  # both ranks done talking before either leaves: gloo aborts a rank whose peer left mid-way
    finally:
        td.destroy_process_group()


@pytest.mark.slow
def test_fsdp_shards_round_and_clip_as_one_process_does(tmp_path):
    """Two gloo ranks, each updating its shard of two parameters (one split unevenly): the gathered weights equal
    one process's bit for bit (the noise follows the element's place in the whole parameter), and gradients
    clipped on the shards equal torch's clip of the whole gradients."""
    import torch.multiprocessing as mp

    out = tmp_path / "two.pt"
    mp.spawn(_sharded_rank, args=(2, tmp_path / "store", out), nprocs=2)
    torch.manual_seed(0)
    one = [torch.nn.Parameter(torch.randn(13, 8).bfloat16()), torch.nn.Parameter(torch.randn(5).bfloat16())]
    opt = AdamWBf16(one, lr=1e-2)
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        for p in one:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        opt.step()
    two = torch.load(out, weights_only=True)
    assert all(torch.equal(a.detach(), b) for a, b in zip(one, two["weights"], strict=True))
    g = torch.Generator().manual_seed(7)  # the sharded gradients clipped as torch clips the whole ones
    one = [torch.nn.Parameter(p.detach().float()) for p in one]
    for p in one:
        p.grad = torch.randn(p.shape, generator=g)
    torch.nn.utils.clip_grad_norm_(one, 0.5)
    for p, c in zip(one, two["clipped"], strict=True):
        torch.testing.assert_close(c, p.grad, rtol=1e-5, atol=1e-7)
    assert sum(c.square().sum() for c in two["clipped"]).sqrt().item() == pytest.approx(0.5, rel=1e-4)
