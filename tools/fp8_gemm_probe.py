"""On a lent fp8 GPU (sm_89+): the products `memory.compute: fp8` runs, at the shapes a full-size transformer
gives them, in each way the input gradient could be made — so a change to `train.quant._Fp8Matmul` is chosen
from measurements, not guessed.

The shapes come from the real model: the family's full-size transformer (random weights, on the GPU) with its
block Linears in fp8 (`train.quant.quantize_blocks`), one forward at the resolution with hooks noting each
layer's (tokens, in, out) and whether its input needs a gradient. The model is then freed and each distinct
shape is timed (CUDA events, median of --repeat) and its error measured against float32 products with the
same 8-bit weight (inputs: normal values with a log-normal scale per token and a few large channels, as
activations and gradients have). The totals weigh every shape by how often one step calls it.

Ways of the input gradient g W (W = diag(s) W8): `e5m2` (g rounded to e5m2 per token, full-precision
accumulation: what lorakit did up to now), `e5m2-fast` (Hopper's fast accumulation), `e4m3`, `e4m3-fast`, and
`bf16` (the dequantizing product the fp8-over-8-bit-base path runs). The forward product is timed with and
without fast accumulation. One JSON line per way and a summary line.

    python3 tools/fp8_gemm_probe.py [--family flux] [--res 1024] [--repeat 20] > gemm.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from lorakit.train.quant import _per_row as per_row  # the per-token rounding _Fp8Matmul does


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


DEV = "cuda"


def shapes(family: str, res: int, size: str = "full") -> collections.Counter:
    """(tokens, in, out, needs input grad) -> calls in one forward of the full-size model."""
    from lorakit.bench.ways import build_random, synthetic_batch
    from lorakit.models.base import load_adapter
    from lorakit.train.quant import Float8Linear, quantize_blocks

    dev, dt = DEV, torch.bfloat16
    model = build_random(family, size, dev, dt)
    model.requires_grad_(False)
    quantize_blocks(model, dt, compute="fp8", transposed=True)
    seen: collections.Counter = collections.Counter()

    def note(mod, args):
        x = args[0]
        seen[(x.reshape(-1, x.shape[-1]).shape[0], mod.in_features, mod.out_features, x.requires_grad,
              mod.compute)] += 1

    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.register_forward_pre_hook(note)
    ad, b = load_adapter(family, None), synthetic_batch(family, size, res)
    x = b.latents.to(dev, dt).requires_grad_(True)  # as a LoRA'd model's activations: they need gradients
    text = {k: (v.to(dev, dt).requires_grad_(v.dim() == 3) if v.is_floating_point() else v.to(dev))
            for k, v in b.text.items()}  # the token sequences; not a pooled vector (it feeds the modulations)
    sig = torch.full((x.shape[0],), 0.5, device=dev, dtype=dt)
    out = ad.predict(model, x, sig, text, guidance=1.0)
    del out, model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return seen


def sample(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Normal values, a log-normal scale per row (token) and 1% of the columns 20x larger, in bf16."""
    t = torch.randn(rows, cols, device=DEV, generator=gen)
    t *= torch.exp(torch.randn(rows, 1, device=DEV, generator=gen))
    big = torch.rand(cols, device=DEV, generator=gen) < 0.01
    t[:, big] *= 20
    return t.bfloat16()


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    if DEV != "cuda":  # the script's own check: host clock
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[repeat // 2] * 1e3  # microseconds


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def measure(M: int, K: int, N: int, repeat: int, gen: torch.Generator) -> dict:
    """Microseconds and relative errors of the forward product and each input-gradient way at (M, K) x (K, N)."""
    w = torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5
    s = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    w8 = (w / s[:, None]).to(torch.float8_e4m3fn)
    w8_t = w8.t().contiguous()
    wq = w8.float() * s[:, None]  # the stored weight, exactly
    x, g = sample(M, K, gen), sample(M, N, gen)
    out: dict = {}
    x8, xs = per_row(x, torch.float8_e4m3fn)
    ref = x.float() @ wq.t()
    for fast in (False, True):
        def fwd(fast=fast):
            return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=s[None, :], out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)
        out[f"fwd{'-fast' if fast else ''}"] = (timed(fwd, repeat), rel(fwd(), ref))
    ref = g.float() @ wq
    ones = torch.ones(1, K, device=DEV)

    def grad_mm(g8, gs, fast):
        return torch._scaled_mm(g8, w8_t.t(), scale_a=gs, scale_b=ones, out_dtype=torch.bfloat16, use_fast_accum=fast)

    for fmt, fast in (("e5m2", False), ("e5m2", True), ("e4m3", False), ("e4m3", True)):
        # as _Fp8Matmul.backward: the weight's row scale on g, g rounded per token (timed: the product only)
        g8, gs = per_row(g.float() * s, torch.float8_e5m2 if fmt == "e5m2" else torch.float8_e4m3fn)
        out[fmt + ("-fast" if fast else "")] = (timed(lambda a=g8, b=gs, f=fast: grad_mm(a, b, f), repeat),
                                                rel(grad_mm(g8, gs, fast), ref))

    def bf16():
        return (g * s.bfloat16()) @ w8.bfloat16()
    out["bf16"] = (timed(bf16, repeat), rel(bf16(), ref))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="flux")
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (this script's check)")
    a = p.parse_args()
    global DEV
    DEV = "cpu" if a.tiny else "cuda"
    seen = shapes(a.family, a.res, "tiny" if a.tiny else "full")
    say(family=a.family, res=a.res, device=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu",
        calls=[[*k, n] for k, n in sorted(seen.items())])
    gen = torch.Generator(DEV).manual_seed(0)
    totals: collections.Counter = collections.Counter()
    errs: dict = collections.defaultdict(list)
    for (M, K, N, grad, compute), n in sorted(seen.items()):
        if compute != "fp8":
            continue
        r = measure(M, K, N, a.repeat, gen)
        say(tokens=M, into=K, out=N, calls=n, needs_grad=grad, **{k: [round(t, 1), f"{e:.2e}"] for k, (t, e) in r.items()})
        for way, (t, e) in r.items():
            backward = not way.startswith("fwd")
            if backward and not grad:
                continue
            totals[way] += t * n
            errs[way].append(e)
    say(summary="ms per forward/backward of the step's fp8 products (backward: the products only, not the rounding)",
        **{k: round(v / 1e3, 2) for k, v in totals.items()},
        worst_rel_error={k: f"{max(v):.2e}" for k, v in errs.items()})


if __name__ == "__main__":
    main()
