"""Components built on meta and filled by lorakit.io equal what the stock libraries load."""

import json

import pytest
import torch

from lorakit.io.modules import load_component
from lorakit.models.registry import family_names


def _components(folder):
    index = json.loads((folder / "model_index.json").read_text())
    return [k for k, v in index.items() if isinstance(v, list) and (folder / k / "config.json").is_file()]


@pytest.mark.parametrize("family", family_names())
def test_every_component_matches_the_stock_loader(tiny, family, monkeypatch):
    import diffusers
    import transformers

    folder = tiny(family)
    for comp in _components(folder):
        cfg = json.loads((folder / comp / "config.json").read_text())
        lib, name = (diffusers, cfg["_class_name"]) if "_class_name" in cfg else (transformers,
                                                                                 cfg["architectures"][0])
        ref = getattr(lib, name).from_pretrained(folder / comp)
        ours = load_component(folder / comp)
        a, b = ref.state_dict(), ours.state_dict()
        assert a.keys() == b.keys(), comp
        for k in a:
            assert torch.equal(a[k], b[k]), (comp, k)
        assert not any(p.is_meta for p in ours.parameters()) and not any(x.is_meta for x in ours.buffers())
        assert not any(p.requires_grad for p in ours.parameters())


def test_dtype_cast_at_load(tiny):
    m = load_component(tiny("qwen-image") / "transformer", dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}


def test_transformer_output_equals_stock(tiny):
    from diffusers import FluxTransformer2DModel

    folder = tiny("flux") / "transformer"
    ref, ours = FluxTransformer2DModel.from_pretrained(folder), load_component(folder)
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
              pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
              img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), guidance=torch.tensor([3.5]), return_dict=False)
    assert torch.equal(ref(**kw)[0], ours(**kw)[0])


def test_not_a_component_folder(tmp_path):
    from lorakit.errors import InputError

    with pytest.raises(InputError, match="config.json"):
        load_component(tmp_path)
