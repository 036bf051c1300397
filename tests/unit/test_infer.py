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
        ([str(folder), "-p", "x", "--offload", "fast"], "--offload 'fast'"),
    ]
    for args, words in cases:
        r = CliRunner().invoke(app, ["infer", *args, "-o", str(tmp_path / "bad"), "--steps", "1"])
        assert r.exit_code == 2 and words in r.output, (args, r.output)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_t2v_writes_an_mp4_and_a_gif_of_the_stock_pipelines_frames(tiny, tmp_path):
    from diffusers import DiffusionPipeline

    from lorakit.data.video import Window, probe, read_window

    folder = tiny("kandinsky5-t2v")
    args = ["infer", str(folder), "-p", "a red circle moving", "--steps", "2", "--width", "64", "--height", "64",
            "-o", str(tmp_path / "v"), "--json"]
    bad = CliRunner().invoke(app, args + ["--frames", "6"])
    assert bad.exit_code == 2 and "4k+1" in bad.output and "--frames 5 or 9" in bad.output
    r = CliRunner().invoke(app, args + ["--frames", "5", "--fps", "12"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    mp4, gif = data["files"][0], data["gifs"][0]
    assert mp4.endswith(".mp4") and gif.endswith(".gif")
    info = probe(mp4)
    assert info.frames == 5 and info.size == (64, 64) and abs(info.fps - 12) < 0.01
    import av

    with av.open(mp4) as c:
        assert json.loads(c.metadata["comment"])["prompt"] == "a red circle moving"
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt="a red circle moving", num_inference_steps=2, width=64, height=64, num_frames=5,
               generator=torch.Generator().manual_seed(0), output_type="pil").frames[0]
    got = read_window(mp4, Window(0.0, tuple(range(5))))
    for a, b in zip(got, ref, strict=True):  # H.264 (yuv420p, crf 1): the brightness within a few levels
        la, lb = (np.asarray(x.convert("L"), dtype=float) for x in (a, b))  # (colour is stored at half size)
        assert np.abs(la - lb).mean() < 3
    with Image.open(gif) as g:
        assert g.n_frames == 5


@pytest.mark.slow
def test_edit_plus_takes_up_to_three_images(tiny, tmp_path):
    folder = tiny("qwen-image-edit-plus")
    paths = []
    for k, color in enumerate(["red", "green", "blue", "white"]):
        paths.append(tmp_path / f"c{k}.png")
        Image.new("RGB", (64, 64), color).save(paths[-1])
    base = ["infer", str(folder), "-p", "combine them", "--steps", "2", "-o", str(tmp_path / "o"), "--json"]
    r = CliRunner().invoke(app, base + [a for p in paths[:3] for a in ("--image", str(p))])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, base + [a for p in paths for a in ("--image", str(p))])
    assert r.exit_code == 2 and "at most 3 --image, got 4" in r.output


def test_fp8_placement_bakes_the_lora_then_stores_the_blocks_in_8_bits(tiny, tmp_path, monkeypatch):
    """`--offload fp8` (what auto picks when a bf16 transformer does not fit the card) equals the stock pipeline
    with the LoRA fused and every block Linear's weight rounded to e4m3 with a scale per row."""
    from diffusers import DiffusionPipeline

    from lorakit.train.quant import E4M3_MAX

    folder = tiny("flux")
    lora = _lora(tiny, "flux", tmp_path / "l.safetensors")
    kw = dict(num_inference_steps=3, width=64, height=64)
    outs = {}
    monkeypatch.setenv("LORAKIT_PROGRESS", "1")  # the phases on stderr beside --json
    for mode in ("fp8", "none"):
        r = CliRunner().invoke(app, ["infer", str(folder), "-p", "a red circle", "--seed", "2", "--steps", "3",
                                     "--width", "64", "--height", "64", "--lora", f"{lora}:0.8", "--offload", mode,
                                     "-o", str(tmp_path / mode), "--json"])
        assert r.exit_code == 0, r.output
        outs[mode] = json.loads(r.stdout)
        assert f"infer: placing: {mode}" in r.stderr and "infer: 1/1 images" in r.stderr
    data = outs["fp8"]
    assert data["offload"] == "fp8" and data["loras"][0]["added_to_weights"] > 0
    assert outs["none"]["loras"][0]["added_to_weights"] == 0  # the exact path keeps peft adapters
    assert "fp8" in Image.open(data["files"][0]).text["lorakit:base_weights"]
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(lora_scale=0.8)
    pipe.unload_lora_weights()
    rounded = 0
    with torch.no_grad():
        for name, m in pipe.transformer.named_modules():
            if type(m) is torch.nn.Linear and "blocks." in name:
                scale = m.weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
                m.weight.copy_((m.weight / scale).to(torch.float8_e4m3fn).float() * scale)
                rounded += 1
    assert rounded > 10
    ref = np.asarray(pipe(prompt="a red circle", generator=torch.Generator().manual_seed(2), **kw).images[0])
    ours = np.asarray(Image.open(data["files"][0])).astype(int)
    exact = np.asarray(Image.open(outs["none"]["files"][0])).astype(int)
    d_ref, d_exact = np.abs(ours - ref.astype(int)), np.abs(ours - exact)
    assert d_ref.max() <= 1  # the same weights (pixel-equal here; the LoRA is fused in fp32 there, f64 here)
    assert d_exact.mean() > 10 * max(d_ref.mean(), 0.01)  # and 8-bit weights, visibly not the exact ones


def test_fp8_placement_stores_both_wan_experts_in_8_bits_with_the_lora_in_its_own(tiny, tmp_path, monkeypatch):
    """Wan 2.2 A14B under `--offload fp8` (what auto picks on a 24 GiB card): both experts' block weights are rounded
    to e4m3, and a low-noise LoRA is summed into transformer_2's weights only."""
    from lorakit import placement as P
    from lorakit.train import quant

    folder = tiny("wan2.2-t2v")
    lora = trained_like(tiny, "wan2.2-t2v", tmp_path / "my_low_noise.safetensors", targets="attention", alpha=8,
                        seed=3, scale=0.5)
    seen = {}
    real = quant.quantize_blocks

    def spy(model, dtype, device, add=None):
        seen[id(model)] = sum(len(v) for v in (add or {}).values())
        return real(model, dtype, device, add)

    monkeypatch.setattr(quant, "quantize_blocks", spy)
    kept = {}
    real_apply = P.apply

    def keep(pipe, plan, *a, **kw):
        kept["pipe"] = pipe
        return real_apply(pipe, plan, *a, **kw)

    monkeypatch.setattr("lorakit.infer.apply", keep)
    r = CliRunner().invoke(app, ["infer", str(folder), "-p", "a red circle", "--steps", "2", "--width", "64",
                                 "--height", "64", "--frames", "5", "--lora", str(lora), "--offload", "fp8",
                                 "-o", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["offload"] == "fp8" and data["loras"][0]["applied_to"] == ["transformer_2"]
    pipe = kept["pipe"]
    for part in ("transformer", "transformer_2"):
        tr = getattr(pipe, part)
        rounded = [m for n, m in tr.named_modules() if type(m).__name__ != "Linear" and "blocks." in n
                   and getattr(m, "weight", None) is not None and m.weight.dtype == torch.float8_e4m3fn]
        assert rounded, part  # every expert's block Linears are stored in 8 bits
    assert seen[id(pipe.transformer)] == 0 and seen[id(pipe.transformer_2)] > 0  # the LoRA in its own expert


def test_a_lora_summed_as_its_layer_is_rounded_equals_one_baked_first(tiny, tmp_path):
    from lorakit.infer import add_loras, assemble
    from lorakit.train.quant import block_linears, quantize_blocks

    folder = tiny("flux")
    lora = _lora(tiny, "flux", tmp_path / "l.safetensors")
    weights = []
    for deferred in (False, True):
        pipe, adapter = assemble(folder, "cpu", torch.float32)
        pending = {"transformer": {n: [] for n in block_linears(pipe.transformer)}} if deferred else None
        facts = add_loras(pipe, [(lora, 0.7)], adapter.arch, bake=True, defer=pending)
        assert facts[0]["added_to_weights"] == facts[0]["modules"] > 0
        add = {k: v for k, v in (pending or {}).get("transformer", {}).items() if v}
        assert len(add) == (facts[0]["modules"] if deferred else 0)  # every target here is a block Linear
        quantize_blocks(pipe.transformer, torch.float32, add=add)
        weights.append({k: v.float() for k, v in pipe.transformer.state_dict().items()})
    n = same = 0
    for name, w in weights[0].items():
        if name.endswith(".scale"):  # row absmax / 448: float32 ulps apart at most
            torch.testing.assert_close(weights[1][name], w, rtol=1e-6, atol=0)
            continue
        torch.testing.assert_close(weights[1][name], w, rtol=0.13, atol=1e-6)  # at most one e4m3 step (3 bits)
        n += w.numel()
        same += int((weights[1][name] == w).sum())
    assert same / n > 0.999  # (the sums differ in float32 vs float64 rounding only)


def test_text_encoder_keys_of_a_kohya_file_are_said_not_applied(tiny, tmp_path):
    """Issue #36, 12: a kohya file's lora_te1_* keys were left unapplied with exit 0, said only in --json."""
    from safetensors.torch import save_file

    from lorakit.convert import lora as L
    from lorakit.io import load

    folder = tiny("flux")
    kohya = L.write(L.read(_lora(tiny, "flux", tmp_path / "l.safetensors")), tmp_path / "k.safetensors", "kohya", "flux")
    sd = load(kohya, copy=True)
    sd["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 32)
    sd["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.zeros(64, 4)
    save_file(sd, tmp_path / "te.safetensors")
    args = ["infer", str(folder), "-p", "a red circle", "--steps", "1", "--width", "64", "--height", "64",
            "--lora", str(tmp_path / "te.safetensors"), "-o", str(tmp_path / "o")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert f"warning: {tmp_path / 'te.safetensors'}: 2 key(s) not applied, e.g. lora_te1_" in " ".join(r.output.split())
    assert "text-encoder part" in r.output
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert len(data["warnings"]) == 1 and len(data["loras"][0]["not_applied"]) == 2


def test_the_contact_sheet_labels_each_image_with_its_file_and_prompt():
    from PIL import ImageDraw

    from lorakit.infer import _wrap, contact_sheet

    ims = [Image.new("RGB", (96, 64), c) for c in ("red", "green", "blue")]
    long = "a very long prompt " * 20
    sheet = contact_sheet(ims, ["0000-seed1.png: a red circle", "0001-seed2.png: " + long, ""], "model · no LoRA")
    head, text_h = 4 + 12 + 4, 3 * 12 + 8
    assert sheet.size == (3 * 96, head + 64 + text_h)
    px = np.asarray(sheet)
    for n, im in enumerate(ims):  # each image where it belongs, unchanged
        assert np.array_equal(px[head:head + 64, n * 96:(n + 1) * 96], np.asarray(im))
    labels = px[head + 64:, :]
    assert (labels[:, :96] < 128).any() and (labels[:, 96:192] < 128).any()  # text under the labelled ones
    assert (labels[:, 192:] == 255).all()  # none under the unlabelled one
    assert (px[:head] < 128).any()  # the title
    d = ImageDraw.Draw(sheet)
    wrapped = _wrap(d, long, 88, 3)
    assert len(wrapped) == 3 and wrapped[-1].endswith("...") and all(d.textlength(x) <= 88 for x in wrapped)
    assert _wrap(d, "short", 88, 3) == ["short"] and _wrap(d, "", 88, 3) == [""]


def test_a_models_own_sampling_grid_is_used_or_replaced_as_asked_and_said(tiny, tmp_path):
    """Qwen-Image-2.1's pipeline config may set `sample_sigmas` (the author's grid), which makes the stock pipeline
    ignore num_inference_steps. Without --steps lorakit samples with that grid and records its length; with --steps
    it passes that many evenly spaced sigmas: either way the image equals the stock pipeline's for those steps and
    the PNG says the steps that ran."""
    import shutil

    folder = shutil.copytree(tiny("qwen-image-2.1"), tmp_path / "m")
    index = json.loads((folder / "model_index.json").read_text())
    index["sample_sigmas"] = [1.0, 0.8, 0.45]
    (folder / "model_index.json").write_text(json.dumps(index))
    images = {}
    for extra, steps, stock_kw in (([], 3, {}), (["--steps", "2"], 2, {"sigmas": [1.0, 0.5]})):
        r = CliRunner().invoke(app, ["infer", str(folder), "-p", "a red circle", "--width", "64", "--height", "64",
                                     "-o", str(tmp_path / f"out{steps}"), "--json", *extra])
        assert r.exit_code == 0, r.output
        data = json.loads(r.output)
        assert data["steps"] == steps
        png = Image.open(data["files"][0])
        assert png.text["lorakit:steps"] == str(steps)
        ref = _stock(folder, None, "a red circle", 0, width=64, height=64, num_inference_steps=99, **stock_kw)
        images[steps] = np.asarray(png)
        assert np.array_equal(images[steps], np.asarray(ref))
    assert not np.array_equal(images[3], images[2])  # the two grids give different images
    r = CliRunner().invoke(app, ["infer", str(folder), "-p", "a red circle", "--width", "64", "--height", "64",
                                 "-o", str(tmp_path / "said")])
    assert "the model's own 3 steps (its pipeline's sample_sigmas)" in r.output
