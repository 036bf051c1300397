"""Where `lorakit infer --offload fp8` spends its time, per full-size transformer (random weights made on the GPU):
one denoising forward at 1024² as the stock pipelines call it (`adapter.predict`, no gradients) in bf16, with
fp8 blocks (`train.quant.Float8Linear`: the row scale on the output), with the earlier fp8 forward (the scale
on the weight), with fp8 blocks under a 24 GiB cap; and the fp8 transformer's move host -> GPU as diffusers'
model offload makes it each image (pageable memory). One JSON line per family.

    python tools/fp8_probe.py [--families flux qwen-image] [--cap 24] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time


def timed(fn, repeat: int) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return round(sorted(times)[len(times) // 2], 4)


def probe(family: str, cap: float, repeat: int, tiny: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from lorakit.bench.ways import build_random, synthetic_batch
    from lorakit.models.base import load_adapter
    from lorakit.train.quant import Float8Linear, quantize_blocks

    dev, dt, size, res = ("cpu", torch.float32, "tiny", 64) if tiny else ("cuda", torch.bfloat16, "full", 1024)
    out = {"family": family}
    model = build_random(family, size, dev, dt)
    ad = load_adapter(family, None)
    b = synthetic_batch(family, size, res)
    x = b.latents.to(dev, dt)
    text = {k: (v.to(dev, dt) if v.is_floating_point() else v.to(dev)) for k, v in b.text.items()}
    sig = torch.full((x.shape[0],), 0.5, device=dev, dtype=dt)

    def fwd():
        with torch.no_grad():
            ad.predict(model, x, sig, text, guidance=1.0)

    out["bf16_s"] = timed(fwd, repeat)
    t = time.perf_counter()
    out["fp8_layers"] = quantize_blocks(model, dt)
    out["quantize_s"] = round(time.perf_counter() - t, 2)
    out["fp8_s"] = timed(fwd, repeat)
    new_forward = Float8Linear.forward
    Float8Linear.forward = lambda self, x_: F.linear(x_.to(self.compute_dtype), self.dequantized(), self.bias)
    out["fp8_scale_on_weight_s"] = timed(fwd, repeat)
    Float8Linear.forward = new_forward
    if tiny:
        return out
    out["fp8_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction(min(cap * 2**30 / total, 1.0), 0)
    try:
        out[f"fp8_cap{cap:g}_s"] = timed(fwd, repeat)
    except torch.OutOfMemoryError as e:
        out[f"fp8_cap{cap:g}_s"] = f"out of memory: {str(e).splitlines()[0][:160]}"
    out["fp8_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    t = time.perf_counter()
    model.to("cpu")
    out["to_cpu_s"] = round(time.perf_counter() - t, 2)
    torch.cuda.empty_cache()
    t = time.perf_counter()
    model.to(dev)
    torch.cuda.synchronize()
    out["to_gpu_pageable_s"] = round(time.perf_counter() - t, 2)
    model = None  # noqa: F841 - freed before the next family
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["flux", "qwen-image"])
    p.add_argument("--cap", type=float, default=24.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="the tiny models on the CPU (this script's check)")
    a = p.parse_args()
    for fam in a.families:
        try:
            print(json.dumps(probe(fam, a.cap, a.repeat, a.tiny)), flush=True)
        except Exception as e:  # noqa: BLE001 - recorded; the next family still runs
            print(json.dumps({"family": fam, "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)


if __name__ == "__main__":
    main()
