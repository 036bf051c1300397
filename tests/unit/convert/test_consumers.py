"""The LoRA file lorakit writes gives the same weights in every consumer: diffusers (`load_lora_weights` +
`fuse_lora`, its own code) and ComfyUI (its rules, `convert/comfy.py`), whatever alpha/rank is — DoRA included."""

import pytest
import torch

from lorakit.convert import comfy
from lorakit.convert import lora as L
from lorakit.io.modules import load_component
from lorakit.models.native import native_weights
from lorakit.models.registry import family_info
from tests.loras import trained_like


def _diffusers_fused(tiny, family, lora_path) -> dict:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny(family))
    pipe.load_lora_weights(str(lora_path))
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the fused weights stay
    return {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}


def _comfy(tiny, family, lora_path) -> tuple[dict, dict, set]:
    from lorakit.io import load

    arch = family_info(family).arch
    base = native_weights(load_component(tiny(family) / "transformer").state_dict(), arch)
    sd = load(lora_path, copy=True)
    changed, loaded = comfy.apply(sd, arch, base)
    return base, changed, set(sd) - loaded


def _compare(tiny, family, lora_path, tol=1e-6):
    arch = family_info(family).arch
    want = native_weights(_diffusers_fused(tiny, family, lora_path), arch)
    base, got, not_loaded = _comfy(tiny, family, lora_path)
    # ComfyUI uses every key of the file but peft's DoRA magnitudes (it reads the dora_scale written beside them)
    assert not {k for k in not_loaded if not k.endswith(".lora_magnitude_vector")}, sorted(not_loaded)[:5]
    assert got, "ComfyUI changed nothing"
    worst = 0.0
    for k in want:
        w, g = want[k].double(), got.get(k, base[k]).double()
        b = base[k].double()
        if not torch.equal(want[k], base[k]) or k in got:
            rel = float((g - w).norm() / (w - b).norm().clamp(min=1e-30))  # relative to the change itself
            worst = max(worst, rel)
    assert worst <= tol, worst
    return got


@pytest.mark.parametrize("family", ["flux", "qwen-image", "kandinsky5-t2i", "flux-kontext", "z-image"])
@pytest.mark.parametrize("alpha_of_rank", [2.0, 0.5])
def test_the_default_file_loads_alike_in_diffusers_and_comfyui(tiny, tmp_path, family, alpha_of_rank):
    # every Linear of the blocks, and the latent in/out layers (FLUX's norm_out: swapped halves in the original)
    path = trained_like(tiny, family, tmp_path / "l.safetensors", targets="all_linear", rank=4,
                        alpha=4 * alpha_of_rank, io=True)
    got = _compare(tiny, family, path)
    if family_info(family).arch == "flux":
        assert "diffusion_model.final_layer.adaLN_modulation.1.weight" in got


def test_dora_loads_alike_in_diffusers_and_comfyui_and_converts_exactly(tiny, tmp_path):
    from lorakit.io import load

    path = trained_like(tiny, "flux", tmp_path / "d.safetensors", targets="attention", dora=True, alpha=8)
    sd = load(path)
    assert any(k.endswith(".lora_magnitude_vector") for k in sd) and any(k.endswith(".dora_scale") for k in sd)
    _compare(tiny, "flux", path, tol=1e-5)  # diffusers reads the magnitudes, ComfyUI the dora_scale keys
    base = {k.removesuffix(".weight"): v for k, v in load(tiny("flux") / "transformer").items() if k.endswith("weight")}
    src = L.read(path, base=base)
    assert src.facts["kinds"] == ["dora"]
    for fmt in ("comfyui", "kohya", "diffusers"):
        out = L.write(src, tmp_path / f"{fmt}.safetensors", fmt, "flux", base=base)
        back = L.read(out, base=base)
        assert back.facts["kinds"] == ["dora"] and L.deltas_equal(src, back, base=base)[0], fmt
    with pytest.raises(Exception, match="base weights"):
        L.write(L.read(path), tmp_path / "x.safetensors", "comfyui", "flux")  # without the model: refused


def test_lorakit_infer_applies_dora_as_diffusers_does(tiny, tmp_path):
    """`lorakit infer` on lorakit's own DoRA file used to disagree with diffusers by 1.9e-2."""
    from diffusers import DiffusionPipeline

    from lorakit.infer import add_loras, assemble
    from lorakit.models.base import load_adapter

    path = trained_like(tiny, "flux", tmp_path / "d.safetensors", targets="attention", dora=True, alpha=8)
    ours, _ = assemble(tiny("flux"), "cpu", torch.float32)
    add_loras(ours, [(path, 1.0)], "flux")
    stock = DiffusionPipeline.from_pretrained(tiny("flux"))
    stock.load_lora_weights(str(path))
    a = load_adapter("flux", None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, 8, generator=g)
    text = {"prompt_embeds": torch.randn(1, 7, 32, generator=g), "pooled": torch.randn(1, 32, generator=g)}
    with torch.no_grad():
        va = a.predict(ours.transformer, x, torch.tensor([0.5]), text)
        vb = a.predict(stock.transformer, x, torch.tensor([0.5]), text)
        base = a.predict(load_component(tiny("flux") / "transformer"), x, torch.tensor([0.5]), text)
    assert (va - base).abs().max() > 1e-3
    torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["flux", "flux-kontext"])
def test_dora_on_the_final_norm_loads_alike_in_both_consumers_and_converts_exactly(tiny, tmp_path, family):
    """DoRA with train_io (issue #36, 9): ComfyUI applies `dora_scale` to its own weight's rows, whose halves FLUX's
    final norm stores the other way round; the file used to carry it in diffusers' order (4.8e-2 off in ComfyUI),
    and `convert` said "deltas equal" because it compared lorakit's reading with itself."""
    from lorakit.io import load

    path = trained_like(tiny, family, tmp_path / "d.safetensors", targets="attention", dora=True, alpha=8, io=True)
    got = _compare(tiny, family, path, tol=1e-5)
    assert "diffusion_model.final_layer.adaLN_modulation.1.weight" in got
    base = {k.removesuffix(".weight"): v for k, v in load(tiny(family) / "transformer").items()
            if k.endswith("weight")}
    _compare(tiny, family, L.write(L.read(path, base=base), tmp_path / "re.safetensors", "diffusers", "flux",
                                   base=base), tol=1e-5)  # converted to diffusers again: both consumers alike
    _, original, _ = _comfy(tiny, family, path)
    for fmt in ("comfyui", "kohya"):  # diffusers takes no DoRA from these layouts; ComfyUI reads them as the original
        out = L.write(L.read(path, base=base), tmp_path / f"{fmt}.safetensors", fmt, "flux", base=base)
        _, converted, unused = _comfy(tiny, family, out)
        assert not unused and converted.keys() == original.keys()
        assert all(torch.allclose(converted[k].double(), original[k].double(), rtol=0, atol=1e-6) for k in original)


@pytest.mark.parametrize("family", ["flux2-dev", "flux2-klein"])
def test_flux2_files_load_alike_in_diffusers_and_comfyui(tiny, tmp_path, family):
    """The default file (attention preset + the latent in/out layers: names ComfyUI's FLUX.2 map takes) loads alike
    in both; with the MLPs of the double blocks too, whose diffusers names ComfyUI does not map, the save check says
    so instead of 'equal', and `--to comfyui` (native names) gives ComfyUI exactly what diffusers applies."""
    from lorakit.convert import verify

    path = trained_like(tiny, family, tmp_path / "a.safetensors", targets="attention", io=True)
    got = _compare(tiny, family, path)
    assert "diffusion_model.final_layer.adaLN_modulation.1.weight" in got
    assert any(".linear1." in k for k in got) and any("img_attn.qkv" in k for k in got)

    every = trained_like(tiny, family, tmp_path / "b.safetensors", targets="all_linear", io=True)
    lora = L.read(every)
    said = verify.check_file(every, family, lora)
    assert said["diffusers"] == "equal" and said["comfyui"].startswith(verify.PARTIAL), said
    assert "ff.linear_in" in said["comfyui"] or "ff_context" in said["comfyui"]
    native = L.write(lora, tmp_path / "c.safetensors", "comfyui", "flux2")
    want = native_weights(_diffusers_fused(tiny, family, every), "flux2")
    base, changed, not_loaded = _comfy(tiny, family, native)
    assert not not_loaded
    for k, w in want.items():
        torch.testing.assert_close(changed.get(k, base[k]).double(), w.double(), rtol=1e-5, atol=1e-6)


def test_a_lora_comfyui_reads_only_in_part_is_said_in_the_normal_output_at_train_time_and_convert(tiny, tmp_path):
    """FLUX.2 with every Linear targeted: ComfyUI takes the double blocks' MLPs (and the shared modulation) by their
    native names only, so it applied part of the default diffusers-layout file while `lorakit train` exited 0
    silently and `convert --to diffusers` printed "equal (lorakit, diffusers)". Both now say it in their normal
    output, naming `--to comfyui`, which is exact."""
    import yaml
    from typer.testing import CliRunner

    from lorakit.cli.app import app
    from lorakit.data.demo import make_demo_dataset

    data = make_demo_dataset(tmp_path / "data", "flat", count=2, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux2-klein", "path": str(tiny("flux2-klein"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "lora": {"targets": "all_linear", "rank": 4}, "schedule": {"steps": 1}, "sampling": {"enabled": False},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    cli = CliRunner()
    r = cli.invoke(app, ["train", str(tmp_path / "c.yaml"), "--log-format", "plain"])
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if "ComfyUI reads part of it" in line]
    assert len(said) == 1 and "--to comfyui" in said[0] and "lora.safetensors" in said[0], r.output
    r = cli.invoke(app, ["convert", "lora", str(tmp_path / "out" / "lora.safetensors"),
                         str(tmp_path / "d.safetensors"), "--to", "diffusers"])
    assert r.exit_code == 0 and "ComfyUI reads part of it" in r.output and "--to comfyui" in r.output, r.output
    assert "equal (lorakit, diffusers); comfyui:" in r.output
