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


@pytest.mark.parametrize("budget,fp8,mode", [(80, 11.9, "none"), (30, 11.9, "model"), (24, 11.9, "fp8"),
                                             (24, None, "group"), (14, 11.9, "group")])
def test_the_plan_follows_the_card(budget, fp8, mode):
    # FLUX.1-dev in bf16: transformer 22.2 (11.9 with fp8 blocks), T5 8.9, CLIP 0.2, VAE 0.2 GiB
    sizes = {"transformer": 22.2, "text_encoder_2": 8.9, "text_encoder": 0.2, "vae": 0.2}
    plan = placement.choose(sizes, budget, fp8_sizes=fp8 and {"transformer": fp8})
    assert plan.mode == mode
    assert f"{budget:.1f} GiB" in plan.why


def test_qwen_image_fits_a_24_gib_card_with_fp8_blocks_and_its_encoder_alone():
    # Qwen-Image: transformer 38.1 GiB in bf16 (19.1 with fp8 blocks), Qwen2.5-VL 15.4, VAE 0.2
    sizes = {"transformer": 38.1, "text_encoder": 15.4, "vae": 0.2}
    assert placement.choose(sizes, 24, fp8_sizes={"transformer": 19.1}).mode == "fp8"
    assert placement.choose(sizes, 20, fp8_sizes={"transformer": 19.1}).mode == "group"


def test_wan_a14b_fits_a_24_gib_card_with_both_experts_in_fp8():
    # Wan 2.2 T2V-A14B: two 14B experts of 26.6 GiB in bf16 (13.8 each with fp8 blocks), umT5-XXL 10.6, VAE 0.5. Where
    # only the first transformer was offered fp8 the second (26.6 GiB) sent every component to `group`: bf16 blocks
    # streamed from 65 GiB of host memory (H100 at 24 GiB, 2026-11-27)
    sizes = {"transformer": 26.6, "transformer_2": 26.6, "text_encoder": 10.6, "vae": 0.5}
    plan = placement.choose(sizes, 24, fp8_sizes={"transformer": 13.8, "transformer_2": 13.8})
    assert plan.mode == "fp8" and "each of the 2 transformers (26.6 + 26.6 GiB)" in plan.why
    assert placement.choose(sizes, 24, fp8_sizes={"transformer": 13.8}).mode == "group"  # one not offered


def test_fp8_size_is_what_quantize_blocks_makes(tiny):
    import torch

    from lorakit.io.modules import load_component
    from lorakit.train.quant import quantize_blocks

    folder = tiny("flux")
    model = load_component(folder / "transformer", "cpu", torch.bfloat16)
    assert quantize_blocks(model, torch.bfloat16) > 0
    n = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    assert placement.fp8_bytes(folder / "transformer", 2) == n


def test_a_forced_mode_wins_and_a_bad_one_is_refused():
    assert placement.choose({"transformer": 1.0}, 80, "group").mode == "group"
    with pytest.raises(InputError, match="--offload fast"):
        placement.choose({"transformer": 1.0}, 80, "fast")


def test_swap_keeps_one_component_on_the_device_and_never_copies_back(tiny):
    """The model/fp8 placement on a CPU stand-in: each component is brought before it runs (its hook, also
    before a VAE's decode), the one before it put away by dropping the copy, and the images are the same."""
    import numpy as np
    import torch

    from lorakit.infer import assemble

    folder = tiny("flux")
    pipe, _ = assemble(folder, "cpu", torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle", num_inference_steps=2, width=64, height=64)
    ref = np.asarray(pipe(**kw, generator=torch.Generator().manual_seed(1)).images[0])
    plan = placement.Plan("model", "test", {})
    swap = placement.apply(pipe, plan, "cpu")
    seen = []
    bring = swap.bring
    swap.bring = lambda m: (seen.append(type(m).__name__), bring(m))
    host = {id(t): t.data.data_ptr() for t in pipe.transformer.parameters()}
    out = np.asarray(pipe(**kw, generator=torch.Generator().manual_seed(1)).images[0])
    assert np.array_equal(out, ref)
    order = [n for i, n in enumerate(seen) if i == 0 or seen[i - 1] != n]
    assert order == ["CLIPTextModel", "T5EncoderModel", "FluxTransformer2DModel", "AutoencoderKL"]
    assert swap.current is pipe.vae and pipe._execution_device == torch.device("cpu")
    # the transformer was put away: its parameters point at the very CPU tensors they started with
    assert all(t.data.data_ptr() == host[id(t)] for t in pipe.transformer.parameters())


def test_importing_the_planner_does_not_import_torch():
    # `lorakit infer --offload BAD` is refused from this module before any heavy import
    import subprocess
    import sys

    code = "import sys, lorakit.placement; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_text_encoder_larger_than_the_card_streams_while_the_rest_is_placed():
    """A 45 GiB encoder (FLUX.2 [dev]'s) beside a transformer whose fp8 form fits the card: the encoder cannot
    visit whole, so its blocks stream; the rest is placed as before."""
    sizes = {"text_encoder": 44.7, "transformer": 60.0, "vae": 0.2}
    plan = placement.choose(sizes, 32, fp8_sizes={"transformer": 30.8 - 3.5})
    assert plan.mode == "fp8" and plan.streamed == ("text_encoder",) and "streamed block by block" in plan.why
    assert placement.choose(sizes, 24, fp8_sizes={"transformer": 30.8}).mode == "group"  # the transformer cannot either
    small = placement.choose({"text_encoder": 15.4, "transformer": 38.1, "vae": 0.2}, 24,
                             fp8_sizes={"transformer": 19.1})
    assert small.mode == "fp8" and small.streamed == ()  # Qwen-Image on 24 GiB: as before


def test_group_streams_every_components_blocks_and_the_images_are_the_same(tiny):
    """`group` on a CPU stand-in, FLUX.2 [dev]'s tiny pipeline: the Mistral encoder's layers and the transformer's
    blocks each visit alone, the rest stays, and the image is the resident pipeline's."""
    import numpy as np
    import torch

    from lorakit.infer import assemble

    pipe, _ = assemble(tiny("flux2-dev"), "cpu", torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle", num_inference_steps=2, width=64, height=64)
    ref = np.asarray(pipe(**kw, generator=torch.Generator().manual_seed(1)).images[0])
    blocks = [*pipe.text_encoder.model.language_model.layers, *pipe.transformer.transformer_blocks]
    before = [len(m._forward_pre_hooks) for m in blocks]
    said: dict = {}
    placement.apply(pipe, placement.Plan("group", "test", {}), "cpu", streamed=said)
    assert [len(m._forward_pre_hooks) for m in blocks] == [n + 1 for n in before]  # each visits when it runs
    # the transformer's host copies are made first (it visits every step): it gets the host's room to page-lock
    assert list(said) == ["transformer", "vae", "text_encoder"] and not any(h["pinned"] for h in said.values())
    out = np.asarray(pipe(**kw, generator=torch.Generator().manual_seed(1)).images[0])
    assert np.array_equal(out, ref)


def test_a_streamed_component_left_in_pageable_memory_is_said():
    from lorakit.infer import unpinned_warnings

    said = {"transformer": {"streamed_gib": 58.66, "pinned": True}, "text_encoder": {"streamed_gib": 41.41,
            "pinned": False}, "vae": {"streamed_gib": 0.0, "pinned": False}, "other": None}
    (w,) = unpinned_warnings(said)
    assert w.startswith("text_encoder: 41.4 GiB of blocks stream from pageable memory (the host has no room to "
                        "page-lock them)")
    # a host with room for part of it: the part said (H100, 2026-11-26: 51 of the transformer's 58.7 GiB
    # page-locked)
    (w,) = unpinned_warnings({"transformer": {"streamed_gib": 58.66, "pinned": False, "pageable_gib": 7.7}})
    assert w.startswith("transformer: 7.7 of its 58.7 GiB of blocks stream from pageable memory")


# Kandinsky 5 T2V Lite in bf16: Qwen2.5-VL 15.4, transformer 3.8, CLIP 0.2, HunyuanVideo VAE 0.5 GiB (19.9 in all)
K5_T2V = {"transformer": 3.8, "text_encoder": 15.4, "text_encoder_2": 0.2, "vae": 0.5}


@pytest.mark.parametrize("vae,w,h,f,measured", [
    ("AutoencoderKLHunyuanVideo", 512, 512, 17, 14.17), ("AutoencoderKLHunyuanVideo", 512, 512, 121, 14.33),
    ("AutoencoderKLHunyuanVideo", 768, 512, 121, 21.49), ("AutoencoderKLHunyuanVideo", 1024, 576, 17, 31.77),
    ("AutoencoderKLHunyuanVideo", 512, 512, 5, 4.55), ("AutoencoderKLHunyuanVideo", 512, 512, 1, 1.23),
    ("AutoencoderKL", 1024, 1024, 1, 2.38), ("AutoencoderKL", 2048, 2048, 1, 9.50),
    ("AutoencoderKLQwenImage", 1536, 1536, 1, 9.29), ("AutoencoderKLQwenImage", 2048, 2048, 1, 16.51)])
def test_the_decode_estimate_follows_the_h100_measurements(vae, w, h, f, measured):
    # the peaks measured on an H100, 2026-11-26 (the comment above DECODE_GIB_PER_MPX): never more than 3% under
    got = placement.decode_need(vae, w, h, f).whole_gib
    assert measured * 0.97 <= got <= measured * 1.06


def test_an_unmeasured_vae_keeps_the_fixed_headroom():
    assert placement.decode_need("AutoencoderKLWan", 1024, 1024) is None
    assert placement.choose(K5_T2V, 32, decode=None).mode == "none"


def test_a_kandinsky5_clip_whose_decode_does_not_fit_beside_the_weights_visits_component_by_component():
    """512² x 17 frames on the rtx5090's 32 GiB: the weights (19.9) fit, their decode (14.2) beside them does not
    (resident, the decode had fallen back to slower cuDNN algorithms: 45 dB from the stock pipeline; at 768x512 x 121
    frames it ran out of memory)."""
    for w, h, f in ((512, 512, 17), (768, 512, 121), (832, 480, 17)):
        plan = placement.choose(K5_T2V, 32, decode=placement.decode_need("AutoencoderKLHunyuanVideo", w, h, f))
        assert (plan.mode, plan.tile_vae) == ("model", False), (w, h, f, plan.why)
    big = placement.choose(K5_T2V, 80, decode=placement.decode_need("AutoencoderKLHunyuanVideo", 768, 512, 121))
    assert (big.mode, big.tile_vae) == ("none", False) and "23.9 GiB to work in" in big.why


def test_a_decode_larger_than_the_card_or_its_kernels_runs_in_tiles():
    wide = placement.decode_need("AutoencoderKLHunyuanVideo", 1024, 576, 121)
    plan = placement.choose(K5_T2V, 32, decode=wide)
    assert plan.tile_vae and "needs 32.8 GiB" in plan.why and "not equal" in plan.why
    square = placement.decode_need("AutoencoderKLHunyuanVideo", 1024, 1024, 17)  # 2^31 values in one upsampling
    assert not square.whole_ok
    plan = placement.choose(K5_T2V, 80, decode=square)
    assert plan.tile_vae and plan.mode == "none" and "kernels' limits" in plan.why
    forced = placement.choose(K5_T2V, 80, "model", decode=square)  # --offload decides where, not how to decode
    assert forced.tile_vae and forced.mode == "model"


@pytest.mark.parametrize("budget,fp8,mode", [(80, 11.9, "none"), (30, 11.9, "model"), (24, 11.9, "fp8")])
def test_flux_at_1024_is_placed_as_before_its_decode_was_counted(budget, fp8, mode):
    sizes = {"transformer": 22.2, "text_encoder_2": 8.9, "text_encoder": 0.2, "vae": 0.2}
    plan = placement.choose(sizes, budget, fp8_sizes=fp8 and {"transformer": fp8},
                            decode=placement.decode_need("AutoencoderKL", 1024, 1024))
    assert (plan.mode, plan.tile_vae) == (mode, False)


def test_a_tiled_plan_turns_the_vaes_tiling_on(tiny):
    import torch

    from lorakit.infer import assemble

    pipe, _ = assemble(tiny("kandinsky5-t2v"), "cpu", torch.float32)
    assert not pipe.vae.use_tiling
    placement.apply(pipe, placement.Plan("none", "test", {}, tile_vae=True), "cpu")
    assert pipe.vae.use_tiling


def test_infer_sizes_the_decode_as_the_pipeline_will_make_it(tiny):
    import json

    from lorakit.infer import Request, _decode
    from lorakit.models.base import family_adapter

    def index(family):
        return json.loads((tiny(family) / "model_index.json").read_text())

    k5, facts = index("kandinsky5-t2v"), family_adapter("kandinsky5-t2v")
    default = _decode(k5, facts, Request(prompts=["x"]))  # Kandinsky5T2VPipeline's own 768x512
    assert (default.size, default.whole_ok) == ("768x512 x 17 frames", True)
    asked = _decode(k5, facts, Request(prompts=["x"], width=768, height=512, frames=121))
    assert asked.size == "768x512 x 121 frames" and 21 < asked.whole_gib < 23
    flux = _decode(index("flux"), family_adapter("flux"), Request(prompts=["x"], width=2048))
    assert flux.size == "2048x2048" and 9 < flux.whole_gib < 10
