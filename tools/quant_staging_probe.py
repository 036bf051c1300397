"""How fast an 8-bit base reaches the GPU (`quantize_blocks` over a transformer mapped from its files, as
`prepare` and `lorakit infer`'s fp8 placement run it): each block Linear copied straight from the mapping
(pageable), against the same through pinned buffers a worker fills one layer ahead (`io.staging`). The files are
read once first, so both ways read from the page cache.
    bash scripts/device.sh python3 tools/quant_staging_probe.py /tmp/models-0/qwen-image
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from lorakit.io import resolve_files
from lorakit.io.modules import load_component
from lorakit.train import quant


def once(folder: Path, staged: bool) -> tuple[float, float]:
    model = load_component(folder / "transformer", "cpu", torch.bfloat16)
    names = set(quant.block_linears(model))
    size = sum(p.numel() * p.element_size() for n, m in model.named_modules() if n in names for p in m.parameters())
    real = quant.staged
    if not staged:
        quant.staged = lambda *a, **k: None  # every layer copied from the mapping on this thread
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        quant.quantize_blocks(model, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
        s = time.perf_counter() - t
    finally:
        quant.staged = real
    del model
    torch.cuda.empty_cache()
    return s, size


def main(folder: Path) -> None:
    for f in resolve_files(folder / "transformer"):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    for staged in (False, True, False, True):
        s, size = once(folder, staged)
        print(f"{folder.name}: {'staged  ' if staged else 'pageable'} {size / 2**30:.1f} GiB of block Linears "
              f"in {s:.1f} s ({size / 1e9 / s:.2f} GB/s)", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
