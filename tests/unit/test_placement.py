"""Where inference weights wait: sizes from the headers, the choice against the card's memory."""

import pytest

from lorakit import placement
from lorakit.errors import InputError


def test_component_sizes_come_from_the_headers_at_the_run_dtype(tiny):
    import torch

    from lorakit.io.modules import load_component

    folder = tiny("flux")
    sizes = placement.component_gib(folder, ["transformer", "vae", "tokenizer", "missing"], 2)
    assert set(sizes) == {"transformer", "vae"}  # weightless or absent components are not counted
    model = load_component(folder / "transformer", "cpu", torch.float32)
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert sizes["transformer"] == pytest.approx(round(n * 2 / 2**30, 2), abs=0.011)


@pytest.mark.parametrize("budget,mode", [(80, "none"), (24, "group"), (30, "model")])
def test_the_plan_follows_the_card(budget, mode):
    # FLUX.1-dev in bf16: transformer 22.2, T5 8.9, CLIP 0.2, VAE 0.2 GiB
    sizes = {"transformer": 22.2, "text_encoder_2": 8.9, "text_encoder": 0.2, "vae": 0.2}
    plan = placement.choose(sizes, budget)
    assert plan.mode == mode
    assert f"{budget:.1f} GiB" in plan.why


def test_a_forced_mode_wins_and_a_bad_one_is_refused():
    assert placement.choose({"transformer": 1.0}, 80, "group").mode == "group"
    with pytest.raises(InputError, match="--offload fast"):
        placement.choose({"transformer": 1.0}, 80, "fast")


def test_the_cap_is_the_budget(monkeypatch):
    monkeypatch.setenv("LORAKIT_MEMORY_CAP_GIB", "24")
    assert placement.budget_gib("cuda") == 24.0
