"""FlashAttention 4 under SDPA (`memory.attention: fa4`): refused with its reason where it cannot run; on a GPU
where it can, as accurate as PyTorch's own flash kernel in forward and backward, and switched off again."""

import pytest
import torch
import torch.nn.functional as F

from lorakit.hardware import fa4


def test_without_a_gpu_it_says_why_and_stays_off():
    if torch.cuda.is_available() and fa4.problem() is None:
        pytest.skip("FlashAttention 4 runs here")
    assert fa4.problem("cpu") == "attention fa4 runs on CUDA GPUs only"
    assert not fa4.active()
    fa4.deactivate()  # nothing to undo: no error


def _fwd_bwd(base, grad, fp32=False):
    leaves = [(t.float() if fp32 else t).detach().requires_grad_(True) for t in base]
    q, k, v = (t.permute(0, 2, 1, 3) for t in leaves)  # diffusers' layout: strided (B, H, S, D) views
    out = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).flatten(2)
    out.backward(grad.float() if fp32 else grad)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


@pytest.mark.gpu
def test_fa4_matches_the_reference_as_closely_as_pytorchs_flash():
    if not torch.cuda.is_available() or fa4.problem():
        pytest.skip(fa4.problem() or "no GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(1, 1536, 24, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    grad = torch.randn(1, 1536, 24 * 128, device="cuda", dtype=torch.bfloat16, generator=g)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = _fwd_bwd(base, grad, fp32=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fa2 = _fwd_bwd(base, grad)
        fa4.activate()
        try:
            assert fa4.active()
            got = _fwd_bwd(base, grad)
        finally:
            fa4.deactivate()
    assert not fa4.active()
    for a, b, r in zip(got, fa2, ref, strict=True):
        err4, err2 = float((a - r).norm() / r.norm()), float((b - r).norm() / r.norm())
        assert err4 <= 2 * err2 + 1e-3, (err4, err2)
