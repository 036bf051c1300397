"""Full-size single-file conversion, timed (GPU machine; random weights): FLUX.1-dev's transformer written as
flux1-dev.safetensors in Black Forest Labs' layout (what ComfyUI users have), then `lorakit infer FILE --base`'s
first step — `single_file.compose` — converting it into a model folder; the second call's reuse; and the
converted weights checked equal to the originals.  python tools/single_file_full.py WORKDIR > result.json"""

import json
import sys
import time
from pathlib import Path

import torch

from lorakit.io import load, save
from lorakit.models.flux import FluxAdapter
from lorakit.models.native import native_weights
from lorakit.models.single_file import compose


def main(work: Path) -> dict:
    from diffusers import FluxTransformer2DModel

    work.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in FluxTransformer2DModel(**FluxAdapter.full_config).state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {k: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).cpu() for k, s in shapes.items()}
    base = work / "base"
    (base / "transformer").mkdir(parents=True, exist_ok=True)
    (base / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel",
                                                                  **FluxAdapter.full_config}, default=list))
    (base / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    t0 = time.perf_counter()
    file = save({f"model.{k}": v for k, v in native_weights(sd, "flux").items()}, work / "flux1-dev.safetensors")
    wrote = time.perf_counter() - t0
    size = file.stat().st_size
    t0 = time.perf_counter()
    folder, notes = compose(file, base, "flux")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again, _ = compose(file, base, "flux")
    second = time.perf_counter() - t0
    got = load(folder / "transformer")
    equal = got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    return {"file_gb": round(size / 1e9, 2), "write_file_s": round(wrote, 1), "convert_s": round(first, 1),
            "convert_gb_per_s": round(size / 1e9 / first, 2), "reuse_s": round(second, 3),
            "same_folder": again == folder, "equal": equal, "tensors": len(sd), "notes": notes}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1])), indent=1))
