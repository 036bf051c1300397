"""The cache: pipeline-equal values, content addressing, resume after kill -9, verify, force."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.config import validate
from lorakit.data.demo import make_demo_dataset
from lorakit.io import read_header
from lorakit.plan.resolve import resolve


def config(tmp_path, family, model, data, **data_kw):
    return validate({"profile": "cpu", "model": {"family": family, "path": str(model), "dtype": "fp32"},
                     "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32,
                              "bucket_max_side": 128, **data_kw},
                     "output": {"dir": str(tmp_path / "out")}})


def entries(cfg):
    m = json.loads((cache_dir_for(cfg) / "manifest.json").read_text())
    return m, {i["stem"]: Store(cache_dir_for(cfg)).get(i["key"]) for i in m["items"]}


def test_flux_cache_equals_the_pipeline_and_is_content_addressed(tmp_path, tiny):
    from diffusers import DiffusionPipeline
    from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

    from lorakit.data.buckets import fit
    from lorakit.data.images import open_image

    data = make_demo_dataset(tmp_path / "d", "flat", count=5, size=64)
    cfg = config(tmp_path, "flux", tiny("flux"), data)
    s = build(cfg)
    assert (s.items, s.encoded, s.reused) == (5, 5, 0)
    manifest, cached = entries(cfg)
    pipe = DiffusionPipeline.from_pretrained(tiny("flux"))
    item = manifest["items"][2]
    with torch.no_grad():
        e, p, _ = pipe.encode_prompt(prompt=[item["caption"]], prompt_2=None, max_sequence_length=512)
        im = fit(open_image(item["source"]), tuple(item["bucket"]))
        pix = pipe.image_processor.preprocess(im)
        lat = retrieve_latents(pipe.vae.encode(pix), sample_mode="argmax")
        lat = (lat - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    got = cached[item["stem"]]
    torch.testing.assert_close(got["prompt_embeds"], e[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["pooled"], p[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["latents"], lat[0], rtol=1e-5, atol=1e-5)
    assert Store(cache_dir_for(cfg)).has(manifest["empty_caption"])

    # one caption changes -> exactly that item is encoded again; the stale entry is removed
    (data / "item_001.txt").write_text("a purple ring at the top right on a white background\n")
    s = build(cfg)
    assert (s.encoded, s.reused, s.pruned) == (1, 4, 1)
    # nothing changes -> nothing is encoded
    assert build(cfg).encoded == 0
    # --force re-encodes all
    assert build(cfg, force=True).encoded == 5
    # another model (a different random seed) -> everything is encoded again
    from lorakit.models.tiny import tiny_pipeline

    other = config(tmp_path, "flux", tiny_pipeline("flux", seed=1, root=tmp_path / "m"), data)
    assert build(other).encoded == 5


def test_verify_finds_and_rebuilds_a_damaged_entry(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "d", "flat", count=3, size=64)
    cfg = config(tmp_path, "flux", tiny("flux"), data)
    build(cfg)
    manifest, _ = entries(cfg)
    victim = Store(cache_dir_for(cfg)).path(manifest["items"][0]["key"])
    blob = bytearray(victim.read_bytes())
    h = read_header(victim)
    lat = h.tensors["latents"]
    start = h.data_start + lat.begin
    blob[start:start + 4] = b"\xff\xff\xff\x7f"  # a NaN where a latent was
    victim.write_bytes(bytes(blob))
    s = build(cfg, verify=True)
    assert s.verified_bad == [manifest["items"][0]["key"]] and s.encoded == 1
    assert build(cfg, verify=True).verified_bad == []


@pytest.mark.slow
def test_edit_plus_and_video_entries(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "e", "edit-plus", count=2, size=64)
    cfg = config(tmp_path, "qwen-image-edit-plus", tiny("qwen-image-edit-plus"), data, caption_dropout=0.1)
    assert build(cfg).encoded == 2
    _, cached = entries(cfg)
    e = next(iter(cached.values()))
    assert set(e) == {"prompt_embeds", "empty_prompt_embeds", "latents", "control_latents_0", "control_latents_1"}
    # controls are encoded as the stock pipeline encodes them: 1024² area at their aspect ratio, whatever the
    # target's bucket (data.control_resolution trades that for memory)
    assert e["latents"].shape == (16, 8, 8) and e["control_latents_1"].shape == (16, 128, 128)
    small = config(tmp_path / "s", "qwen-image-edit-plus", tiny("qwen-image-edit-plus"), data, control_resolution=64)
    assert build(small).encoded == 2
    assert next(iter(entries(small)[1].values()))["control_latents_0"].shape == (16, 8, 8)

    vdata = make_demo_dataset(tmp_path / "v", "video", count=2, size=64, frames=6)  # .mp4 clips of 6 frames
    vcfg = config(tmp_path / "vv", "kandinsky5-t2v", tiny("kandinsky5-t2v"), vdata, frames=5, windows=2)
    s = build(vcfg)
    assert (s.encoded, s.clips, s.skipped) == (4, 2, [])  # two windows of 5 frames per clip (starts 0 and 1)
    m, _ = entries(vcfg)
    assert sorted(i["label"] for i in m["items"])[:2] == ["clip_000@0.125s/5f", "clip_000@0s/5f"]
    v = Store(cache_dir_for(vcfg)).get(m["items"][0]["key"])
    assert v["latents"].shape[:2] == (16, 2)  # 5 frames (4k+1) -> 2 latent frames
    assert v["pooled"].shape == (32,)


@pytest.mark.slow
def test_kill_9_mid_build_then_resume(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "d", "flat", count=16, size=64)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "profile": "cpu", "model": {"family": "flux", "path": str(tiny("flux"))},
        "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
        "output": {"dir": str(tmp_path / "out")}}))
    items = tmp_path / "out" / "cache" / "items"
    env = dict(os.environ, LORAKIT_CACHE_ITEM_DELAY="0.4")
    p = subprocess.Popen([sys.executable, "-m", "lorakit", "cache", str(cfg_path), "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(items.glob("*.safetensors"))) < 4:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = list(items.glob("*.safetensors"))
    assert 4 <= len(done) < 16, "the build was not interrupted mid-run"
    for f in done:
        read_header(f)  # every entry on disk is complete
    r = subprocess.run([sys.executable, "-m", "lorakit", "cache", str(cfg_path), "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["reused"] == len(done) and s["encoded"] == 16 - len(done)
    assert not list(items.glob(".*.tmp"))


def test_build_needs_a_model_path(tmp_path):
    from lorakit.errors import ConfigError

    data = make_demo_dataset(tmp_path / "d", "flat", count=1, size=64)
    cfg = validate({"model": {"family": "flux"}, "data": {"dirs": [str(data)]}})
    with pytest.raises(ConfigError, match="model.path"):  # the `cache` command resolves the config first
        build(resolve(cfg, train=False).cfg)


def test_a_text_encoder_larger_than_the_card_is_marked_to_stream(tiny, monkeypatch):
    """FLUX.2 [dev]'s 45 GiB encoder on a 32 GiB card ran the cache out of memory: one that does not fit with room
    to run is streamed block by block instead (the tiny one under a cap smaller than that room)."""
    from lorakit.cache.builder import stream_large_encoders
    from lorakit.models.base import load_adapter

    folder = tiny("flux2-dev")
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "4")
    on_card = load_adapter("flux2-dev", folder, device="cuda")
    stream_large_encoders(on_card, "bf16")
    assert list(on_card.streamed) == ["text_encoder"]  # the VAE is no text encoder; the tokenizer has no weights
    on_cpu = load_adapter("flux2-dev", folder, device="cpu")
    stream_large_encoders(on_cpu, "bf16")
    assert not on_cpu.streamed
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "80")
    roomy = load_adapter("flux2-dev", folder, device="cuda")
    stream_large_encoders(roomy, "bf16")
    assert not roomy.streamed


@pytest.mark.gpu
def test_a_streamed_text_encoder_caches_what_a_resident_one_does(tmp_path, tiny, monkeypatch):
    folder = tiny("flux2-dev")
    data = make_demo_dataset(tmp_path / "data", "flat", count=2, size=[(64, 64)])
    cfg = validate({"profile": "datacenter", "model": {"family": "flux2-dev", "path": str(folder)},
                    "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
                    "output": {"dir": str(tmp_path / "a")}})
    resident = build(cfg, "cuda")
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "4")
    streamed_cfg = validate({**cfg.to_dict(), "output": {"dir": str(tmp_path / "b")}})
    streamed = build(streamed_cfg, "cuda")
    assert resident.encoded == streamed.encoded == 2
    (_, a), (_, b) = entries(cfg), entries(streamed_cfg)
    assert all(torch.equal(a[k]["prompt_embeds"], b[k]["prompt_embeds"]) for k in a)
