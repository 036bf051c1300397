"""cuDNN attention as lorakit's own operator pair, for compiled code that calls kernels from C++.

Inductor's C++ wrapper (`memory.cpp_wrapper`) launches a compiled block's kernels from C++ instead of Python. PyTorch's
cuDNN attention carries a random-state tag (it can drop out), and where a block's recompute is compiled into its
backward (`memory.compiled_recompute`) the compiler wraps every tagged operation it recomputes in an operator that
replays the random state — one the C++ wrapper cannot call (torch 2.11: "AssertionError: GraphSafeRunWithRngState").
lorakit's attention never drops out, so here the same cuDNN kernels run as two untagged operators,
`lorakit::cudnn_attention` and its backward, which the compiler recomputes as any other call.

The forward calls `aten._scaled_dot_product_cudnn_attention` (the kernel PyTorch's SDPA runs when cuDNN is in force)
and keeps its log-sum-exp for the backward, `aten._scaled_dot_product_cudnn_attention_backward`; the gradient of
the output reaches that kernel laid out as the output is (`outer_to_inner`; PyTorch's own path: `sdpa._sdpa`).
Only calls this pair takes are routed here (`takes`): 4-D bf16/fp16 CUDA tensors, one head size up to 128 (a
multiple of 8), no dropout, no grouped heads, a boolean or floating mask; anything else runs PyTorch's SDPA.
"""

from __future__ import annotations

import functools
import math

ROUTE: list = [False]  # on: `sdpa._sdpa` sends the calls `takes` accepts here (`use`)


def use(on: bool) -> None:
    """Route cuDNN attention through lorakit's operators (on) or PyTorch's SDPA (off); see `sdpa.grad_like_output`.
    The operators are registered here, before any compile: registering them from code torch.compile traces breaks
    the block's graph in two ("Library.__init__ should not be traced") and its pieces then ran 1.6 s a step against
    0.46 (Qwen-Image 1024², rtx4090 settings, one H200, 2026-12-02)."""
    if on:
        ops()
    ROUTE[0] = bool(on)


def takes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> bool:
    """Does the call suit `attention`? Plain comparisons of sizes and types, which torch.compile traces."""
    import torch

    if dropout_p or enable_gqa or not all(t.dim() == 4 and t.is_cuda for t in (query, key, value)):
        return False
    d = query.size(-1)
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if key.size(-1) != d or value.size(-1) != d or d > 128 or d % 8 or key.size(1) != query.size(1):
        return False
    if attn_mask is not None and (is_causal or attn_mask.dim() != 4 or not (
            attn_mask.dtype == torch.bool or attn_mask.is_floating_point())):
        return False
    return True


def as_autocast(query, key, value) -> tuple:
    """The query, key and value as autocast hands them to PyTorch's SDPA where it is on for their device: fp32 ones
    in autocast's dtype. lorakit's operators have no autocast rule of their own and `takes` only bf16/fp16: a block
    whose normalized query stays fp32 (a norm's fp32 weight) would otherwise go to PyTorch's cuDNN attention after
    autocast's cast, which a recompute compiled under the C++ wrapper cannot call (tiny Qwen-Image's fp32 norms on
    one H200, 2026-12-02). Plain calls and comparisons, which torch.compile traces."""
    import torch

    kind = query.device.type
    if not torch.is_autocast_enabled(kind):
        return query, key, value
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in (query, key, value))


def outer_to_inner(t) -> list[int]:
    """The dimensions of `t` from the largest stride to the smallest, ties in order (as PyTorch lays out a
    grad_output to match an output); plain comparisons, which torch.compile traces."""
    order: list[int] = []
    for d in range(t.dim()):
        i = len(order)
        while i > 0 and t.stride(order[i - 1]) < t.stride(d):
            i -= 1
        order.insert(i, d)
    return order


def laid_out(grad, order: list[int]):
    """`grad` copied into the layout `outer_to_inner` gave `order` for (no copy where it has that layout already)."""
    return grad.permute(order).contiguous().permute([order.index(d) for d in range(len(order))])


def bias_of(mask, dtype):
    """An attention mask as the additive bias cuDNN takes: a boolean mask's False -> -inf, True -> 0 (as PyTorch's
    SDPA converts it); a floating mask in the query's dtype."""
    import torch

    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
    return mask.to(dtype)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA (its signature) through lorakit's cuDNN operators: a call `takes` accepts (no dropout, no grouped
    heads)."""
    import torch

    return torch.ops.lorakit.cudnn_attention(query, key, value, bias_of(attn_mask, query.dtype), is_causal, scale)[0]


@functools.cache
def ops():
    """The forward and backward operators (registered with torch on first use)."""
    import torch

    aten = torch.ops.aten

    def cudnn(q, k, v, bias, is_causal, scale):  # the output and its log-sum-exp (PyTorch's meta function too)
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, is_causal, False, scale=scale)
        return out[0], out[1]

    forward = torch.library.custom_op("lorakit::cudnn_attention", cudnn, mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor? bias, bool is_causal, float? scale) -> (Tensor, Tensor)"))
    forward.register_fake(cudnn)

    @torch.library.custom_op("lorakit::cudnn_attention_backward", mutates_args=(), schema=(
        "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? bias, bool is_causal, "
        "float? scale) -> (Tensor, Tensor, Tensor)"))
    def backward(grad, q, k, v, out, lse, bias, is_causal, scale):
        grad = laid_out(grad, outer_to_inner(out))  # as the output is laid out (the kernel reads it so)
        none = torch.empty((), dtype=torch.int64, device=q.device)  # the dropout's seed and offset: unused
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, none, none, bias, None, None, q.size(2), k.size(2), 0.0, is_causal,
            scale=scale)
        return dq, dk, dv

    @backward.register_fake
    def _(grad, q, k, v, out, lse, bias, is_causal, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, bias, is_causal, scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], bias)
        ctx.is_causal, ctx.scale = is_causal, scale

    def grads(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, bias, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None

    forward.register_autograd(grads, setup_context=setup_context)
    return forward, backward
