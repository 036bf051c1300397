"""The consumer check every checkpoint runs (`convert.verify.check_file`: the LoRA file read back as diffusers and
ComfyUI read it), at a family's full size, on the CPU, without its weights: the transformer is built on the meta
device for its shapes and the LoRA drawn at random in them. Each round times the check as lorakit runs it (the
products on one thread, `convert.compare.one_thread`) and as it ran before session 28 (on every thread torch has),
alternately, so both see the same host load; medians printed, one JSON line per round with --json.

    python tools/readback_probe.py --family flux2-dev --rounds 3

Run it beside busy processes to see what a loaded host does to the second way (session 28: 56-69 s in a training
process beside three others on a 64-core host).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def lora_for(family: str, targets: str, rank: int):
    """(the LoRA drawn in the full-size transformer's shapes, those shapes)."""
    import torch

    from lorakit.bench.hub import _build
    from lorakit.convert import verify as V
    from lorakit.convert.lora import Lora
    from lorakit.convert.patches import LowRank
    from lorakit.models.base import family_adapter
    from lorakit.train.lora import target_modules

    adapter = family_adapter(family)
    transformer = _build(adapter, "transformer", None, None, "meta")
    shapes = V.module_shapes(transformer)
    g = torch.Generator().manual_seed(0)
    lora = Lora()
    for m in target_modules(transformer, adapter, targets):
        rows, cols = shapes[f"{m}.weight"]
        lora.weights[m] = LowRank(torch.randn(rank, cols, generator=g),
                                  torch.randn(rows, rank, generator=g) * 0.01, float(rank))
    return lora, shapes


@contextmanager
def every_thread(small: bool = True):
    """The comparison as it ran before: torch's thread count left alone."""
    yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="flux2-dev")
    ap.add_argument("--targets", default="attention", help="the LoRA preset (lorakit's default: attention)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch

    from lorakit.convert import compare, verify
    from lorakit.convert import lora as L
    from lorakit.models.registry import family_info

    lora, shapes = lora_for(a.family, a.targets, a.rank)
    ways = {"one thread (lorakit)": compare.one_thread, f"every thread ({torch.get_num_threads()})": every_thread}
    took: dict = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lora.safetensors"
        L.write(lora, path, "diffusers", family_info(a.family).arch)
        for r in range(a.rounds):
            for way, cm in ways.items():
                compare.one_thread = verify.one_thread = cm
                t0 = time.perf_counter()
                result = verify.check_file(path, a.family, lora, None, shapes=shapes)
                took[way].append(time.perf_counter() - t0)
                if a.json:
                    print(json.dumps({"round": r, "way": way, "s": round(took[way][-1], 2), "result": result}))
    print(f"{a.family}, {len(lora.weights)} modules ({a.targets}, rank {a.rank}), {a.rounds} rounds: "
          + "; ".join(f"{w}: median {statistics.median(v):.2f} s (max {max(v):.2f})" for w, v in took.items()))


if __name__ == "__main__":
    main()
