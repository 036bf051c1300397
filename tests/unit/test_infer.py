import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from lorakit.cli.app import app
from tests.loras import trained_like


def _lora(tiny, family, path, alpha=8):
    """A LoRA written by the function `lorakit train` writes with (non-zero B: the LoRA visibly acts)."""
    return trained_like(tiny, family, path, targets="attention_mlp", alpha=alpha, seed=3, scale=0.5)


def _stock(folder, lora, prompt, seed, **kw):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if lora:
        pipe.load_lora_weights(str(lora))
    return pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), **kw).images[0]


@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_infer_equals_stock_pipeline_with_load_lora_weights(tiny, tmp_path, family):
    folder = tiny(family)
    lora = _lora(tiny, family, tmp_path / "l.safetensors")
    r = CliRunner().invoke(app, ["infer", str(folder), "-p", "a red circle", "-p", "a blue square", "--seed", "5",
                                 "--steps", "3", "--width", "64", "--height", "64", "--lora", str(lora),
                                 "-o", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert len(data["files"]) == 2 and data["contact_sheet"] and data["family"] == family
    ours = np.asarray(Image.open(data["files"][1]))
    ref = np.asarray(_stock(folder, lora, "a blue square", 6, num_inference_steps=3, width=64, height=64))
    assert np.array_equal(ours, ref)  # pixel-exact on CPU
    base = np.asarray(_stock(folder, None, "a blue square", 6, num_inference_steps=3, width=64, height=64))
    assert not np.array_equal(ours, base)  # and the LoRA did something
    info = Image.open(data["files"][1]).text
    assert info["lorakit:prompt"] == "a blue square" and info["lorakit:seed"] == "6"
    assert json.loads(info["lorakit:loras"])[0]["sha256_16"] == data["loras"][0]["sha256_16"]


def test_kohya_lora_gives_the_same_images_as_the_diffusers_one(tiny, tmp_path):
    from lorakit.convert import lora as L

    folder = tiny("qwen-image")
    lora = _lora(tiny, "qwen-image", tmp_path / "l.safetensors", alpha=16)
    kohya = L.write(L.read(lora), tmp_path / "k.safetensors", "kohya", "qwen-image")
    outs = []
    for i, f in enumerate((lora, kohya)):
        r = CliRunner().invoke(app, ["infer", str(folder), "-p", "a red circle", "--steps", "2", "--width", "64",
                                     "--height", "64", "--lora", f"{f}:0.7", "-o", str(tmp_path / f"o{i}"), "--json"])
        assert r.exit_code == 0, r.output
        outs.append(np.asarray(Image.open(json.loads(r.output)["files"][0])).astype(int))
    assert np.abs(outs[0] - outs[1]).max() <= 1


def test_infer_bad_inputs(tiny, tmp_path):
    folder = tiny("flux")
    other = _lora(tiny, "qwen-image", tmp_path / "q.safetensors")
    cases = [
        ([str(tmp_path), "-p", "x"], "not a diffusers model folder"),
        ([str(folder)], "no prompt"),
        ([str(folder), "-p", "x", "--lora", str(tmp_path / "none.safetensors")], "no such file"),
        ([str(folder), "-p", "x", "--lora", f"{other}:abc"], "must be a number"),
        ([str(folder), "-p", "x", "--lora", str(other)], "is a qwen-image LoRA"),
        ([str(folder), "-p", "x", "--image", str(other)], "not a readable image"),
        ([str(folder), "-p", "x", "--width", "100"], "multiples of 16"),
    ]
    for args, words in cases:
        r = CliRunner().invoke(app, ["infer", *args, "-o", str(tmp_path / "bad"), "--steps", "1"])
        assert r.exit_code == 2 and words in r.output, (args, r.output)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
