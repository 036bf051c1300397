"""The consumer check a training run makes at every save (the LoRA read back as diffusers and ComfyUI read it),
timed at a family's full size on the CPU: the transformer built on the meta device for its shapes, a rank-16 LoRA
on the preset's modules. Session 26 asked whether it was what the swapping runs' 29-37 s final checkpoints spent
(2.5-3.9 s for FLUX.2 [dev] on 2 idle cores: no). Session 28 found it was, on a busy host: its thousands of small
products split over every core waited for threads the host did not schedule (56-69 s beside three other trainings
on 64 cores); lorakit now runs them on one thread (`convert.compare.one_thread`).

    python tools/consumer_check_probe.py flux2-dev [attention|attention_mlp|all_linear]            # one profiled check
    python tools/consumer_check_probe.py flux2-dev attention --rounds 3 [--json]                     # the two ways

With --rounds, each round times the check as lorakit runs it (one thread) and as it ran before session 28 (every
thread torch has), alternately, so that both see the same host load; medians printed. Run it beside busy processes.
"""

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from lorakit.bench.hub import _build
from lorakit.convert import compare
from lorakit.convert import lora as L
from lorakit.convert import verify as V
from lorakit.convert.patches import LowRank
from lorakit.convert.read import Lora
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info
from lorakit.train.lora import target_modules


@contextmanager
def every_thread(small: bool = True):
    """The comparison as it ran before session 28: torch's thread count left alone."""
    yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("preset", nargs="?", default="attention")
    ap.add_argument("--rounds", type=int, default=0, help="time the two ways this many times each (0: one profiled check)")
    ap.add_argument("--json", action="store_true", help="with --rounds: one JSON line per check")
    a = ap.parse_args()
    adapter = family_adapter(a.family)
    transformer = _build(adapter, "transformer", None, None, "meta")
    names = target_modules(transformer, adapter, a.preset)
    mods = dict(transformer.named_modules())
    g = torch.Generator().manual_seed(0)
    lora = Lora({n: LowRank(torch.randn(16, mods[n].in_features, generator=g) * 0.01,
                            torch.randn(mods[n].out_features, 16, generator=g) * 0.01, 16.0) for n in names})
    path = Path(tempfile.mkdtemp()) / "lora.safetensors"
    t = time.perf_counter()
    L.write(lora, path, "diffusers", family_info(a.family).arch)
    written = time.perf_counter() - t
    shapes = V.module_shapes(transformer)
    if a.rounds:
        ways = {"one thread (lorakit)": compare.one_thread, f"every thread ({torch.get_num_threads()})": every_thread}
        took: dict = {w: [] for w in ways}
        for r in range(a.rounds):
            for way, cm in ways.items():
                compare.one_thread = V.one_thread = cm
                t = time.perf_counter()
                result = V.check_file(path, a.family, lora, None, shapes=shapes)
                took[way].append(time.perf_counter() - t)
                if a.json:
                    print(json.dumps({"round": r, "way": way, "s": round(took[way][-1], 2), "result": result}))
        print(f"{a.family} {a.preset}: {len(names)} modules, {a.rounds} rounds: " + "; ".join(
            f"{w}: median {statistics.median(v):.2f} s (max {max(v):.2f})" for w, v in took.items()))
        return
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    result = V.check_file(path, a.family, lora, None, shapes=shapes)
    prof.disable()
    checked = time.perf_counter() - t
    print(f"{a.family} {a.preset}: {len(names)} modules; write {written:.2f} s; check {checked:.2f} s "
          f"(torch's threads: {torch.get_num_threads()}; the check's products on one): {result}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
