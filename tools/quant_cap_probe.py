"""Why an 8-bit base took 27 s to prepare inside a Qwen-Image rtx4090 run and 1.4-1.7 s in
tools/quant_staging_probe.py (session 21): the same `quantize_blocks` over block Linears in host memory (16 blocks of
Qwen-Image-sized Linears, 3.4 GiB bf16), with the GPU already holding 20 GiB as a 24 GiB card would near the end
of the base, under each allocator setting (default, expandable_segments) and without / with a 24 GiB cap
(`set_per_process_memory_fraction`, as LORAKIT_MEMORY_CAP_GIB applies it). One process per case. Not run yet.
    PYTHONPATH=. python3 tools/quant_cap_probe.py      (torch alone; no model folder)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def case() -> None:
    import torch

    from lorakit.train.quant import quantize_blocks

    cap = float(os.environ["CAP"])
    if cap:
        torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.get_device_properties(0).total_memory, 0)
    m = torch.nn.Module()
    m.transformer_blocks = torch.nn.ModuleList()
    with torch.device("meta"):
        for _ in range(16):
            b = torch.nn.Module()
            b.a, b.b = torch.nn.Linear(3072, 12288), torch.nn.Linear(12288, 3072)
            b.c, b.d = torch.nn.Linear(3072, 3072), torch.nn.Linear(3072, 9216)
            m.transformer_blocks.append(b)
    m.to_empty(device="cpu")
    m.to(torch.bfloat16)
    for p in m.parameters():
        p.data.normal_()
    size = sum(p.numel() * p.element_size() for p in m.parameters())
    held = torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda")  # noqa: F841 - what the card already holds
    torch.cuda.synchronize()
    t = time.perf_counter()
    quantize_blocks(m, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    print(f"allocator {os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'default'}, cap {cap or 'none'}: "
          f"{size / 2**30:.1f} GiB in {s:.2f} s ({size / 1e9 / s:.2f} GB/s), "
          f"reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        case()
    else:
        for alloc in ("", "expandable_segments:True"):
            for cap in ("0", "24"):
                subprocess.run([sys.executable, __file__, "case"], timeout=120,
                               env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc, CAP=cap))
