"""Every family's whole path in bf16 on the CPU, from a model folder in the hub's layout and dtype (issue #35, 3):
the tensor names the published files use (Qwen2.5-VL's `model.*` / `visual.*`, renamed by transformers while
loading), every weight stored in bf16, `lorakit cache`, `lorakit train` (2 steps) and `lorakit infer` with the
LoRA, as a user runs them — so a dtype or renaming defect shows here, not first on a GPU at full size (Kandinsky 5's
fp32 time embeddings were cast to bf16 and `infer` failed there). On a CPU without bf16 convolution kernels
`infer` runs the VAE in float32 behind bf16 inputs and outputs (`dtypes.float32_inside`), as users' CPUs do."""

import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from lorakit.bench.hub import write_model
from lorakit.cli.app import app
from lorakit.data.demo import demo_layout_for, make_demo_dataset
from lorakit.dtypes import slow_on_cpu
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_names

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.parametrize("family", family_names())
def test_cache_train_and_infer_in_bf16_from_a_hub_layout_folder(tmp_path, family):
    model = tmp_path / "model"
    write_model(family, model, device="cpu", scale="tiny", dtype=torch.bfloat16)
    facts = family_adapter(family)
    data = make_demo_dataset(tmp_path / "data", demo_layout_for(family), count=2, size=64)
    cfg = {"model": {"family": family, "path": str(model), "dtype": "bf16"},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128,
                    **({"control_resolution": 64} if facts.max_controls else {}),
                    **({"frames": 5} if facts.layout == "video" else {})},
           "schedule": {"steps": 2}, "sampling": {"enabled": False}, "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for args in (["cache", str(path)], ["train", str(path)]):
        r = runner.invoke(app, [*args, "--profile", "cpu", "--json"])
        assert r.exit_code == 0, (args[0], r.output[-2000:])
    res = json.loads(r.output)
    assert res["steps"] == 2 and res["consumer_check"]["comfyui"] == "equal"
    assert all(np.isfinite(json.loads(line)["loss"]) for line in (tmp_path / "out" / "metrics.jsonl").open())
    controls = []
    if facts.max_controls:
        controls = ["--image", str(sorted((data / "control").glob("*.png"))[0])]
    if facts.first_frame:  # image-to-video: the clip starts from an image
        Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "first.png")
        controls = ["--image", str(tmp_path / "first.png")]
    r = runner.invoke(app, ["infer", str(model), "-p", "a red circle", "--steps", "2", "--width", "64", "--height", "64",
                            "--lora", res["lora"], "--dtype", "bf16", "--device", "cpu", "--frames", "5",
                            "-o", str(tmp_path / "img"), *controls, "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    out = json.loads(r.output)
    assert out["dtype"] == "bf16" and out["loras"][0]["added_to_weights"] == 0  # applied as peft adapters
    # without bf16 convolution kernels (most CPUs) the VAE computes in float32 behind bf16 (else ~60x slower)
    assert out.get("vae_compute") == ("fp32" if slow_on_cpu("cpu", torch.bfloat16) else None)
    first = out["files"][0]
    if first.endswith(".png"):
        assert np.asarray(Image.open(first)).std() > 0  # a picture, not a constant (NaN) square
