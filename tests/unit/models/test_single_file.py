"""Single-file checkpoints as people have them (FLUX.1's Black Forest Labs file, ComfyUI's all-in-one and split
files, fp8 and scaled fp8), built here from the tiny pipelines, made into a model folder with a named base — and
FLUX's names checked against diffusers' own single-file converter at the real width."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import make_demo_dataset
from lorakit.errors import InputError
from lorakit.io import load, save
from lorakit.io.modules import load_component
from lorakit.models.native import native_weights
from lorakit.models.single_file import compose, transformer_weights


def _lorakit(args, env=None):
    return subprocess.run([sys.executable, "-m", "lorakit", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def _transformer_sd(model_dir, dtype=torch.bfloat16):
    return {k: v.to(dtype) for k, v in load_component(model_dir / "transformer").state_dict().items()}


def _flux_file(model_dir, path, all_in_one=True):
    """flux1-dev.safetensors as ComfyUI's checkpoint loader takes it: BFL names under model.diffusion_model.,
    and (all in one) the VAE and a text encoder beside it."""
    sd = {f"model.{k}": v for k, v in native_weights(_transformer_sd(model_dir), "flux").items()}
    if all_in_one:
        sd.update({f"vae.{k}": v for k, v in load_component(model_dir / "vae").state_dict().items()})
        sd.update({f"text_encoders.clip_l.{k}": v
                   for k, v in load_component(model_dir / "text_encoder").state_dict().items()})
    save(sd, path)
    return path


def _random_transformer(cls, cfg: dict, base) -> dict:
    """Random bf16 weights of a transformer config, and a base folder holding that config (diffusers' single-file
    loader reads the architecture from it)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in cls(**cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    (base / "transformer").mkdir(parents=True)
    (base / "transformer" / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **cfg}))
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


@pytest.mark.slow
def test_flux_original_names_convert_as_diffusers_own_single_file_loader_does(tmp_path):
    """At FLUX's real width (diffusers' converter assumes 3072), one double and one single block."""
    from diffusers import FluxTransformer2DModel

    cfg = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
               num_attention_heads=24, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
               axes_dims_rope=(16, 56, 56))
    sd = _random_transformer(FluxTransformer2DModel, cfg, tmp_path / "base")
    file = save({f"model.{k}": v for k, v in native_weights(sd, "flux").items()}, tmp_path / "flux1-dev.safetensors")
    theirs = FluxTransformer2DModel.from_single_file(str(file), config=str(tmp_path / "base"),
                                                     subfolder="transformer", torch_dtype=torch.bfloat16).state_dict()
    ours, notes = transformer_weights(file, "flux", tmp_path / "base" / "transformer")
    assert set(theirs) == set(ours) == set(sd) and not notes
    assert all(torch.equal(ours[k], theirs[k]) and torch.equal(ours[k], sd[k]) for k in sd)


def test_flux2_original_names_convert_as_diffusers_own_single_file_loader_does(tmp_path):
    """FLUX.2's names (fused double-block qkv, single blocks' linear1/linear2, shared modulations, the final norm's
    swapped halves) against diffusers' convert_flux2_transformer_checkpoint_to_diffusers."""
    from diffusers import Flux2Transformer2DModel

    cfg = dict(patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
               axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
    sd = _random_transformer(Flux2Transformer2DModel, cfg, tmp_path / "base")
    native = native_weights(sd, "flux2")
    assert "diffusion_model.single_stream_modulation.lin.weight" in native
    # BFL publishes FLUX.2 with bare names (diffusers' converter takes no "model.diffusion_model." prefix for it)
    file = save({k.removeprefix("diffusion_model."): v for k, v in native.items()}, tmp_path / "flux2.safetensors")
    theirs = Flux2Transformer2DModel.from_single_file(str(file), config=str(tmp_path / "base"),
                                                      subfolder="transformer", torch_dtype=torch.bfloat16).state_dict()
    assert set(theirs) == set(sd)
    assert all(torch.equal(theirs[k], sd[k]) for k in sd)
    ours, notes = transformer_weights(file, "flux2", tmp_path / "base" / "transformer")  # lorakit's own reading
    assert set(ours) == set(sd) and not notes and all(torch.equal(ours[k], sd[k]) for k in sd)


@pytest.mark.slow
def test_a_comfyui_checkpoint_trains_infers_and_is_converted_once(tmp_path, tiny):
    base = tiny("flux")
    file = _flux_file(base, tmp_path / "flux1-dev-comfy.safetensors")
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(file), "base": str(base)},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 2}, "sampling": {"enabled": False}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {"LORAKIT_CACHE": str(tmp_path / "cache")}
    r = _lorakit(["train", str(tmp_path / "run.yaml"), "--json"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    said = " ".join(json.loads(r.stdout)["warnings"])
    assert "flux1-dev-comfy.safetensors: not used, model.base's are — vae.* (" in said
    assert "text_encoders.clip_l.* (" in said and "converted once to" in said
    folder = tmp_path / "cache" / "models"
    (made,) = list(folder.iterdir())
    assert yaml.safe_load((tmp_path / "out" / "config.resolved.yaml").read_text())["model"]["path"] == str(made)
    got = load_component(made / "transformer").state_dict()
    want = _transformer_sd(base)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (made / "vae").is_symlink() and (made / "vae").resolve() == (base / "vae").resolve()
    stamp = (made / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    inf = _lorakit(["infer", str(file), "--base", str(base), "-p", "a cat", "--steps", "1", "--width", "64",
                    "--height", "64", "--device", "cpu", "--dtype", "fp32", "-o", str(tmp_path / "img"), "--json",
                    "--lora", str(tmp_path / "out" / "lora.safetensors")], env)
    assert inf.returncode == 0, inf.stdout + inf.stderr
    assert json.loads(inf.stdout)["model"] == str(made)  # the same folder, not converted again
    assert (made / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == stamp
    os.utime(file, ns=(stamp + 10**9, stamp + 10**9))  # the file changed: made again, the old folder removed
    dry = _lorakit(["train", str(tmp_path / "run.yaml"), "--dry-run", "--json", "--force"], env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    (again,) = list(folder.iterdir())
    assert again != made and json.loads(dry.stdout)["config"]["model"]["path"] == str(again)


@pytest.mark.slow
def test_a_base_repo_id_needs_no_transformer_download(tmp_path, tiny):
    import shutil

    base = tiny("flux")
    file = _flux_file(base, tmp_path / "flux1-dev.safetensors", all_in_one=False)
    snap = tmp_path / "hub" / "models--black-forest-labs--FLUX.1-dev" / "snapshots" / ("0" * 40)
    shutil.copytree(base, snap, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    for part in ("vae", "text_encoder", "text_encoder_2"):  # everything but the transformer's weights
        shutil.copytree(base / part, snap / part, dirs_exist_ok=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "LORAKIT_CACHE": str(tmp_path / "cache")}
    data = make_demo_dataset(tmp_path / "d", "flat", count=1, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": str(file), "base": "black-forest-labs/FLUX.1-dev"},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = _lorakit(["cache", str(tmp_path / "run.yaml"), "--log-format", "plain"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "convert flux1-dev.safetensors: " in r.stdout and "snapshots/" + "0" * 40 + "'s other components" in r.stdout
    missing = _lorakit(["cache", str(tmp_path / "run.yaml"), "--set", "model.base=Qwen/Qwen-Image"], env)
    assert missing.returncode == 2 and "model.base: Qwen/Qwen-Image is no folder here" in " ".join(
        missing.stderr.split())
    assert "--exclude 'transformer/*.safetensors*'" in missing.stderr


def test_comfyui_split_fp8_and_scaled_fp8_files(tmp_path, tiny):
    base = tiny("qwen-image")
    sd = _transformer_sd(base)
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 else v for k, v in sd.items()}
    save(fp8, tmp_path / "qwen_image_fp8_e4m3fn.safetensors")
    folder, notes = compose(tmp_path / "qwen_image_fp8_e4m3fn.safetensors", base, "qwen-image")
    got = load(folder / "transformer")
    assert all(torch.equal(got[k].float(), fp8[k].float()) for k in sd)
    assert any("weights stored in bfloat16/float8_e4m3fn" in n for n in notes)
    scaled = {f"model.diffusion_model.{k}": v for k, v in fp8.items()}
    lin = next(k for k, v in sd.items() if v.dim() == 2)
    scaled[f"model.diffusion_model.{lin.removesuffix('.weight')}.scale_weight"] = torch.tensor(0.5)
    scaled[f"model.diffusion_model.{lin.removesuffix('.weight')}.scale_input"] = torch.tensor(1.0)
    scaled["model.diffusion_model.scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save(scaled, tmp_path / "qwen_image_fp8_scaled.safetensors")
    folder, notes = compose(tmp_path / "qwen_image_fp8_scaled.safetensors", base, "qwen-image")
    got = load(folder / "transformer")
    assert torch.equal(got[lin], (fp8[lin].float() * 0.5).to(torch.bfloat16)) and lin.removesuffix(".weight") + ".scale_weight" not in got
    assert any("scaled fp8 — 1 weights multiplied by their scale_weight" in n and "1 scale_input values not used"
               in n for n in notes)


@pytest.mark.slow
def test_files_that_do_not_fit_are_refused_by_name(tmp_path, tiny):
    flux, qwen = tiny("flux"), tiny("qwen-image")
    save(_transformer_sd(qwen), tmp_path / "qwen_image_bf16.safetensors")
    with pytest.raises(InputError, match=r"does not fit model.base's transformer .* missing \d+: .*not in the model"):
        compose(tmp_path / "qwen_image_bf16.safetensors", flux, "flux")
    stray = {**{f"model.diffusion_model.{k}": v for k, v in _transformer_sd(qwen).items()},
             "lora_unet_x.alpha": torch.tensor(1.0)}
    save(stray, tmp_path / "odd.safetensors")
    with pytest.raises(InputError, match="1 keys belong to no part lorakit knows .*: lora_unet_x.alpha"):
        compose(tmp_path / "odd.safetensors", qwen, "qwen-image")
    save({"vae.w": torch.zeros(2)}, tmp_path / "vae_only.safetensors")
    with pytest.raises(InputError, match="holds no diffusion transformer"):
        compose(tmp_path / "vae_only.safetensors", qwen, "qwen-image")
    data = make_demo_dataset(tmp_path / "d", "flat", count=1, size=64)
    cfg = {"profile": "cpu", "model": {"family": "qwen-image", "path": str(tmp_path / "qwen_image_bf16.safetensors")},
           "data": {"dirs": [str(data)]}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml"), "--dry-run"])  # the commands in this process
    assert r.exit_code == 2 and "is a single-file checkpoint" in r.stderr and "model.base" in r.stderr, r.stderr
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    r = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml"), "--dry-run", "--set",
                                 f"model.path={tmp_path / 'model.gguf'}"])
    assert r.exit_code == 2 and "GGUF files are quantised for inference engines" in " ".join(r.stderr.split())
    r = CliRunner().invoke(app, ["infer", str(tmp_path / "qwen_image_bf16.safetensors"), "-p", "x"])
    assert r.exit_code == 2 and "--base" in r.stderr and "bug" not in r.stderr, r.stderr


def test_a_killed_conversions_temporary_files_are_swept_by_the_next_one(tmp_path, tiny, monkeypatch):
    """kill -9 during a conversion left its `.tmp` (up to the 23 GB transformer) in the lorakit cache for good: the
    next conversion of the same file removes it under the folder's lock, and a folder a killed conversion of an
    earlier version of the file left unfinished goes once a newer one is made."""
    monkeypatch.setenv("LORAKIT_CACHE", str(tmp_path / "cache"))
    base = tiny("flux")
    file = _flux_file(base, tmp_path / "flux1-dev.safetensors", all_in_one=False)
    root = tmp_path / "cache" / "models"
    from lorakit.models.single_file import _key

    target = root / f"{file.stem}-{_key(file, base)}"
    (target / "transformer").mkdir(parents=True)  # as a kill -9 mid-write leaves it: no marker, a temporary file
    orphan = target / "transformer" / ".diffusion_pytorch_model.safetensors.a1b2c3.tmp"
    orphan.write_bytes(b"x" * 1024)
    stale = root / f"{file.stem}-0123456789ab"  # an earlier version's conversion, killed: no marker either
    (stale / "transformer").mkdir(parents=True)
    (stale / "transformer" / ".diffusion_pytorch_model.safetensors.q9.tmp").write_bytes(b"x")
    folder, _ = compose(file, base, "flux")
    assert folder == target and not orphan.exists() and not list(target.rglob("*.tmp"))
    assert not stale.exists()
