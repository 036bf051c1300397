"""The tiny pipelines are real: stock diffusers loads each folder and generates an output."""

import hashlib
import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

from lorakit.models.registry import family_info, family_names
from lorakit.models.tiny import build_tiny

EXPECTED_SHAPE = {  # (batch, [frames,] height, width, channels) of output_type="np"
    "flux": (1, 64, 64, 3), "qwen-image": (1, 64, 64, 3), "qwen-image-edit": (1, 64, 64, 3),
    "qwen-image-edit-plus": (1, 64, 64, 3), "qwen-image-edit-2511": (1, 64, 64, 3), "z-image": (1, 64, 64, 3),
    # Kandinsky 5 T2I only accepts its listed sizes; the tiny VAE decodes 1024² requests to 1024²
    "kandinsky5-t2i": (1, 1024, 1024, 3), "kandinsky5-t2v": (1, 5, 64, 64, 3), "flux-kontext": (1, 64, 64, 3),
    "flux2-dev": (1, 64, 64, 3), "flux2-klein": (1, 64, 64, 3), "flux2-dev-edit": (1, 64, 64, 3),
    "flux2-klein-edit": (1, 64, 64, 3), "wan2.1-t2v": (1, 5, 64, 64, 3), "wan2.2-t2v": (1, 5, 64, 64, 3),
    "wan2.2-i2v": (1, 5, 64, 64, 3), "wan2.2-ti2v-5b": (1, 5, 64, 64, 3),
    "qwen-image-2.1": (1, 64, 64, 4),  # RGBA: its VAE decodes an alpha channel
}


def _call_kwargs(family):
    kw = dict(prompt="a red circle in the center on a blue background", num_inference_steps=2,
              generator=torch.Generator().manual_seed(0), output_type="np")
    if family == "kandinsky5-t2i":
        kw.update(height=1024, width=1024)
    elif family == "kandinsky5-t2v" or family.startswith("wan"):
        kw.update(height=64, width=64, num_frames=5)
    else:
        kw.update(height=64, width=64)
    red = Image.new("RGB", (64, 64), (220, 40, 40))
    if family in ("qwen-image-edit", "wan2.2-i2v"):  # Wan I2V: the first frame
        kw["image"] = red
    elif family == "flux-kontext":
        # it scales the output to max_area and the control to a preferred 1024-class size unless told not to
        kw.update(image=red, _auto_resize=False, max_area=64 * 64)
    elif family_info(family).variant.endswith("-edit"):  # FLUX.2: reference images of their own sizes
        kw["image"] = [red, Image.new("RGB", (96, 64), (40, 80, 220))]
    elif family_info(family).variant == "edit-plus":
        kw["image"] = [red, Image.new("RGB", (64, 64), (40, 80, 220))]
    return kw


@pytest.mark.slow
@pytest.mark.parametrize("family", family_names())
def test_stock_diffusers_loads_and_generates(tiny, family):
    from diffusers import DiffusionPipeline

    folder = tiny(family)
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    assert type(pipe).__name__ == family_info(family).pipeline_class
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**_call_kwargs(family))
    arr = next(getattr(out, a) for a in ("images", "image", "frames") if getattr(out, a, None) is not None)
    arr = np.asarray(arr)
    assert arr.shape == EXPECTED_SHAPE[family]
    assert np.isfinite(arr).all() and arr.std() > 0  # random weights draw something, not a constant


@pytest.mark.parametrize("family", family_names())
def test_folder_layout_sharded_transformer_and_size(tiny, family):
    folder = tiny(family)
    index = json.loads((folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((folder / "transformer" / s).is_file() for s in shards)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == family_info(family).pipeline_class
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < 30 * 2**20
    assert not list(folder.rglob("*.bin")) and not list(folder.rglob("*.pt"))


def _digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix in (".safetensors", ".json", ".txt") and p.name != "lorakit_tiny.json":
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_the_t5_tokenizer_is_the_same_in_every_build():
    """Its trainer orders pieces of one score, and numbers the characters it adds last, differently each time: FLUX's
    and Wan's tiny models, and `make demo`'s losses, changed between two builds until the vocabulary had one order."""
    from lorakit.models.tiny import t5_tokenizer

    built = {t5_tokenizer().backend_tokenizer.to_str() for _ in range(4)}
    assert len(built) == 1


@pytest.mark.slow
def test_build_is_deterministic_and_fast(tmp_path):
    t0 = time.perf_counter()
    a = build_tiny("qwen-image-edit-plus", tmp_path / "a", seed=0)
    assert time.perf_counter() - t0 < 30
    b = build_tiny("qwen-image-edit-plus", tmp_path / "b", seed=0)
    c = build_tiny("qwen-image-edit-plus", tmp_path / "c", seed=1)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)
    assert _digest(build_tiny("flux", tmp_path / "f1")) == _digest(build_tiny("flux", tmp_path / "f2"))  # T5 inside
