"""The consumer check a training run makes at every save (the LoRA read back as diffusers and ComfyUI read it),
timed at a family's full size on the CPU: the transformer built on the meta device for its shapes, a rank-16 LoRA
on the preset's modules (session 26: is the check what the swapping runs' 29-37 s final checkpoint spent? No: 2.5-3.9
s for FLUX.2 [dev] on 2 cores).

    python tools/consumer_check_probe.py flux2-dev [attention|attention_mlp|all_linear]
"""

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from lorakit.bench.hub import _build
from lorakit.convert import lora as L
from lorakit.convert import verify as V
from lorakit.convert.patches import LowRank
from lorakit.convert.read import Lora
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_info
from lorakit.train.lora import target_modules


def main(family: str, preset: str = "attention") -> None:
    adapter = family_adapter(family)
    transformer = _build(adapter, "transformer", None, None, "meta")
    names = target_modules(transformer, adapter, preset)
    mods = dict(transformer.named_modules())
    g = torch.Generator().manual_seed(0)
    lora = Lora({n: LowRank(torch.randn(16, mods[n].in_features, generator=g) * 0.01,
                            torch.randn(mods[n].out_features, 16, generator=g) * 0.01, 16.0) for n in names})
    path = Path(tempfile.mkdtemp()) / "lora.safetensors"
    t = time.perf_counter()
    L.write(lora, path, "diffusers", family_info(family).arch)
    written = time.perf_counter() - t
    shapes = V.module_shapes(transformer)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    result = V.check_file(path, family, lora, None, shapes=shapes)
    prof.disable()
    checked = time.perf_counter() - t
    print(f"{family} {preset}: {len(names)} modules; write {written:.2f} s; check {checked:.2f} s on "
          f"{torch.get_num_threads()} threads: {result}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main(*sys.argv[1:])
