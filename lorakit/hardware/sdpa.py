"""PyTorch's SDPA backends, and putting one in force for a whole run.

A `with sdpa_kernel(...)` scope around the forward alone does not cover the recompute of a checkpointed block,
which runs in backward outside the scope (and then picks another kernel whose saved tensors differ). So lorakit
puts its choice in force with PyTorch's *global* SDPA switches (`apply`), which hold in forward, backward and
recompute alike.

While cuDNN attention may run, SDPA's output hands its backward a gradient laid out as the output is
(`grad_like_output`). PyTorch (2.11, cuDNN 9.19) keeps each cuDNN backward graph under the query's, key's and
value's sizes and strides only, yet builds it for the first call's grad_output strides; a later call with the same
q/k/v and a grad_output of other strides runs that graph on memory it does not describe. FLUX.1's single blocks
concatenate the attention output with the MLP's (their grad_output is a slice of a wider tensor) while its
double blocks hand a dense one: the backward gave non-finite gradients or an illegal memory access on H100 and
H200 with every block eager, checkpointed or compiled, and its gradients equal flash attention's (0.3-0.5%,
bf16) once every grad_output is laid out like the output (one H200, 2026-11-30: benchmarks-history.md, "cuDNN
attention inside FLUX"; tests/unit/hardware/test_sdpa.py).
"""

from __future__ import annotations

from lorakit.errors import UnknownNameError
from lorakit.hardware import cudnn_op, fa4
from lorakit.hardware.cudnn_op import laid_out, outer_to_inner

BACKENDS = ("flash", "efficient", "cudnn", "math")  # PyTorch's own
ALL_BACKENDS = BACKENDS + ("fa4",)  # fa4: SDPA's flash path through flash-attn-4 (`lorakit.hardware.fa4`)


def sdp_backend(name: str):
    """PyTorch's SDPBackend of one of BACKENDS."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def apply(backend: str | None, fallback: bool = False) -> dict:
    """Put one SDPA backend in force globally (forward, backward and recompute alike); "auto": every one of
    PyTorch's, which then picks per call; None: nothing changes.

    `fallback`: keep the math backend on as the last resort for attention calls the chosen kernel cannot
    take at all. The self-test showed the chosen kernel takes every call of the family's transformer, so
    PyTorch never picks math there; the VAEs' single 512-wide head (FLUX) or 384-wide (Qwen-Image) in the
    sample decode is such a call, and with every other backend off PyTorch fails it ("Invalid backend").

    Returns:
        the previous switch states, for `restore`.
    """
    import torch

    b = torch.backends.cuda
    prev = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled(), "fa4": fa4.active(),
            "grad_like_output": TORCH_SDPA[0] is not None}
    if backend is None:
        return prev
    # "auto": PyTorch picks per call among its own kernels (a run whose self-test passed none)
    names = list(BACKENDS) if backend == "auto" else backend.split("+")  # "flash+efficient": flash unmasked
    for n in names:
        if n not in ALL_BACKENDS:
            raise UnknownNameError("attention backend", n, list(ALL_BACKENDS))
    fa4.activate() if "fa4" in names else fa4.deactivate()
    b.enable_flash_sdp("flash" in names or "fa4" in names)
    b.enable_mem_efficient_sdp("efficient" in names)
    b.enable_cudnn_sdp("cudnn" in names)
    b.enable_math_sdp("math" in names or fallback)
    grad_like_output("cudnn" in names)
    return prev


def restore(prev: dict) -> None:
    """Undo `apply`."""
    import torch

    b = torch.backends.cuda
    b.enable_flash_sdp(prev["flash"])
    b.enable_mem_efficient_sdp(prev["efficient"])
    b.enable_cudnn_sdp(prev["cudnn"])
    b.enable_math_sdp(prev["math"])
    fa4.activate() if prev.get("fa4") else fa4.deactivate()
    grad_like_output(prev.get("grad_like_output", False))


TORCH_SDPA: list = [None]  # PyTorch's own scaled_dot_product_attention while `grad_like_output` is on
_LAYOUT_GRAD: list = [None]  # the autograd Function of `_sdpa` (made on the first `grad_like_output(True)`)


def grad_like_output(on: bool) -> None:
    """Route `torch.nn.functional.scaled_dot_product_attention` (what diffusers' attention calls, looked up at each
    call, compiled blocks included) through `_sdpa` (on), or give PyTorch's own back (off)."""
    import torch.nn.functional as F

    if on and TORCH_SDPA[0] is None:
        _LAYOUT_GRAD[0] = _LAYOUT_GRAD[0] or _layout_grad_function()
        TORCH_SDPA[0] = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _sdpa
    elif not on and TORCH_SDPA[0] is not None:
        F.scaled_dot_product_attention, TORCH_SDPA[0] = TORCH_SDPA[0], None


def _sdpa(query, key, value, *args, **kwargs):
    """PyTorch's SDPA, whose output's gradient reaches the kernel's backward laid out as the output is; the calls
    lorakit's cuDNN operators take (as autocast would cast them), there where they are in use (`cudnn_op`: compiled
    blocks under the C++ wrapper)."""
    if cudnn_op.ROUTE[0]:
        q, k, v = cudnn_op.as_autocast(query, key, value)
        if cudnn_op.takes(q, k, v, *args, **kwargs):
            return cudnn_op.attention(q, k, v, *args, **kwargs)
    out = TORCH_SDPA[0](query, key, value, *args, **kwargs)
    return _LAYOUT_GRAD[0].apply(out) if out.requires_grad and out.dim() == 4 else out


def _layout_grad_function():
    """An identity whose backward copies the gradient into the layout of the forward's tensor (no copy where it
    has that layout already)."""
    import torch

    class LayoutGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.order = outer_to_inner(x)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return laid_out(grad, ctx.order)

    return LayoutGrad
