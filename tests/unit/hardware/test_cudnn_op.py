"""lorakit's cuDNN attention operators (`hardware.cudnn_op`): which calls they take, the mask they hand cuDNN, and
the shapes their registered fake implementations give the compiler (PyTorch's own meta functions for the same
kernels); their numbers against PyTorch's SDPA need a GPU (`test_the_operators_give_sdpas_output_and_gradients`)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from lorakit.hardware import cudnn_op, sdpa


def _qkv(device="cpu", dtype=torch.bfloat16, d=128, L=40):
    return [torch.randn(1, 4, L, d, device=device, dtype=dtype) for _ in range(3)]


def test_only_what_the_cudnn_kernel_takes_is_routed():
    q, k, v = _qkv()
    assert not cudnn_op.takes(q, k, v)  # CPU tensors
    with FakeTensorMode() as mode:  # shapes and dtypes of CUDA tensors without a GPU
        q, k, v = (mode.from_tensor(t).to("cuda") for t in _qkv())
        mask = torch.ones(1, 1, 1, 40, dtype=torch.bool, device="cuda")
        assert cudnn_op.takes(q, k, v) and cudnn_op.takes(q, k, v, mask)
        assert cudnn_op.takes(q, k, v, mask.to(torch.bfloat16))
        assert not cudnn_op.takes(q, k, v, mask.long())  # neither boolean nor floating
        assert not cudnn_op.takes(q, k, v, None, 0.1)  # dropout
        assert not cudnn_op.takes(q, k, v, mask, is_causal=True)
        assert not cudnn_op.takes(q, k, v, enable_gqa=True)
        assert not cudnn_op.takes(q.float(), k.float(), v.float())
        big = [torch.empty(1, 1, 40, 512, device="cuda", dtype=torch.bfloat16)] * 3  # a VAE's single wide head
        assert not cudnn_op.takes(*big)


def test_a_boolean_mask_becomes_cudnns_additive_bias():
    mask = torch.tensor([True, False, True]).view(1, 1, 1, 3)
    bias = cudnn_op.bias_of(mask, torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.shape == mask.shape
    assert bias.flatten().tolist() == [0.0, float("-inf"), 0.0]
    assert cudnn_op.bias_of(None, torch.bfloat16) is None
    assert cudnn_op.bias_of(torch.zeros(1, 1, 1, 3), torch.bfloat16).dtype == torch.bfloat16


def test_the_fake_operators_have_pytorchs_shapes_for_the_compiler():
    forward, backward = cudnn_op.ops()
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in _qkv(L=24))
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # BSHD memory, as the blocks project it
        out, lse = forward(q, k, v, None, False, None)
        ref = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
        assert out.shape == ref[0].shape and out.stride() == ref[0].stride() and lse.shape == (1, 4, 24, 1)
        dq, dk, dv = backward(out, q, k, v, out, lse, None, False, None)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.stride() == q.stride()


def test_sdpa_routes_to_the_operators_only_while_they_are_in_use(monkeypatch):
    calls = []
    monkeypatch.setattr(cudnn_op, "takes", lambda *a, **kw: True)
    monkeypatch.setattr(cudnn_op, "attention", lambda *a, **kw: calls.append((kw, [t.dtype for t in a])) or a[0])
    prev = sdpa.apply(None)
    sdpa.grad_like_output(True)
    try:
        q, k, v = _qkv(dtype=torch.float32, d=8, L=4)
        F.scaled_dot_product_attention(q, k, v)
        assert calls == []  # not in use: PyTorch's own
        cudnn_op.use(True)
        F.scaled_dot_product_attention(q, k, v, is_causal=False)
        assert calls == [({"is_causal": False}, [torch.float32] * 3)]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # an fp32 query under autocast: as autocast casts it
            F.scaled_dot_product_attention(q, k, v.bfloat16())
        assert calls[1] == ({}, [torch.bfloat16] * 3)
    finally:
        cudnn_op.use(False)
        sdpa.restore(prev)


def test_under_autocast_the_route_gets_what_autocast_hands_sdpa():
    q, k, v = _qkv(dtype=torch.float32, d=8, L=4)
    assert cudnn_op.as_autocast(q, k, v) == (q, k, v)  # no autocast: as they are
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cudnn_op.as_autocast(q, k.bfloat16(), v.half())
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16, torch.float16]  # only fp32 is cast
    torch.testing.assert_close(out[0].float(), q, rtol=1e-2, atol=1e-2)


def test_a_compiled_block_calls_the_operator_inside_its_one_graph():
    """The operators are registered before any compile (`use`): registered from the traced code, torch.compile broke
    the block's graph in two around them ("Library.__init__ should not be traced") and the pieces ran 1.6 s a step
    against 0.46 (one H200). fullgraph=True fails on a break; the graph is recorded, not run (no cuDNN here)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [torch.zeros(1)] * outputs

    def block(q, k, v):
        return cudnn_op.attention(q, k, v).sum(dim=1) * 2

    cudnn_op.use(True)
    try:
        torch._dynamo.reset()
        torch.compile(block, backend=record, fullgraph=True)(*_qkv(L=24))
    finally:
        cudnn_op.use(False)
        torch._dynamo.reset()
    called = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    op = torch.ops.lorakit.cudnn_attention
    assert len(graphs) == 1 and (op in called or op.default in called)


@pytest.mark.gpu
def test_the_operators_give_sdpas_output_and_gradients():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prev = sdpa.apply("cudnn", fallback=True)
    try:
        L = 300
        q, k, v = _qkv("cuda", L=L)
        mask = torch.arange(L, device="cuda").view(1, 1, 1, L) >= 7
        results = []
        for on in (False, True):
            cudnn_op.use(on)
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*x, attn_mask=mask)
            out.backward(torch.ones_like(out).transpose(1, 2).contiguous().transpose(1, 2))
            results.append([out.detach()] + [t.grad for t in x])
        for a, b in zip(*results, strict=True):
            assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()
    finally:
        cudnn_op.use(False)
        sdpa.restore(prev)
