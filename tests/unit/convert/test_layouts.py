"""Files in other trainers' layouts, read exactly: each file's change of every weight, computed here by hand
from its own keys, equals what lorakit reads — and what ComfyUI's rules apply. Nothing is dropped silently."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.convert import comfy
from lorakit.convert import lora as L
from lorakit.io.modules import load_component
from lorakit.models.native import native_weights, swap_halves

g = torch.Generator().manual_seed(0)
H = 32  # the tiny FLUX / Qwen-Image hidden width


def r(*shape):
    return torch.randn(*shape, generator=g)


def _check(tiny, family, arch, path, expected: dict, biases: dict | None = None, comfy_too: bool = True):
    """lorakit's reading equals the hand computation; ComfyUI's rules change the original weights alike."""
    lora = L.read(path, arch=arch)
    assert lora.unused == [] and lora.facts["arch"] == arch, (lora.unused[:3], lora.facts)
    alone = L.read(path)  # without being told: the same reading (the architecture itself may stay unknown)
    assert L.deltas_equal(lora, alone)[0] and alone.facts["arch"] in (arch, None)
    assert set(lora.weights) == set(expected), sorted(set(lora.weights) ^ set(expected))
    for m, want in expected.items():
        got = lora.weights[m].delta()
        assert torch.allclose(got, want.double(), rtol=1e-5, atol=1e-6), m  # the hand sums are float32
    for m, want in (biases or {}).items():
        assert torch.allclose(lora.biases[m].double(), want.double()), m
    if not comfy_too:
        return lora
    from lorakit.io import load

    sd_model = load_component(tiny(family) / "transformer").state_dict()
    base = native_weights(sd_model, arch)
    changed, loaded = comfy.apply(load(path, copy=True), arch, base)
    assert loaded == set(load(path)), sorted(set(load(path)) - loaded)[:3]
    after = dict(sd_model)
    for m, p in lora.weights.items():
        after[f"{m}.weight"] = (after[f"{m}.weight"].double() + p.delta()).float()
    for m, b in lora.biases.items():
        after[f"{m}.bias"] = (after[f"{m}.bias"].double() + b.double()).float()
    ours = native_weights(after, arch)
    for k, w in changed.items():
        assert torch.allclose(w.float(), ours[k], rtol=1e-5, atol=1e-6), k
    return lora


def test_kohya_flux_fused_split_qkv_and_final_norm(tiny, tmp_path):
    # split_qkv (sd-scripts): down stacks three rank-2 LoRAs, up is block-diagonal; plain: one rank-4 LoRA
    d3, u3 = r(6, H), torch.block_diag(r(H, 2), r(H, 2), r(H, 2))
    d1, u1 = r(4, H), r(3 * H, 4)
    dn, un = r(4, H), r(2 * H, 4)  # final_layer.adaLN_modulation.1: [scale, shift] rows in the original
    sd = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": d3,
          "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": u3,
          "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(3.0),
          "lora_unet_double_blocks_0_txt_attn_qkv.lora_down.weight": d1,
          "lora_unet_double_blocks_0_txt_attn_qkv.lora_up.weight": u1,
          "lora_unet_final_layer_adaLN_modulation_1.lora_down.weight": dn,
          "lora_unet_final_layer_adaLN_modulation_1.lora_up.weight": un,
          "lora_unet_final_layer_adaLN_modulation_1.alpha": torch.tensor(8.0)}
    save_file(sd, tmp_path / "k.safetensors")
    fused3 = (u3 @ d3) * 3.0 / 6
    fused1 = u1 @ d1  # no alpha key: alpha = rank
    exp = {f"transformer_blocks.0.attn.to_{c}": fused3[i * H:(i + 1) * H] for i, c in enumerate("qkv")}
    exp.update({f"transformer_blocks.0.attn.add_{c}_proj": fused1[i * H:(i + 1) * H] for i, c in enumerate("qkv")})
    exp["norm_out.linear"] = swap_halves(un @ dn * 8.0 / 4)  # diffusers stores [shift, scale]
    lora = _check(tiny, "flux", "flux", tmp_path / "k.safetensors", exp)
    for fmt in ("comfyui", "kohya"):  # and back: norm_out has its original name again
        out = L.write(lora, tmp_path / f"{fmt}.safetensors", fmt, "flux")
        back = L.read(out)
        assert L.deltas_equal(lora, back)[0] and "norm_out.linear" in back.weights


def test_ai_toolkit_diffsynth_and_onetrainer_diffusers_names(tiny, tmp_path):
    m = "transformer_blocks.0.ff.net.2"  # in 4H, out H
    a, b = r(4, 4 * H), r(H, 4)
    layouts = {"ai-toolkit": {f"transformer.{m}.lora_A.weight": a, f"transformer.{m}.lora_B.weight": b},  # alpha = rank
               "diffsynth": {f"{m}.lora_A.default.weight": a, f"{m}.lora_B.default.weight": b},
               "onetrainer": {f"lora_transformer_{m.replace('.', '_')}.lora_down.weight": a,
                              f"lora_transformer_{m.replace('.', '_')}.lora_up.weight": b}}
    for name, sd in layouts.items():
        save_file(sd, tmp_path / f"{name}.safetensors")
        _check(tiny, "flux", "flux", tmp_path / f"{name}.safetensors", {m: b @ a})


def test_musubi_qwen_comfyui_extract_with_bias_and_norm_differences(tiny, tmp_path):
    m, n = "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.norm_q"
    d, u, db, dn = r(4, H), r(H, 4), r(H), r(16)
    save_file({f"lora_unet_{m.replace('.', '_')}.lora_down.weight": d, f"lora_unet_{m.replace('.', '_')}.lora_up.weight": u,
               f"lora_unet_{m.replace('.', '_')}.alpha": torch.tensor(2.0)}, tmp_path / "musubi.safetensors")
    _check(tiny, "qwen-image", "qwen-image", tmp_path / "musubi.safetensors", {m: u @ d * 2.0 / 4})
    # ComfyUI's model-diff extract: low-rank weights, the biases' differences, a norm's difference
    save_file({f"diffusion_model.{m}.lora_up.weight": u, f"diffusion_model.{m}.lora_down.weight": d,
               f"diffusion_model.{m}.alpha": torch.tensor(4.0), f"diffusion_model.{m}.diff_b": db,
               f"diffusion_model.{n}.diff": dn}, tmp_path / "extract.safetensors")
    lora = _check(tiny, "qwen-image", "qwen-image", tmp_path / "extract.safetensors", {m: u @ d, n: dn},
                  biases={m: db})
    assert lora.facts["kinds"] == ["diff", "diff_b", "lora"]
    # kept by the layouts that can hold it; refused, by name, by the one that cannot
    back = L.read(L.write(lora, tmp_path / "c.safetensors", "comfyui", "qwen-image"))
    assert L.deltas_equal(lora, back)[0] and back.biases.keys() == {m}
    r_ = CliRunner().invoke(app, ["convert", "lora", str(tmp_path / "extract.safetensors"), str(tmp_path / "o.safetensors")])
    assert r_.exit_code == 2 and "--to comfyui" in r_.output and not (tmp_path / "o.safetensors").exists()


def test_lycoris_lokr_and_loha_read_merged_and_inferred(tiny, tmp_path):
    m = "transformer_blocks.0.attn.to_k"
    w1, w2a, w2b = r(4, 4), r(8, 2), r(2, 8)  # kron((4,4), (8,8)) = (32, 32); factored w2: alpha / 2
    h1a, h1b, h2a, h2b = r(H, 3), r(3, H), r(H, 3), r(3, H)
    save_file({f"lycoris_{m.replace('.', '_')}.lokr_w1": w1, f"lycoris_{m.replace('.', '_')}.lokr_w2_a": w2a,
               f"lycoris_{m.replace('.', '_')}.lokr_w2_b": w2b, f"lycoris_{m.replace('.', '_')}.alpha": torch.tensor(1.0),
               "lycoris_transformer_blocks_0_attn_to_v.hada_w1_a": h1a, "lycoris_transformer_blocks_0_attn_to_v.hada_w1_b": h1b,
               "lycoris_transformer_blocks_0_attn_to_v.hada_w2_a": h2a, "lycoris_transformer_blocks_0_attn_to_v.hada_w2_b": h2b,
               "lycoris_transformer_blocks_0_attn_to_v.alpha": torch.tensor(6.0)}, tmp_path / "ly.safetensors")
    exp = {m: torch.kron(w1, w2a @ w2b) * 1.0 / 2,
           "transformer_blocks.0.attn.to_v": (h1a @ h1b) * (h2a @ h2b) * 6.0 / 3}
    lora = _check(tiny, "qwen-image", "qwen-image", tmp_path / "ly.safetensors", exp)
    assert lora.facts["kinds"] == ["loha", "lokr"]
    r_ = CliRunner().invoke(app, ["convert", "merge", str(tiny("qwen-image")), str(tmp_path / "ly.safetensors"),
                                  str(tmp_path / "merged"), "--json"])
    assert r_.exit_code == 0, r_.output
    merged = load_component(tmp_path / "merged" / "transformer").state_dict()
    base = load_component(tiny("qwen-image") / "transformer").state_dict()
    for mod, d in exp.items():
        assert torch.allclose(merged[f"{mod}.weight"].double(), base[f"{mod}.weight"].double() + d.double(), atol=1e-6)
    from lorakit.infer import add_loras, assemble

    pipe, _ = assemble(tiny("qwen-image"), "cpu", torch.float32)
    facts = add_loras(pipe, [(tmp_path / "ly.safetensors", 0.5)], "qwen-image")
    assert facts[0]["added_to_weights"] == 2
    sd = pipe.transformer.state_dict()
    assert torch.allclose(sd[f"{m}.weight"].double(), base[f"{m}.weight"].double() + 0.5 * exp[m].double(), atol=1e-6)


def test_text_encoder_keys_are_listed_not_refused_and_strict_fails(tiny, tmp_path):
    m = "transformer_blocks_0_attn_to_q"
    save_file({f"lora_unet_{m}.lora_down.weight": r(4, H), f"lora_unet_{m}.lora_up.weight": r(H, 4),
               "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": r(4, 32),
               "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": r(64, 4),
               "some_random_tensor": r(3)}, tmp_path / "te.safetensors")
    lora = L.read(tmp_path / "te.safetensors")
    assert list(lora.weights) == ["transformer_blocks.0.attn.to_q"]
    assert sorted(k for k, _ in lora.unused) == ["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
                                                 "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
                                                 "some_random_tensor"]
    run = CliRunner()
    r_ = run.invoke(app, ["convert", "lora", str(tmp_path / "te.safetensors"), str(tmp_path / "o.safetensors"),
                          "--to", "comfyui"])
    out = " ".join(r_.output.split())
    assert r_.exit_code == 0 and "NOT converted" in out and "deltas equal (all" not in out
    assert "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight" in out.replace(" ", "")
    data = json.loads(run.invoke(app, ["convert", "lora", str(tmp_path / "te.safetensors"),
                                       str(tmp_path / "o2.safetensors"), "--to", "comfyui", "--json"]).output)
    assert len(data["not_converted"]) == 3 and data["deltas_equal"]
    r_ = run.invoke(app, ["convert", "lora", str(tmp_path / "te.safetensors"), str(tmp_path / "o3.safetensors"),
                          "--strict"])
    assert r_.exit_code == 2 and "3 key(s) cannot be applied" in " ".join(r_.output.split())


@pytest.mark.parametrize("fmt", ["kohya", "comfyui"])
def test_flux_train_io_lora_converts_to_the_original_names(tiny, tmp_path, fmt):
    """FLUX's norm_out.linear (lora.train_io) had no native name: --to comfyui|kohya failed."""
    from tests.loras import trained_like

    src = trained_like(tiny, "flux", tmp_path / "io.safetensors", targets="attention", io=True)
    r_ = CliRunner().invoke(app, ["convert", "lora", str(src), str(tmp_path / "o.safetensors"), "--to", fmt, "--json"])
    assert r_.exit_code == 0 and json.loads(r_.output)["deltas_equal"], r_.output
    from lorakit.io import load

    keys = load(tmp_path / "o.safetensors")
    assert any("final_layer_adaLN_modulation_1" in k or "final_layer.adaLN_modulation.1" in k for k in keys)


def _convert(src, dst, *args):
    r_ = CliRunner().invoke(app, ["convert", "lora", str(src), str(dst), "--json", *args])
    return r_, (json.loads(r_.output) if r_.output.strip().startswith("{") else {})


def test_a_bf16_split_qkv_file_converts_to_diffusers_exactly(tiny, tmp_path):
    """Issue #36, 10: alpha/rank folded into a bf16 up matrix rounded it (2.6e-5 off of 5.9e-2) — `convert` said
    "deltas DIFFER" and left its output behind, and `lorakit infer` applied the rounded file."""
    d3, u3 = r(6, H).bfloat16(), torch.block_diag(r(H, 2), r(H, 2), r(H, 2)).bfloat16()
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": d3,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": u3,
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(5.0)}, tmp_path / "k.safetensors")
    r_, out = _convert(tmp_path / "k.safetensors", tmp_path / "d.safetensors", "--to", "diffusers")
    assert r_.exit_code == 0 and out["deltas_equal"], r_.output
    diffusers_file = L.read(tmp_path / "d.safetensors")
    assert L.deltas_equal(L.read(tmp_path / "k.safetensors"), diffusers_file, rtol=1e-6)[0]
    from lorakit.infer import add_loras, assemble

    pipe, _ = assemble(tiny("flux"), "cpu", torch.float32)
    before = pipe.transformer.transformer_blocks[0].attn.to_q.weight.detach().clone()
    add_loras(pipe, [(tmp_path / "k.safetensors", 1.0)], "flux")
    pipe.transformer.fuse_lora()
    after = pipe.transformer.transformer_blocks[0].attn.to_q.get_base_layer().weight.detach()
    want = (u3.double() @ d3.double() * 5.0 / 6)[:H]
    assert torch.allclose((after - before).double(), want, rtol=0, atol=1e-6)


def test_a_qwen_extract_with_norm_differences_converts_to_kohya_as_comfyui_reads_it(tiny, tmp_path):
    """Issue #36, 11: an extract's norm differences (norm_added_k/q, norm_k) came back from kohya names as
    other modules: a false "deltas DIFFER" and exit 1, although ComfyUI read the output exactly like the input."""
    m = "transformer_blocks.0.attn.to_q"
    norms = ("transformer_blocks.0.attn.norm_k", "transformer_blocks.0.attn.norm_added_q",
             "transformer_blocks.0.attn.norm_added_k")
    d, u, db = r(4, H), r(H, 4), r(H)
    sd = {f"diffusion_model.{m}.lora_up.weight": u, f"diffusion_model.{m}.lora_down.weight": d,
          f"diffusion_model.{m}.alpha": torch.tensor(4.0), f"diffusion_model.{m}.diff_b": db}
    sd.update({f"diffusion_model.{n}.diff": r(16) for n in norms})
    save_file(sd, tmp_path / "extract.safetensors")
    r_, out = _convert(tmp_path / "extract.safetensors", tmp_path / "k.safetensors", "--to", "kohya")
    assert r_.exit_code == 0 and out["deltas_equal"], r_.output
    back = L.read(tmp_path / "k.safetensors")
    assert set(back.weights) == {m, *norms} and back.unused == []
    from lorakit.io import load

    sd_model = load_component(tiny("qwen-image") / "transformer").state_dict()
    base = native_weights(sd_model, "qwen-image")
    a, _ = comfy.apply(load(tmp_path / "extract.safetensors", copy=True), "qwen-image", base)
    b, _ = comfy.apply(load(tmp_path / "k.safetensors", copy=True), "qwen-image", base)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k]) for k in a)


def test_a_refused_or_failed_convert_leaves_nothing_behind(tiny, tmp_path):
    """Issue #36, 11: a FLUX extract --to comfyui was refused, yet its output file stayed on disk."""
    m = "transformer_blocks.0.attn.to_q"  # a bias difference on a fused FLUX weight: no original form holds it
    save_file({f"transformer.{m}.lora_A.weight": r(4, H), f"transformer.{m}.lora_B.weight": r(H, 4),
               f"transformer.{m}.diff_b": r(H)}, tmp_path / "x.safetensors")
    for fmt in ("comfyui", "kohya", "diffusers"):
        dst = tmp_path / f"o-{fmt}.safetensors"
        r_, out = _convert(tmp_path / "x.safetensors", dst, "--to", fmt, "--family", "flux")
        if r_.exit_code == 0:
            assert out["deltas_equal"] and dst.is_file()
        else:
            assert r_.exit_code in (1, 2) and not dst.exists(), (fmt, r_.output)
            assert not list(tmp_path.glob(".o-*")), "a temporary file was left"


def _extract(tiny, family, norm_param="weight", skip_weights=(), full=False):
    """ComfyUI's model-diff extract of a tiny model's every weight, as its LoraSave node writes it (comfy_extras/
    nodes_lora_extract.py): low-rank `lora_up/down` (or `.diff`) for each matrix, `.diff` for 1-D weights (norms),
    `.diff_b` for each bias — keys "diffusion_model.<native>..." with `.weight` cut off. `norm_param`: the name the
    norms' parameter has in that ComfyUI's model (FLUX.2's RMSNorms: `weight`; FLUX.1's before it: `scale`, which
    the extract does not write at all)."""
    sd = load_component(tiny(family) / "transformer").state_dict()
    out = {}
    for k, w in native_weights(sd, family).items():
        k = k.removeprefix("diffusion_model.")
        m = k.rsplit(".", 1)[0]
        if k.endswith(".bias"):
            out[f"diffusion_model.{m}.diff_b"] = r(*w.shape).half()
        elif k.endswith(".weight") and w.dim() == 2 and not any(s in m for s in skip_weights):
            if full:
                out[f"diffusion_model.{m}.diff"] = r(*w.shape).half()
            else:
                out[f"diffusion_model.{m}.lora_up.weight"] = r(w.shape[0], 4).half()
                out[f"diffusion_model.{m}.lora_down.weight"] = r(4, w.shape[1]).half()
        elif k.endswith(".scale") and norm_param == "weight":
            out[f"diffusion_model.{m}.diff"] = r(*w.shape).half()
    return out


@pytest.mark.parametrize("family, case", [("flux2-klein", "norms named weight"), ("flux", "norms named weight"),
                                          ("flux", "bias without its weight"), ("flux", "full differences")])
def test_comfyuis_own_extracts_rewrite_to_comfyui_and_kohya_as_comfyui_reads_them(tiny, tmp_path, family, case):
    """A false DIFFER: ComfyUI's FLUX.2 model-diff extract (`...norm.key_norm.diff`: its norms' parameter is `weight`
    there, `scale` in FLUX.1's model) was refused `--to comfyui/kohya` as "8 key(s) ComfyUI would not load" and its
    output deleted; and a FLUX extract whose fused qkv has a bias difference but no weight patch could not be
    rewritten without --model. Both names are read; a bias alone finds its weight's key as ComfyUI's map does."""
    skip = ("qkv",) if case == "bias without its weight" else ()
    save_file(_extract(tiny, family, skip_weights=skip, full=case == "full differences"), tmp_path / "x.safetensors")
    for fmt in ("comfyui", "kohya"):
        for extra in ([], ["--model", str(tiny(family))]):
            dst = tmp_path / f"o-{fmt}-{len(extra)}.safetensors"
            r_, out = _convert(tmp_path / "x.safetensors", dst, "--to", fmt, "--family", family, *extra)
            assert r_.exit_code == 0 and out["equal"] and dst.is_file(), (fmt, extra, r_.output[-600:])
            assert out["checks"]["comfyui"] == "equal" and out["not_converted"] == [], out["checks"]


def test_a_dora_scale_on_the_input_axis_converts_where_a_layout_holds_it_and_is_refused_by_name_elsewhere(tiny,
                                                                                                         tmp_path):
    """LyCORIS' DoRA with wd_on_out=False stores `dora_scale` as (1, in): refused everywhere before, with a hint to
    pass --model that did not apply (it was given). ComfyUI and kohya layouts keep it exactly (compared without the
    base: the same vector and the same low-rank change); diffusers and peft scale output rows only: said so."""
    m = "transformer_blocks.0.attn.to_q"
    W = load_component(tiny("qwen-image") / "transformer").state_dict()[f"{m}.weight"].float()
    save_file({f"diffusion_model.{m}.lora_up.weight": r(H, 4), f"diffusion_model.{m}.lora_down.weight": r(4, H),
               f"diffusion_model.{m}.alpha": torch.tensor(4.0),
               f"diffusion_model.{m}.dora_scale": W.norm(dim=0, keepdim=True) * 1.1}, tmp_path / "in.safetensors")
    for fmt in ("comfyui", "kohya"):
        for extra in ([], ["--model", str(tiny("qwen-image"))]):
            r_, out = _convert(tmp_path / "in.safetensors", tmp_path / f"{fmt}{len(extra)}.safetensors", "--to", fmt,
                               "--family", "qwen-image", *extra)
            assert r_.exit_code == 0 and out["equal"], r_.output[-400:]
            assert out["checks"]["comfyui"] == ("equal" if extra else "not compared: DoRA needs the base weights "
                                                                      "(--model)")
    for extra in ([], ["--model", str(tiny("qwen-image"))]):
        r_, out = _convert(tmp_path / "in.safetensors", tmp_path / "d.safetensors", "--to", "diffusers", "--family",
                           "qwen-image", *extra)
        assert r_.exit_code == 2 and "input axis" in r_.output and "--to comfyui" in r_.output, r_.output
        assert "pass the model" not in r_.output  # the hint that did not apply
