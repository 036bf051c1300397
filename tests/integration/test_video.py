"""Video clips for Kandinsky 5 T2V, as a user brings them: .mp4/.webm/.gif files beside their captions, some of
them bad. The check names the bad ones, the cache holds the family VAE's latents of the decoded windows, training
runs with the defaults, and the stock Kandinsky5T2VPipeline with the LoRA reproduces lorakit's predictions."""

import json
import random

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import Scene, draw
from lorakit.data.video import probe, write_clip

FAMILY = "kandinsky5-t2v"


def moving(n: int, size: int = 64, seed: int = 0):
    rng = random.Random(seed)
    s = Scene("circle", rng.choice(["red", "green"]), "blue", "middle", "center", 0.3)
    return [draw(s, size, center=(0.2 + 0.6 * f / (n - 1), 0.5)) for f in range(n)]


def dataset(root):
    clips = root / "clips"
    clips.mkdir(parents=True)
    write_clip(clips / "walk.mp4", moving(20), fps=8)
    write_clip(clips / "drift.webm", moving(17, seed=1), fps=8)
    write_clip(clips / "loop.gif", moving(17, seed=2), fps=8)
    write_clip(clips / "blink.mp4", moving(6), fps=8)  # shorter than the default 17-frame window
    (clips / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)  # a header, then junk
    for stem in ("walk", "drift", "loop", "blink", "broken"):
        (clips / f"{stem}.txt").write_text(f"a circle moving from left to right ({stem})\n", encoding="utf-8")
    return root


@pytest.mark.slow
def test_mp4_clips_cache_train_and_reproduce_in_the_stock_pipeline(tmp_path, tiny):
    from diffusers import DiffusionPipeline

    from lorakit.cache.builder import cache_dir_for
    from lorakit.cache.store import Store
    from lorakit.config import assemble
    from lorakit.data.video import read_window
    from lorakit.io.modules import load_component
    from lorakit.models.base import load_adapter
    from lorakit.models.pixels import to_pixels
    from lorakit.train.data import CachedData
    from lorakit.train.trainer import Trainer

    model = tiny(FAMILY)
    ds = dataset(tmp_path / "data")
    cfg = {"model": {"family": FAMILY, "path": str(model)},  # defaults: 17 frames, the clips' own rate, 1 window
           "data": {"dirs": [str(ds)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 3}, "sampling": {"steps": 2}, "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = CliRunner()

    r = run.invoke(app, ["cache", str(path), "--check", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    named = {p["path"].rsplit("/", 1)[-1]: p["code"] for p in report["problems"]}
    assert named == {"blink.mp4": "too-short", "broken.mp4": "unreadable"}, report["problems"]
    assert report["entries"] == 3 and report["buckets"] == {"64x64x17": 3}
    r = run.invoke(app, ["cache", str(path), "--check"])  # the table names them too
    assert "blink.mp4" in r.output and "too-short" in r.output and "broken.mp4" in r.output
    assert "4 clips, 3 windows ready, 2 problems" in r.output

    r = run.invoke(app, ["cache", str(path), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert (summary["items"], summary["clips"], len(summary["skipped"])) == (3, 3, 2)

    # the cached latents are the family VAE's, of the window's frames as decoded
    pipe = DiffusionPipeline.from_pretrained(model)
    st = Store(cache_dir_for(assemble(path, [], None)[0]))
    manifest = st.read_manifest()
    walk = next(i for i in manifest["items"] if i["stem"] == "walk")
    assert walk["window"]["indices"] == list(range(17)) and walk["label"] == "walk@0s/17f"
    from lorakit.data.video import Window

    frames = read_window(ds / "clips" / "walk.mp4", Window(0.0, tuple(range(17))))
    assert probe(ds / "clips" / "walk.mp4").frames == 20
    pix = to_pixels(frames).permute(1, 0, 2, 3).unsqueeze(0)
    with torch.no_grad():
        want = pipe.vae.encode(pix).latent_dist.mode()[0] * pipe.vae.config.scaling_factor
    got = st.get(walk["key"])["latents"]
    assert got.shape == (16, 5, 8, 8)  # 17 frames -> 5 latent frames
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    r = run.invoke(app, ["train", str(path), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["steps"] == 3 and res["consumer_check"]["diffusers"] == "equal"

    # the stock pipeline with the LoRA, one Euler step from sigma 1: its velocity equals lorakit's
    cfg_obj, _ = assemble(path, [], None)
    a = load_adapter(FAMILY, model)
    data = CachedData(st, manifest, 1, 0)
    tr = Trainer(cfg_obj, a, load_component(model / "transformer"), data, tmp_path / "x", "cpu", torch.float32)
    tr.resume(tmp_path / "out" / "checkpoints" / "final")
    tr.transformer.eval()
    pipe.load_lora_weights(res["lora"])
    pipe.set_progress_bar_config(disable=True)
    b = data.load([walk["key"]])
    noise = torch.randn(b.latents.shape, generator=torch.Generator().manual_seed(0))
    lat = noise.permute(0, 2, 3, 4, 1)
    lat = torch.cat([lat, torch.zeros_like(lat), torch.zeros(*lat.shape[:-1], 1)], dim=-1)
    prompt = walk["caption"]
    with torch.no_grad():
        out = pipe(prompt=prompt, latents=lat.clone(), num_inference_steps=1, height=64, width=64, num_frames=17,
                   guidance_scale=1.0, output_type="latent").frames
        stock = (lat[..., :16] - out[..., :16]).permute(0, 4, 1, 2, 3)
        text = a.encode_prompts([prompt])[0]
        ours = a.predict(tr.transformer, noise, torch.tensor([1.0]),
                         {"prompt_embeds": text["prompt_embeds"][None], "pooled": text["pooled"][None]})
        base = a.predict(load_component(model / "transformer"), noise, torch.tensor([1.0]),
                         {"prompt_embeds": text["prompt_embeds"][None], "pooled": text["pooled"][None]})
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    assert (ours - base).abs().max() > 1e-6  # the LoRA changed the prediction


@pytest.mark.slow
def test_clips_beside_their_captions_cache_as_in_a_clips_folder(tmp_path, tiny):
    """The layout peer trainers take (name.mp4 + name.txt in the dataset folder): the same items, the same cache."""
    import shutil

    model = tiny(FAMILY)
    nested = dataset(tmp_path / "nested")
    flat = tmp_path / "flat"
    shutil.copytree(nested / "clips", flat)
    runner, got = CliRunner(), {}
    for name, ds in (("nested", nested), ("flat", flat)):
        cfg = {"model": {"family": FAMILY, "path": str(model)},
               "data": {"dirs": [str(ds)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
               "output": {"dir": str(tmp_path / f"out-{name}")}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        r = runner.invoke(app, ["cache", str(tmp_path / f"{name}.yaml"), "--json"])
        assert r.exit_code == 0, r.output
        got[name] = json.loads(r.output)
    assert got["flat"]["items"] == got["nested"]["items"] >= 3
    assert got["flat"]["buckets"] == got["nested"]["buckets"]
    assert sorted(p["path"].rsplit("/", 1)[-1] for p in got["flat"]["skipped"]) == sorted(
        p["path"].rsplit("/", 1)[-1] for p in got["nested"]["skipped"])  # the bad clips named alike
