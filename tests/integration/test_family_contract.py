"""The family contract: every registered family, through every path, with the default config.

A new family plugs in by declaring its facts on an adapter (lorakit/models/); this test then runs it through
everything a user does. A family that forgets a fact fails here with the fact's name.
"""

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import demo_layout_for, make_demo_dataset
from lorakit.models.base import family_adapter, load_adapter, trained_dir
from lorakit.models.registry import family_info, family_names

FAMILIES = family_names()


def _one_per_shape() -> list[str]:
    """One family per (architecture, dataset layout, several controls or not): the families a LoRA kind could
    treat differently (module names, control tokens). FLUX.2 dev and klein differ in text encoder and guidance
    only, Edit-2511 from Edit-Plus in a transformer flag: their LyCORIS paths are their siblings'."""
    seen, out = set(), []
    for f in FAMILIES:
        a = family_adapter(f)
        key = (a.arch, a.layout, a.max_controls > 1)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_fact_is_declared(family):
    a = family_adapter(family)
    assert type(a).missing_facts() == [], f"{family} does not declare: {', '.join(type(a).missing_facts())}"
    assert a.layout in ("flat", "edit", "video") and a.guidance in ("embedded", "cfg")
    assert (a.max_controls > 0) == (a.layout == "edit")
    assert a.lora_presets.attention and a.lora_presets.mlp and len(a.lora_presets.io) == 3
    assert a.attention_cases and all(c.head_dim * c.heads > 0 for c in a.attention_cases)
    import inspect

    assert a.guidance_arg in inspect.signature(a.pipeline_class().__call__).parameters


@pytest.mark.parametrize("family", FAMILIES)
def test_presets_match_the_real_transformer(tiny, family):
    from lorakit.io.modules import load_component
    from lorakit.train.lora import target_modules

    tr = load_component(tiny(family) / "transformer")
    a = family_adapter(family)
    attn = target_modules(tr, a, "attention")
    both = target_modules(tr, a, "attention_mlp")
    every = target_modules(tr, a, "all_linear")
    io = target_modules(tr, a, "attention", io=True)
    assert attn and set(attn) < set(both) <= set(every)
    assert set(io) - set(attn) == set(a.lora_presets.io)  # the latent in/out layers, by their exact names
    # every preset name is found in the model (a typo in a family's facts would be caught by target_modules)
    for w in a.preset_modules("attention_mlp"):
        assert any(n.endswith("." + w) for n in both), w


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_published_size_and_full_config_agree(family):
    """The published transformer config builds (on the meta device) at the size the memory estimate uses, its
    one-block attention case runs through `predict` with the adapter's example inputs, and the estimate counts
    the family's controls and frames."""
    import diffusers

    from lorakit.config import validate
    from lorakit.plan.memory import estimate

    a = family_adapter(family)
    cls = getattr(diffusers, a.info.transformer_class)
    with torch.device("meta"):
        full = cls(**a.full_config)
        small = cls(**a.attention_model_config())
    n = sum(p.numel() for p in full.parameters())
    assert abs(n - a.published.params) / a.published.params < 0.1, (n, a.published.params)
    g = torch.Generator().manual_seed(0)
    b = a.example_inputs(a.attention_model_config(), 256, 16, g, frames=5)
    dev = "meta" if a.meta_forward else "cpu"  # Qwen-Image-2.1 reads its token layout from the mask's values
    if not a.meta_forward:
        small = cls(**a.attention_model_config()).to(torch.bfloat16)
    with torch.no_grad():
        v = a.predict(small, b.latents.to(dev, small.dtype), torch.tensor([0.5], device=dev),
                      {k: v.to(dev) for k, v in b.text.items()}, controls=[c.to(dev) for c in b.controls])
    assert v.shape == b.latents.shape
    est = estimate(validate({"model": {"family": family}, "data": {"resolution": 512, "frames": 17}}))
    per_image = (512 // a.token_side) ** 2
    assert est["tokens"] >= per_image * (1 + a.max_controls) * (5 if a.layout == "video" else 1)
    assert est["blocks"] == a.published.blocks and est["gib"] > a.published.params * 2 / 2**30


def _default_config(tmp_path, family, model) -> tuple:
    """The built-in defaults (+ the cpu profile), with only what the tiny models and a short run need: sizes
    scaled down (64 px targets, and controls at 64² instead of the pipelines' 1024²: the builder and oracle
    tests encode controls at the default size), clips as long as the default window (17 frames)."""
    data = make_demo_dataset(tmp_path / "data", demo_layout_for(family), count=4, size=64, frames=17)
    scaled = {"resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128}
    if family_adapter(family).max_controls:
        scaled["control_resolution"] = 64
    cfg = {"model": {"family": family, "path": str(model)},
           "data": {"dirs": [str(data)], **scaled},
           "schedule": {"steps": 3}, "sampling": {"steps": 3},
           "output": {"dir": str(tmp_path / "out"), "save_every": 3}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, data


def _resumed(tmp_path, tiny, family, path, overrides):
    """The run's final checkpoint resumed into a Trainer (eval mode): (cfg, adapter, data, trainer)."""
    from lorakit.cache.builder import cache_dir_for
    from lorakit.cache.store import Store
    from lorakit.config import assemble
    from lorakit.io.modules import load_component
    from lorakit.train.data import CachedData
    from lorakit.train.trainer import Trainer

    cfg, _ = assemble(path, overrides, None)
    a = load_adapter(family, tiny(family))
    st = Store(cache_dir_for(cfg))
    data = CachedData(st, st.read_manifest(), 1, 0)
    tr = Trainer(cfg, a, load_component(trained_dir(cfg)), data, tmp_path / "x", "cpu", torch.float32)
    tr.resume(tmp_path / "out" / "checkpoints" / "final")
    tr.transformer.eval()
    return cfg, a, data, tr


def _infer(run, tiny, family, ds, lora, tmp_path):
    """`lorakit infer` with the LoRA through the CLI (edit families from a control image of the dataset)."""
    args = ["infer", str(tiny(family)), "-p", "a red circle", "--lora", lora, "--steps", "2", "--width", "64",
            "--height", "64", "--frames", "5", "-o", str(tmp_path / "img"), "--json"]
    for folder in sorted(p for p in ds.iterdir() if p.name.startswith("control")):
        args += ["--image", str(sorted(folder.iterdir())[0])]
    if family_adapter(family).first_frame:  # image-to-video: the clip starts from this image
        from PIL import Image

        Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "first.png")
        args += ["--image", str(tmp_path / "first.png")]
    r = run.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_default_config_runs_every_path(tmp_path, tiny, family):
    from lorakit.convert import lora as L
    from lorakit.io.modules import load_component

    run = CliRunner()
    path, ds = _default_config(tmp_path, family, tiny(family))
    r = run.invoke(app, ["train", str(path), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    r = run.invoke(app, ["cache", str(path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["items"] == 4
    r = run.invoke(app, ["train", str(path), "--json"])  # the default targets: attention
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["steps"] == 3 and res["cache"]["reused"] == 4 and res["samples"].endswith("progress.png")
    losses = [json.loads(x)["loss"] for x in open(res["metrics"])]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))

    # the LoRA moved the model, and stock diffusers reproduces lorakit's predictions from the file
    cfg, a, data, tr = _resumed(tmp_path, tiny, family, path, [])
    pipe = a.pipeline_class().from_pretrained(tiny(family))
    part = a.trained_part(cfg.model.expert)  # Wan 2.2 A14B: the low-noise expert by default (transformer_2)
    pipe.load_lora_weights(res["lora"], **({"load_into_transformer_2": True} if part == "transformer_2" else {}))
    b = data.load([data.items[0]["key"]])
    xt = torch.randn(b.latents.shape, generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.6])
    with torch.no_grad():
        ours = a.predict(tr.transformer, xt, s, b.text, controls=b.controls)
        stock = a.predict(getattr(pipe, part), xt, s, b.text, controls=b.controls)
        base = a.predict(load_component(trained_dir(cfg)), xt, s, b.text, controls=b.controls)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    assert (ours - base).abs().max() > 0  # three steps at the default learning rate changed the output

    # every format and back, exactly
    pieces = L.read(res["lora"])
    assert pieces.facts["arch"] in (family_info(family).arch, None) and pieces.unused == []
    assert res["consumer_check"] == {"diffusers": "equal", "comfyui": "equal"}  # re-read as each consumer does
    for fmt in ("peft", "kohya", "comfyui", "diffusers"):
        dst = tmp_path / ("peft" if fmt == "peft" else f"{fmt}.safetensors")
        r = run.invoke(app, ["convert", "lora", res["lora"], str(dst), "--to", fmt, "--family", family, "--json"])
        assert r.exit_code == 0 and json.loads(r.output)["deltas_equal"], r.output
        back = L.read(dst, arch=family_info(family).arch)
        assert L.deltas_equal(pieces, back)[0]

    # infer with the LoRA through the CLI (edit families from a control image of the dataset)
    r = _infer(run, tiny, family, ds, res["lora"], tmp_path)
    assert len(json.loads(r.output)["files"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lokr", "loha"])
@pytest.mark.parametrize("family", _one_per_shape())
def test_lycoris_adapters_train_and_stock_peft_reproduces_them(tmp_path, tiny, family, kind):
    """lora.type lokr / loha on the default targets: trains, its file loads into the stock transformer through
    peft's own LoKr/LoHa layers with lorakit's predictions reproduced, ComfyUI's reading equals the trained
    patches, and lorakit infer applies it."""
    from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model, set_peft_model_state_dict

    from lorakit.io import load
    from lorakit.io.modules import load_component

    run = CliRunner()
    path, ds = _default_config(tmp_path, family, tiny(family))
    r = run.invoke(app, ["train", str(path), "--json", "--set", f"lora.type={kind}", "--set", "sampling.enabled=false",
                         "--set", "optim.lr=1e-2"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["consumer_check"]["comfyui"] == "equal"
    cfg, a, data, tr = _resumed(tmp_path, tiny, family, path, [f"lora.type={kind}"])

    lora = res["lora"]
    if family_adapter(family).lora_file_layout != "diffusers":  # Wan writes the original names: peft reads diffusers'
        lora = str(tmp_path / "as-diffusers.safetensors")
        r = run.invoke(app, ["convert", "lora", res["lora"], lora, "--to", "diffusers", "--family", family, "--json"])
        assert r.exit_code == 0 and json.loads(r.output)["deltas_equal"], r.output
    sd = {k.removeprefix("transformer."): v for k, v in load(lora).items()}
    assert all(".lokr_" in k or ".hada_" in k for k in sd)
    modules = sorted({k.rsplit(".", 1)[0] for k in sd})
    # the file needs no alpha (the scale is folded in): peft's scale alpha / r is 1
    pcfg = (LoKrConfig if kind == "lokr" else LoHaConfig)(r=cfg.lora.rank, alpha=cfg.lora.rank,
                                                          target_modules=modules)
    stock_tr = getattr(a.pipeline_class().from_pretrained(tiny(family)), a.trained_part(cfg.model.expert))
    inject_adapter_in_model(pcfg, stock_tr)
    result = set_peft_model_state_dict(stock_tr, sd)
    assert not result.unexpected_keys
    b = data.load([data.items[0]["key"]])
    xt = torch.randn(b.latents.shape, generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.6])
    with torch.no_grad():
        ours = a.predict(tr.transformer, xt, s, b.text, controls=b.controls)
        stock = a.predict(stock_tr.eval(), xt, s, b.text, controls=b.controls)
        base = a.predict(load_component(trained_dir(cfg)), xt, s, b.text, controls=b.controls)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    assert (ours - base).abs().max() > 0

    r = _infer(run, tiny, family, ds, res["lora"], tmp_path)
    assert json.loads(r.output)["loras"][0]["kinds"] == [kind]
