"""On a lent Hopper/Blackwell GPU: FlashAttention 4 (the flash-attn-4 package) against PyTorch's own flash
kernel (FA2) at the families' attention shapes, forward + backward, laid out as diffusers lays them out.

Prints one JSON line per measurement: median ms of forward+backward, the TFLOP/s that makes, and the relative
L2 error of the output and of the three input gradients against an fp32 reference (so both kernels are judged
by the same yardstick). Then one line for a compiled function (torch.compile, inductor) that calls SDPA
with FA4 in force, to show the compiled blocks reach it too.

    python3 tools/fa4_probe.py > fa4.jsonl
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (sequence, heads, head_dim): FLUX.1-dev 1024² (4096 image + 512 text), Qwen-Image 1024²
    "flux-1024": (4608, 24, 128),
    "qwen-image-1024": (4096 + 256, 24, 128),
    "flux-512": (1024 + 512, 24, 128),
}


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def tensors(seq: int, heads: int, hd: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = [torch.randn(1, seq, heads, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    grad = torch.randn(1, seq, heads * hd, device="cuda", dtype=torch.bfloat16, generator=g)
    return base, grad


def run(base, grad, fp32: bool = False):
    """Forward + backward as diffusers calls SDPA: (B, S, H, D) permuted to (B, H, S, D), output flattened."""
    leaves = [(t.float() if fp32 else t).detach().requires_grad_(True) for t in base]
    q, k, v = (t.permute(0, 2, 1, 3) for t in leaves)
    out = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).flatten(2)
    out.backward(grad.float() if fp32 else grad)
    return out.detach().float(), [t.grad.float() for t in leaves]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a - b).norm() / b.norm()), 6)


def timed(fn, repeats: int = 10) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(sorted(times)[len(times) // 2], 3)


def main() -> None:
    import torch.nn.attention as A
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lorakit.hardware import fa4

    say(torch=torch.__version__, gpu=torch.cuda.get_device_name(), registry=hasattr(A, "activate_flash_attention_impl"),
        impls=getattr(A, "list_flash_attention_impls", lambda: [])())
    t0 = time.perf_counter()
    why = fa4.problem()
    say(fa4_problem=why, check_s=round(time.perf_counter() - t0, 2))
    if why:
        return
    for name, (seq, heads, hd) in SHAPES.items():
        base, grad = tensors(seq, heads, hd)
        with sdpa_kernel([SDPBackend.MATH]):
            ref_out, ref_grads = run(base, grad, fp32=True)
        flops = 4 * seq * seq * hd * heads * 3.5  # forward 2 matmuls, backward 2.5x
        for impl in ("FA2", "FA4"):
            try:
                if impl == "FA4":
                    t1 = time.perf_counter()
                    fa4.activate()
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        out, grads = run(base, grad)  # the first call compiles the kernels
                    first = round(time.perf_counter() - t1, 2)
                else:
                    first = None
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out, grads = run(base, grad)
                    ms = timed(lambda b=base, g=grad: run(b, g))
                say(shape=name, impl=impl, ms=ms, tflops=round(flops / ms / 1e9, 1), first_call_s=first,
                    out_rel=rel(out, ref_out), grad_rel=[rel(a, b) for a, b in zip(grads, ref_grads, strict=True)])
            except Exception as e:  # noqa: BLE001 - a failing kernel is a result
                say(shape=name, impl=impl, error=f"{type(e).__name__}: {e}"[:800])
            finally:
                if impl == "FA4":
                    fa4.deactivate()
    # a compiled function reaches FA4 through the same op
    try:
        fa4.activate()
        seq, heads, hd = SHAPES["flux-1024"]
        base, grad = tensors(seq, heads, hd)
        w = torch.randn(heads * hd, heads * hd, device="cuda", dtype=torch.bfloat16) / 60

        @torch.compile
        def block(x):
            q = (x @ w).view(1, seq, heads, hd).permute(0, 2, 1, 3)
            o = F.scaled_dot_product_attention(q, q, q)
            return o.permute(0, 2, 1, 3).flatten(2)

        x = base[0].flatten(2).detach().requires_grad_(True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t1 = time.perf_counter()
            block(x).backward(grad)
            first = round(time.perf_counter() - t1, 2)
            ms = timed(lambda: block(x).backward(grad))
        fa4.deactivate()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch._dynamo.reset()
            ms2 = timed(lambda: block(x).backward(grad))
        say(compiled="flux-1024 projection + SDPA", fa4_ms=ms, fa2_ms=ms2, first_call_s=first)
    except Exception as e:  # noqa: BLE001
        say(compiled_error=f"{type(e).__name__}: {e}"[:800])


if __name__ == "__main__":
    main()
