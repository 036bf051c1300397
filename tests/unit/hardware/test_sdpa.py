"""While cuDNN attention may run, the gradient SDPA's backward receives is laid out as its output is: PyTorch keeps
a cuDNN backward graph under q/k/v's strides alone, built for the first grad_output's strides (FLUX.1's single
blocks hand a slice, its double blocks a dense tensor: non-finite gradients or an illegal memory access on
H100/H200 until every grad_output matched the output)."""

import pytest
import torch
import torch.nn.functional as F

from lorakit.hardware import sdpa

B, S, H, D = 1, 24, 2, 8


@pytest.fixture(autouse=True)
def _restore_switches():
    prev = sdpa.apply(None)
    yield
    sdpa.restore(prev)


def _single_block(q, k, v, mlp):
    """FLUX.1's single block around its attention: BSHD projections, the output concatenated with the MLP's."""
    o = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v)))
    return torch.cat([o.permute(0, 2, 1, 3).flatten(2, 3), mlp], dim=2).square().sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(B, S, H, D, generator=g).requires_grad_(True) for _ in range(3)]
    return qkv, torch.randn(B, S, 4 * H * D, generator=g)


def _grads_seen_by_the_kernel(fn):
    """Run fn's forward+backward; the strides of each gradient that reached SDPA's own output, and that output's."""
    seen, torch_sdpa = [], sdpa.TORCH_SDPA[0]

    def kernel(*args, **kwargs):
        out = torch_sdpa(*args, **kwargs)
        out.register_hook(lambda g: seen.append((tuple(g.stride()), tuple(out.stride()))))
        return out
    sdpa.TORCH_SDPA[0] = kernel
    try:
        qkv, mlp = _inputs()
        fn(*qkv, mlp).backward()
    finally:
        sdpa.TORCH_SDPA[0] = torch_sdpa
    return seen, [t.grad for t in qkv]


def test_with_cudnn_in_force_the_backward_gets_its_gradient_in_the_outputs_layout():
    sdpa.apply("flash")
    assert sdpa.TORCH_SDPA[0] is None  # PyTorch's own function
    qkv, mlp = _inputs()
    _single_block(*qkv, mlp).backward()
    expected = [t.grad for t in qkv]

    sdpa.apply("cudnn", fallback=True)  # on the CPU the math kernel runs: the layout is what is checked
    assert F.scaled_dot_product_attention is sdpa._sdpa
    seen, grads = _grads_seen_by_the_kernel(_single_block)
    assert seen and all(g == o for g, o in seen), seen  # the slice's strides would be (S*5*H*D, D, 5*H*D, 1)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_without_the_layout_the_kernel_would_get_the_slice():
    """The test above is not vacuous: the same block hands SDPA's output a gradient of other strides."""
    seen = []
    qkv, mlp = _inputs()
    o = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in qkv))
    o.register_hook(lambda g: seen.append((tuple(g.stride()), tuple(o.stride()))))
    torch.cat([o.permute(0, 2, 1, 3).flatten(2, 3), mlp], dim=2).square().sum().backward()
    assert seen[0][0] != seen[0][1]


def test_the_layout_traces_into_one_compiled_graph_and_keeps_the_gradients():
    sdpa.apply("cudnn", fallback=True)
    qkv, mlp = _inputs()
    _single_block(*qkv, mlp).backward()
    eager = [t.grad.clone() for t in qkv]
    torch._dynamo.reset()
    compiled = torch.compile(_single_block, backend="aot_eager", fullgraph=True)  # a graph break raises
    qkv2 = [t.detach().clone().requires_grad_(True) for t in qkv]
    compiled(*qkv2, mlp).backward()
    for a, b in zip((t.grad for t in qkv2), eager, strict=True):
        torch.testing.assert_close(a, b)


def test_switching_cudnn_off_or_restoring_gives_pytorch_its_own_function_back():
    own = F.scaled_dot_product_attention
    prev = sdpa.apply("cudnn")
    assert F.scaled_dot_product_attention is sdpa._sdpa
    sdpa.apply("flash+efficient")
    assert F.scaled_dot_product_attention is own
    sdpa.apply("cudnn")
    sdpa.restore(prev)
    assert F.scaled_dot_product_attention is own
    with torch.no_grad():  # nothing to lay out without a gradient: the kernel's own output
        sdpa.apply("cudnn", fallback=True)
        x = torch.randn(1, 2, 4, 8)
        assert F.scaled_dot_product_attention(x, x, x).grad_fn is None


def test_outer_to_inner_orders_dimensions_by_stride_ties_in_order():
    x = torch.empty(2, 5, 3, 4).permute(0, 2, 1, 3)  # BSHD memory seen as BHSD
    assert sdpa.outer_to_inner(x) == [0, 2, 1, 3]
    assert sdpa.outer_to_inner(torch.empty(1, 1, 3, 4)) == [0, 1, 2, 3]


def test_auto_leaves_the_pick_to_pytorch_among_all_its_kernels_with_the_gradient_laid_out():
    """A run whose self-test passed no kernel: PyTorch may then pick cuDNN (its own first choice on an H100)."""
    sdpa.apply("flash")
    prev = sdpa.apply("auto")
    b = torch.backends.cuda
    assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
            b.math_sdp_enabled()) == (True, True, True, True)
    assert F.scaled_dot_product_attention is sdpa._sdpa
    sdpa.restore(prev)
    assert (b.flash_sdp_enabled(), b.cudnn_sdp_enabled()) == (True, False) and sdpa.TORCH_SDPA[0] is None
