"""`lorakit convert merge`: a LoRA baked into a new model folder, exactly; refusals write nothing."""

import torch
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.convert import lora as L
from tests.loras import trained_like


def test_merge_bakes_the_lora_in_exactly(tiny, tmp_path):
    from diffusers import FluxTransformer2DModel

    from lorakit.io.modules import load_component
    from lorakit.models.base import family_adapter, load_adapter
    from lorakit.train.lora import load_lora_into

    folder = tiny("flux")
    src = trained_like(tiny, "flux", tmp_path / "orig.safetensors", targets="attention")
    r = CliRunner().invoke(app, ["convert", "merge", str(folder), str(src), str(tmp_path / "merged"), "--json"])
    assert r.exit_code == 0, r.output
    merged = load_component(tmp_path / "merged" / "transformer")
    assert isinstance(merged, FluxTransformer2DModel) and (tmp_path / "merged" / "vae").is_dir()
    base = load_component(folder / "transformer")
    from peft import LoraConfig

    import lorakit.train.lora as tl

    targets = tl.target_modules(base, family_adapter("flux"), "attention")
    base.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))  # the file: alpha folded into B
    load_lora_into(base, src)
    ad = load_adapter("flux", None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, 8, generator=g)
    text = {"prompt_embeds": torch.randn(1, 7, 32, generator=g), "pooled": torch.randn(1, 32, generator=g)}
    with torch.no_grad():
        a = ad.predict(merged, x, torch.tensor([0.5]), text)
        b = ad.predict(base, x, torch.tensor([0.5]), text)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    r = CliRunner().invoke(app, ["convert", "merge", str(folder), str(src), str(tmp_path / "merged")])
    assert r.exit_code == 2 and "exists" in r.output
    # at a scale: W' = W + scale * alpha/r * B @ A
    r = CliRunner().invoke(app, ["convert", "merge", str(folder), str(src), str(tmp_path / "half"), "--scale", "0.5"])
    assert r.exit_code == 0, r.output
    from lorakit.io import load

    pieces = L.read(src)
    w0, w1 = load(folder / "transformer"), load(tmp_path / "half" / "transformer")
    m = "transformer_blocks.0.attn.to_q"
    want = (w0[f"{m}.weight"].double() + 0.5 * pieces[m].delta()).float()
    assert torch.equal(w1[f"{m}.weight"], want)


def test_merge_refuses_what_it_cannot_do_and_writes_nothing(tiny, tmp_path):
    run = CliRunner()
    qwen_lora = trained_like(tiny, "qwen-image", tmp_path / "q.safetensors", targets="attention_mlp")
    cases = [
        ([str(tmp_path), str(qwen_lora), str(tmp_path / "m1")], "not a diffusers model folder"),
        ([str(tiny("flux")), str(qwen_lora), str(tmp_path / "m2")], "is a qwen-image LoRA"),
        ([str(tiny("flux")), str(tmp_path / "none.safetensors"), str(tmp_path / "m3")], "none.safetensors"),
    ]
    for args, words in cases:
        r = run.invoke(app, ["convert", "merge", *args])
        assert r.exit_code == 2 and words in r.output, (args, r.output)
    assert not any(tmp_path.glob("m[0-9]")) and not any(p.name.startswith(".m") for p in tmp_path.iterdir())
