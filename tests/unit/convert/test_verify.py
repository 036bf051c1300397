"""The consumer check `lorakit train` runs on every LoRA file it saves: ComfyUI's reading through probes, without
the dense differences (a full-size model's would be its whole weight set in float64, minutes per checkpoint)."""

import torch

from lorakit.convert import comfy
from lorakit.convert import verify as V
from lorakit.io import load, save
from lorakit.models.registry import family_info
from tests.loras import trained_like


def test_comfy_probe_equals_the_dense_difference(tiny, tmp_path):
    # FLUX, every block Linear and the io layers: fused q/k/v (row offsets) and the final norm (swapped halves)
    path = trained_like(tiny, "flux", tmp_path / "l.safetensors", targets="all_linear", rank=4, alpha=8, io=True)
    from lorakit.io.modules import load_component
    from lorakit.models.native import native_weights

    arch = family_info("flux").arch
    base = native_weights(load_component(tiny("flux") / "transformer").state_dict(), arch)
    patches, _ = comfy.load(load(path, copy=True), comfy.key_map(arch, {k: tuple(v.shape) for k, v in base.items()}))
    g = torch.Generator().manual_seed(1)
    kinds = {"offset": 0, "swap": 0, "whole": 0}
    for target, p in patches.items():
        key, offset, function = (target, None, None) if isinstance(target, str) else target
        W = base[key].double()
        if W.dim() != 2:
            continue
        x = torch.randn(W.shape[1], 3, generator=g, dtype=torch.float64)
        dense = (comfy.calculate(W, p, offset, function) - W) @ x
        got = comfy.probe(p, x, W.shape[0], offset, function)
        assert got is not None, target
        assert torch.allclose(got, dense, rtol=1e-10, atol=1e-12), target
        kinds["swap" if function else "offset" if offset else "whole"] += 1
    assert all(kinds.values()), kinds  # each way a patch lands was compared


def test_comfy_probe_leaves_dora_to_the_dense_form():
    up, down = torch.randn(6, 2), torch.randn(2, 5)
    assert comfy.probe(("lora", up, down, 2.0, torch.ones(6)), torch.randn(5, 2), 6) is None
    assert comfy.probe(("lora", up, down, None, None), torch.randn(5, 2), 6) is not None


def test_the_consumer_check_finds_a_wrong_row_block_of_a_fused_weight(tiny, tmp_path):
    from peft import LoraConfig

    import lorakit.train.lora as tl
    from lorakit.io.modules import load_component
    from lorakit.models.base import family_adapter

    tr = load_component(tiny("flux") / "transformer")
    names = tl.target_modules(tr, family_adapter("flux"), "attention")
    tr.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=names, init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(0)
    for n, p in tr.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=g)
    path = tmp_path / "l.safetensors"
    assert tl.save_lora(tr, path, "flux") == {"diffusers": "equal", "comfyui": "equal"}
    sd = load(path, copy=True)
    k = next(k for k in sd if k.endswith("transformer_blocks.0.attn.to_k.lora_B.weight"))
    sd[k] = sd[k] * 1.01  # k's rows of ComfyUI's fused qkv weight
    save(sd, path)
    got = V.check_file(path, "flux", V.trained(tr), shapes=V.module_shapes(tr))
    assert got["comfyui"].startswith("double_blocks.0.img_attn.qkv: relative difference"), got
    assert "relative difference" in got["diffusers"], got
