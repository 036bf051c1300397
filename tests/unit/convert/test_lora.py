import json

import pytest
import torch
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.convert import lora as L
from lorakit.convert.patches import LowRank
from lorakit.errors import InputError
from lorakit.io import load
from tests.loras import trained_like


def _trained_like(tiny, family, tmp_path, targets="all_linear", alpha=8):
    """A LoRA file as lorakit train writes it, with non-zero B so every delta is non-trivial."""
    return trained_like(tiny, family, tmp_path / "orig.safetensors", targets=targets, alpha=alpha)


def _same_tensors(a, b):
    return all(torch.equal(a[m].A, b[m].A) and torch.equal(a[m].B, b[m].B) and a[m].alpha == b[m].alpha for m in a)


@pytest.mark.parametrize("family", ["flux", "qwen-image", "kandinsky5-t2v", "z-image", "flux2-klein"])
@pytest.mark.parametrize("fmt", ["kohya", "comfyui", "peft"])
def test_round_trips_are_lossless(tiny, tmp_path, family, fmt):
    src = _trained_like(tiny, family, tmp_path)
    orig = L.read(src)
    facts = orig.facts
    assert facts["format"] == "diffusers" and facts["modules"] > 10 and orig.unused == []
    mid = L.write(orig, tmp_path / ("mid" if fmt == "peft" else "mid.safetensors"), fmt, facts["arch"])
    back = L.read(mid)
    assert back.facts["format"] == fmt and back.unused == []
    end = L.read(L.write(back, tmp_path / "end.safetensors", "diffusers", back.facts["arch"]))
    assert L.deltas_equal(orig, end, rtol=1e-6)[0] and _same_tensors(orig, end)


def _oracle_pieces(sd: dict) -> dict:
    """diffusers' converted state dict (alpha already folded in) as patches."""
    return {k.removeprefix("transformer.").removesuffix(".lora_A.weight"):
            LowRank(v, sd[k.replace("lora_A", "lora_B")], float(v.shape[0]))
            for k, v in sd.items() if k.endswith(".lora_A.weight")}


@pytest.mark.parametrize("fmt", ["kohya", "comfyui"])
def test_qwen_files_load_through_diffusers_own_converter(tiny, tmp_path, fmt):
    from diffusers import QwenImagePipeline

    orig = L.read(_trained_like(tiny, "qwen-image", tmp_path, alpha=16))
    out = L.write(orig, tmp_path / f"{fmt}.safetensors", fmt, "qwen-image")
    ok, why = L.deltas_equal(orig, _oracle_pieces(QwenImagePipeline.lora_state_dict(str(out))), rtol=1e-6)
    assert ok, why


def test_flux_kohya_file_loads_through_diffusers_own_converter(tmp_path):
    # diffusers' FLUX kohya converter knows only the full-size layout (3072 wide, MLP 12288), so the LoRA
    # is made at that width for one double and one single block — with fused qkv and linear1
    g = torch.Generator().manual_seed(1)

    def piece(out, inp, r=4, alpha=8.0):
        return LowRank(torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g), alpha)

    h = 3072
    orig = {f"transformer_blocks.0.attn.{m}": piece(h, h) for m in ("to_q", "to_k", "to_v", "to_out.0",
                                                                      "add_q_proj", "add_k_proj", "add_v_proj")}
    orig["transformer_blocks.0.ff.net.2"] = piece(h, 4 * h)
    orig.update({f"single_transformer_blocks.0.attn.{m}": piece(h, h, alpha=2.0) for m in ("to_q", "to_k", "to_v")})
    orig["single_transformer_blocks.0.proj_mlp"] = piece(4 * h, h, alpha=2.0)
    orig["single_transformer_blocks.0.proj_out"] = piece(h, 5 * h)
    out = L.write(L.Lora(orig), tmp_path / "k.safetensors", "kohya", "flux")
    from diffusers import FluxPipeline

    ok, why = L.deltas_equal(orig, _oracle_pieces(FluxPipeline.lora_state_dict(str(out))), rtol=1e-6)
    assert ok, why
    back = L.read(out)
    assert back.facts["format"] == "kohya" and _same_tensors(orig, back)


@pytest.mark.parametrize("fmt", ["kohya", "comfyui"])
def test_flux2_native_files_load_through_diffusers_own_converters(tiny, tmp_path, fmt):
    """FLUX.2 in Black Forest Labs' names (fused img_attn.qkv / txt_attn.qkv, single blocks' linear1/linear2,
    the double blocks' MLPs): kohya's lora_unet_ file through diffusers' kohya converter, ComfyUI's
    diffusion_model. file (ai-toolkit's layout) through its non-diffusers converter."""
    from diffusers import Flux2KleinPipeline

    src = L.read(trained_like(tiny, "flux2-klein", tmp_path / "d.safetensors", targets="attention_mlp"))
    out = L.write(src, tmp_path / "n.safetensors", fmt, "flux2")
    names = list(load(out))
    assert any("img_attn" in k and "qkv" in k for k in names) and any("linear1" in k for k in names)
    ok, why = L.deltas_equal(src.weights, _oracle_pieces(Flux2KleinPipeline.lora_state_dict(str(out))), rtol=1e-6)
    assert ok, why


def test_fusing_unequal_scales_keeps_every_delta(tmp_path):
    g = torch.Generator().manual_seed(2)
    orig = {f"transformer_blocks.0.attn.to_{c}": LowRank(torch.randn(r, 16, generator=g),
                                                        torch.randn(16, r, generator=g), a)
            for c, r, a in (("q", 2, 2.0), ("k", 4, 1.0), ("v", 3, 12.0))}
    back = L.read(L.write(L.Lora(orig), tmp_path / "k.safetensors", "kohya", "flux"))
    assert L.deltas_equal(orig, back, rtol=1e-6)[0]


def test_cli_converts_and_names_the_input_format(tiny, tmp_path):
    src = _trained_like(tiny, "flux", tmp_path)
    r = CliRunner().invoke(app, ["convert", "lora", str(src), str(tmp_path / "k.safetensors"), "--to", "kohya",
                                 "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["input"]["format"] == "diffusers" and data["input"]["arch"] == "flux"
    assert data["output"]["format"] == "kohya" and data["deltas_equal"] is True
    r = CliRunner().invoke(app, ["convert", "lora", str(tmp_path / "k.safetensors"), str(tmp_path / "b.safetensors"),
                                 "--to", "diffusers", "--dtype", "bf16"])
    assert r.exit_code == 0 and "kohya" in r.output, r.output
    assert L.read(tmp_path / "b.safetensors").facts["dtype"] == "bfloat16"


def test_bad_inputs_get_a_clear_message_and_write_nothing(tiny, tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    torch.save({"a": 1}, tmp_path / "pickle.pt")
    lora_file = _trained_like(tiny, "qwen-image", tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    cases = [
        (["model.safetensors", "o1.safetensors"], "no LoRA weights"),
        (["pickle.pt", "o2.safetensors"], "pickled"),
        (["junk.safetensors", "o3.safetensors"], "junk.safetensors"),
        ([lora_file.name, "o4.safetensors", "--family", "flux", "--to", "kohya"], "not a flux one"),
        ([lora_file.name, "o5.safetensors", "--to", "onnx"], "--to must be one of"),
        ([lora_file.name, lora_file.name], "would overwrite its input"),
    ]
    for args, words in cases:
        r = CliRunner().invoke(app, ["convert", "lora", *[str(tmp_path / a) if i < 2 else a
                                                          for i, a in enumerate(args)]])
        assert r.exit_code == 2 and words in r.output, (args, r.output)
    assert not any(tmp_path.glob("o[0-9].safetensors"))


def test_unknown_native_keys_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"lora_unet_mystery_block_0.lora_down.weight": torch.zeros(2, 4),
               "lora_unet_mystery_block_0.lora_up.weight": torch.zeros(4, 2)}, tmp_path / "k.safetensors")
    with pytest.raises(InputError):
        L.read(tmp_path / "k.safetensors", arch="flux")


def test_a_comfyui_file_says_how_diffusers_reads_it_without_failing(tiny, tmp_path):
    """ComfyUI/kohya files are for those consumers; where diffusers' own reader takes the layout too, convert says how
    it reads it: FLUX.2's readers (diffusers 0.42) get the final norm's modulation wrong (ai-toolkit layout: halves
    not swapped) or drop it (kohya) — told, the conversion still equal for its consumers."""
    src = trained_like(tiny, "flux2-klein", tmp_path / "a.safetensors", targets="attention", io=True)
    plain = trained_like(tiny, "flux2-klein", tmp_path / "b.safetensors", targets="attention")
    run = CliRunner()
    for fmt, said in (("comfyui", "norm_out.linear: relative difference"), ("kohya", "it drops norm_out.linear")):
        r = run.invoke(app, ["convert", "lora", str(src), str(tmp_path / f"{fmt}.safetensors"), "--to", fmt,
                             "--family", "flux2-klein", "--json"])
        out = json.loads(r.output)
        assert r.exit_code == 0 and out["equal"], r.output  # and the summary says what diffusers does with it
        assert out["check"].startswith(f"equal (lorakit, comfyui); diffusers: read otherwise by diffusers: {said}")
        assert out["checks"]["diffusers"].startswith(f"read otherwise by diffusers: {said}"), out["checks"]
        r = run.invoke(app, ["convert", "lora", str(plain), str(tmp_path / f"p-{fmt}.safetensors"), "--to", fmt,
                             "--family", "flux2-klein", "--json"])
        assert json.loads(r.output)["check"] == "equal (lorakit, comfyui, diffusers)", r.output
