"""AdamWBf16's update of one tensor, in one pass over its memory.

The update reads the weight, its gradient and both moments once and writes the weight and the moments once:
14 bytes per bf16 parameter. Written as PyTorch operations it makes a dozen fp32 temporaries and as many kernels
per parameter; on a GPU it is one Triton kernel (`update`), elsewhere the same arithmetic in PyTorch
(`update_reference`). Both round the new weight to bf16 stochastically with the same noise, a counter-based hash of
(seed, step, parameter number, element index): no generator state to save, a resumed run draws exactly what the
uninterrupted one drew, and the element index is the element's place in the whole parameter, so FSDP shards on any
number of ranks draw what one process draws.
"""

from __future__ import annotations

import functools

MASK32 = 0xFFFFFFFF
# a 32-bit integer hash (xor-shift-multiply, 16/15/15 shifts) whose multipliers are below 2**31, so that PyTorch's
# int64 products of a 32-bit value never overflow
MUL1, MUL2 = 0x21F0AAAD, 0x735A2D97


def mix32(x):
    """The 32-bit hash of a Python int, or of each element of an int64 tensor."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 15)


def noise_key(seed: int, step: int, number: int) -> int:
    """The 32-bit key of one parameter's rounding noise at one optimizer step."""
    return mix32(mix32(mix32(seed) ^ step) ^ number)


def noise_reference(index, key: int):
    """16 random bits per element index (int64 tensor), in PyTorch: what the kernel draws."""
    return mix32(mix32(index) ^ key) & 0xFFFF


def round_with(x, noise):
    """fp32 -> bf16: add 16 random low bits to the fp32 pattern, keep the top 16 (rounds up with probability equal
    to the distance to the lower bf16 value; bf16 values stay as they are)."""
    import torch

    bits = x.contiguous().view(torch.int32)
    return ((bits + noise.to(torch.int32)) & -65536).view(torch.float32).to(torch.bfloat16)


def update_reference(w, g, m, v, *, lr, b1, b2, eps, weight_decay, step, key, offset=0):
    """One AdamW step of a weight `w` (bf16 or fp32, updated in place) with bf16 moments `m`, `v`; fp32 math."""
    import torch

    gf = g.float()
    mf = m.float().mul_(b1).add_(gf, alpha=1 - b1)
    vf = v.float().mul_(b2).addcmul_(gf, gf, value=1 - b2)
    m.copy_(mf)
    v.copy_(vf)
    denom = (vf / (1 - b2 ** step)).sqrt_().add_(eps)
    new = w.float().mul_(1 - lr * weight_decay)
    new.addcdiv_(mf, denom, value=-lr / (1 - b1 ** step))
    if w.dtype == torch.bfloat16:
        index = torch.arange(offset, offset + w.numel(), dtype=torch.int64, device=w.device).view(w.shape)
        w.copy_(round_with(new, noise_reference(index, key)))
    else:
        w.copy_(new)


@functools.cache
def kernel():
    """The Triton kernel (built on first use; None where Triton is missing)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _adamw(w_ptr, g_ptr, m_ptr, v_ptr, n, offset, lr, b1, b2, eps, decay, c1, c2, key,
               ROUND: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = at < n
        g = tl.load(g_ptr + at, mask=keep).to(tl.float32)
        m = tl.load(m_ptr + at, mask=keep).to(tl.float32) * b1 + (1 - b1) * g
        v = tl.load(v_ptr + at, mask=keep).to(tl.float32) * b2 + (1 - b2) * g * g
        tl.store(m_ptr + at, m.to(tl.bfloat16), mask=keep)
        tl.store(v_ptr + at, v.to(tl.bfloat16), mask=keep)
        w = tl.load(w_ptr + at, mask=keep).to(tl.float32) * decay
        new = w - (lr / c1) * m / (tl.sqrt(v / c2) + eps)
        if ROUND:
            h = ((at + offset) & 0xFFFFFFFF).to(tl.uint32)  # the element's index, hashed (mix32 twice)
            for salt in tl.static_range(2):
                h = h ^ (h >> 16)
                h = h * 0x21F0AAAD
                h = h ^ (h >> 15)
                h = h * 0x735A2D97
                h = h ^ (h >> 15)
                if salt == 0:
                    h = h ^ key.to(tl.uint32)
            noise = h & 0xFFFF
            bits = new.to(tl.uint32, bitcast=True) + noise
            new = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(w_ptr + at, new.to(w_ptr.dtype.element_ty), mask=keep)

    return _adamw


BLOCK = 2048


def usable(*tensors) -> bool:
    """Can the kernel update these tensors (contiguous, on a CUDA device, Triton installed)?"""
    return all(t.is_cuda and t.is_contiguous() for t in tensors) and kernel() is not None


def update(w, g, m, v, *, lr, b1, b2, eps, weight_decay, step, key, offset=0):
    """`update_reference` as one kernel (the tensors must be `usable`)."""
    import torch

    n = w.numel()
    if n == 0:
        return
    kernel()[(-(-n // BLOCK),)](w, g, m, v, n, offset, float(lr), float(b1), float(b2), float(eps),
                                float(1 - lr * weight_decay), float(1 - b1 ** step), float(1 - b2 ** step), key,
                                ROUND=w.dtype == torch.bfloat16, BLOCK=BLOCK)
