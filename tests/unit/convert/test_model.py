import json

import torch
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.io import load


def _run(*args):
    return CliRunner().invoke(app, ["convert", "model", *map(str, args)])


def test_folder_single_file_folder_is_lossless_and_diffusers_loads_it(tiny, tmp_path):
    from diffusers import FluxTransformer2DModel

    src = tiny("flux") / "transformer"
    r = _run(src, tmp_path / "one.safetensors", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["files"] == [str(tmp_path / "one.safetensors")]
    r = _run(tmp_path / "one.safetensors", tmp_path / "sharded", "--shard-gb", "0.0001")
    assert r.exit_code == 0, r.output
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    a, b = load(src), load(tmp_path / "sharded")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # sharded output of a folder keeps its config: diffusers loads it as a model
    r = _run(src, tmp_path / "folder", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    assert {v.dtype for v in load(tmp_path / "folder").values() if v.is_floating_point()} == {torch.bfloat16}
    m = FluxTransformer2DModel.from_pretrained(tmp_path / "folder", torch_dtype=torch.bfloat16)
    assert torch.equal(m.proj_out.weight, a["proj_out.weight"].to(torch.bfloat16))


def test_fp8_with_per_tensor_scales_and_back(tiny, tmp_path):
    src = tiny("qwen-image") / "transformer"
    assert _run(src, tmp_path / "f8.safetensors", "--dtype", "fp8").exit_code == 0
    f8 = load(tmp_path / "f8.safetensors")
    assert "scaled_fp8" in f8
    mats = [k for k, v in f8.items() if v.dtype == torch.float8_e4m3fn and v.dim() == 2]
    assert mats and all(k.removesuffix(".weight") + ".scale_weight" in f8 for k in mats)
    assert _run(tmp_path / "f8.safetensors", tmp_path / "back.safetensors", "--dtype", "fp32").exit_code == 0
    orig, back = load(src), load(tmp_path / "back.safetensors")
    assert orig.keys() == back.keys()
    for k in mats:
        w, w2 = orig[k].float(), back[k].float()
        assert (w2 - w).abs().max() <= w.abs().max() * 2**-4 + 1e-6, k  # e4m3: 3 mantissa bits


def test_refusals_write_nothing(tiny, tmp_path):
    src = tiny("flux") / "transformer"
    (tmp_path / "exists").mkdir()
    for args, words in [((src, tmp_path / "exists"), "exists"), ((src, tmp_path / "x.safetensors", "--dtype", "int4"),
                                                                 "--dtype must be"),
                        ((tmp_path / "missing", tmp_path / "y.safetensors"), "no such file")]:
        r = _run(*args)
        assert r.exit_code == 2 and words in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]
