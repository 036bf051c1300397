"""LoRA targets from the family's presets, and the LoRA file's round trip."""

import pytest
import torch

from lorakit.errors import ConfigError
from lorakit.io.modules import load_component
from lorakit.models.base import family_adapter
from lorakit.train.lora import add_lora, load_lora_into, lora_state_dict, save_lora, target_modules


@pytest.fixture
def flux(tiny):
    return load_component(tiny("flux") / "transformer")


def test_presets_are_the_familys_and_stay_inside_the_blocks(flux):
    a = family_adapter("flux")
    attn = target_modules(flux, a, "attention")
    assert attn and all("blocks." in n and n.split(".")[-1] in {"to_q", "to_k", "to_v", "0", "add_q_proj",
                                                               "add_k_proj", "add_v_proj", "to_add_out"} for n in attn)
    assert "proj_out" not in target_modules(flux, a, "all_linear")  # the top-level output projection is io


def test_io_adds_exactly_the_latent_layers(flux):
    a = family_adapter("flux")
    extra = set(target_modules(flux, a, "attention", io=True)) - set(target_modules(flux, a, "attention"))
    assert extra == {"x_embedder", "norm_out.linear", "proj_out"}


def test_explicit_names_may_be_anywhere_and_typos_are_named(flux):
    a = family_adapter("flux")
    found = target_modules(flux, a, ["proj_out"])
    assert "proj_out" in found and any(n.startswith("single_transformer_blocks.") for n in found)
    with pytest.raises(ConfigError, match="'to_qq'"):
        target_modules(flux, a, ["to_q", "to_qq"])


def test_a_preset_the_model_lacks_is_an_error_not_an_empty_lora(tiny):
    # the Kandinsky 5 bug: FLUX's attention names on a Kandinsky 5 transformer used to train nothing silently
    k5 = load_component(tiny("kandinsky5-t2i") / "transformer")
    with pytest.raises(ConfigError, match="does not have"):
        target_modules(k5, family_adapter("flux"), "attention")
    assert target_modules(k5, family_adapter("kandinsky5-t2i"), "attention")


def test_the_adapter_is_made_on_the_device_it_is_given_not_copied_there_layer_by_layer(flux, tmp_path):
    from tests.unit.train.test_loop import make_cfg

    cfg = make_cfg(tmp_path, "flux", tmp_path / "unused")
    add_lora(flux, family_adapter("flux"), cfg, device="meta")  # base on the CPU: peft leaves a meta adapter where
    lora = {n: p.device.type for n, p in flux.named_parameters() if "lora_" in n}  # it was made (CPU-made: copied)
    assert lora and set(lora.values()) == {"meta"}
    assert {p.device.type for n, p in flux.named_parameters() if "lora_" not in n} == {"cpu"}


def test_saved_lora_loads_back_bit_for_bit(flux, tmp_path):
    from peft import LoraConfig

    names = target_modules(flux, family_adapter("flux"), "attention")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=names, init_lora_weights="gaussian")
    flux.add_adapter(cfg)
    for n, p in flux.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape)
    check = save_lora(flux, tmp_path / "l.safetensors", "flux", {"lorakit_step": 3})
    assert check == {"diffusers": "equal", "comfyui": "equal"}  # read back as each consumer reads it
    before = {k: v.clone() for k, v in lora_state_dict(flux).items()}
    for n, p in flux.named_parameters():
        if "lora_" in n:
            p.data.zero_()
    load_lora_into(flux, before)  # what a checkpoint's state.pt holds: the trainable tensors exactly
    after = lora_state_dict(flux)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_lora_layers_take_their_bf16_input_as_it_is_the_same_loss_and_grads_with_fewer_copies(tmp_path, tiny):
    """The LoRA weights train in fp32 under a bf16 autocast: peft's cast of each LoRA layer's input to fp32 only made
    copies (the autocast matmul casts it back). Off (`keep_input_dtype`, what every run does): the loss and every
    trained gradient are the same to the bit, with fewer copies of the activations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lorakit.cache.builder import build, cache_dir_for
    from lorakit.cache.store import Store
    from lorakit.models.base import load_adapter
    from lorakit.train.data import CachedData
    from lorakit.train.inputs import draw
    from lorakit.train.trainer import Trainer
    from tests.unit.train.test_loop import make_cfg

    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2, lora={"dropout": 0.0})
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "bf16"})})  # the real dtype
    a = load_adapter("flux", tiny("flux"))
    build(cfg, adapter=a)
    st = Store(cache_dir_for(cfg))
    tr = Trainer(cfg, a, load_component(tiny("flux") / "transformer", dtype=torch.bfloat16),
                 CachedData(st, st.read_manifest(), 1, 0), tmp_path / "o", "cpu", torch.bfloat16)
    layers = [m for m in tr.transformer.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)  # what prepare left
    g = torch.Generator().manual_seed(3)
    for n, p in tr.transformer.named_parameters():
        if "lora_B" in n:  # a LoRA that has trained: its products matter
            p.data = torch.randn(p.shape, generator=g) * 0.05
    assert all(p.dtype == torch.float32 for p in tr.params)
    inputs = draw(tr, 0, 0)

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                Copies.n += 1
            return func(*args, **(kwargs or {}))

    def once(cast: bool):
        for m in layers:
            m.cast_input_dtype_enabled = cast
        for p in tr.params:
            p.grad = None
        Copies.n = 0
        with Copies():
            loss = tr.loss_on(inputs.batch, inputs.sigmas, inputs.noise)
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in tr.params], Copies.n

    kept, grads, copies = once(cast=False)
    cast_loss, cast_grads, cast_copies = once(cast=True)
    assert torch.equal(kept, cast_loss)
    assert all(torch.equal(x, y) for x, y in zip(grads, cast_grads, strict=True))
    assert cast_copies - copies >= 3 * len(layers)  # tiny FLUX, 22 LoRA layers: 179 copies against 255
