"""A run that cannot fit is refused before any weights load, with the estimate and what would fit."""

import json
from pathlib import Path

import pytest

from lorakit.config import validate
from lorakit.errors import InputError
from lorakit.plan.memory import estimate
from lorakit.plan.resolve import resolve
from lorakit.train.loop import run


def fake_model(tmp_path, family_cfg: dict, total_size: int):
    """A model folder with only what the estimate reads (no weights: nothing could be loaded)."""
    t = tmp_path / "model" / "transformer"
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps(family_cfg))
    (t / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": {}}))
    (tmp_path / "model" / "model_index.json").write_text("{}")  # a pipeline folder's marker (paths are checked)
    return tmp_path / "model"


QWEN = {"_class_name": "QwenImageTransformer2DModel", "num_layers": 60, "num_attention_heads": 24,
        "attention_head_dim": 128}
FLUX = {"_class_name": "FluxTransformer2DModel", "num_layers": 19, "num_single_layers": 38,
        "num_attention_heads": 24, "attention_head_dim": 128}


def cfg_for(path, family, profile, res, **mem):
    from lorakit.config import deep_merge
    from lorakit.hardware.profiles import load_profile
    from lorakit.models.registry import family_info

    # the family's pipeline named in the index, as in its real folder (the paths check compares them)
    (Path(path) / "model_index.json").write_text(json.dumps({"_class_name": family_info(family).pipeline_class}))
    raw = deep_merge(load_profile(profile).defaults, {
        "profile": profile, "model": {"family": family, "path": str(path)},
        "data": {"dirs": [str(path)], "resolution": res}, "memory": mem})  # any existing folder
    return validate(raw)


def test_estimate_matches_the_measured_baselines(tmp_path):
    flux = cfg_for(fake_model(tmp_path / "f", FLUX, int(11.9e9 * 2)), "flux", "datacenter", 1024,
                   gradient_checkpointing=False)
    assert 44 <= estimate(flux)["gib"] <= 51  # measured: 46.8 GiB (BASELINES.md)
    qwen = cfg_for(fake_model(tmp_path / "q", QWEN, int(20.4e9 * 2)), "qwen-image", "datacenter", 1024,
                   gradient_checkpointing=True)
    assert 39 <= estimate(qwen)["gib"] <= 45  # measured: 40.9 GiB


def test_2048_on_rtx4090_is_refused_before_loading_with_a_suggestion(tmp_path):
    cfg = cfg_for(fake_model(tmp_path, QWEN, int(20.4e9 * 2)), "qwen-image", "rtx4090", 2048)
    with pytest.raises(InputError) as ei:
        run(resolve(cfg))  # the folder holds no weights: getting past the check would fail differently
    msg, hint = ei.value.message, ei.value.hint
    assert "needs about" in msg and "rtx4090 profile has 24" in msg and "activations" in msg
    assert "memory.blocks_to_swap=" in hint  # what would fit, as a setting this build honours


def test_suggestions_are_settings_this_build_honours(tmp_path):
    cfg = cfg_for(fake_model(tmp_path, FLUX, int(11.9e9 * 2)), "flux", "datacenter", 2048,
                  gradient_checkpointing=False)
    with pytest.raises(InputError) as ei:
        from lorakit.plan.memory import check

        check(cfg, 40.0)
    assert "memory.gradient_checkpointing=true" in ei.value.hint and "blocks_to_swap" not in ei.value.hint


def test_a_fitting_config_passes_the_check(tmp_path):
    from lorakit.plan.memory import fit_to_gpu

    cfg = cfg_for(fake_model(tmp_path, FLUX, int(11.9e9 * 2)), "flux", "rtx4090", 512)
    out, est, note = fit_to_gpu(cfg)
    assert est["gib"] < 23.6 and est["parts"]["base"] < 12
    # at 512² every block's activations fit beside the 8-bit base: the default (auto) recomputes none, and says so
    assert not out.memory.gradient_checkpointing and "checkpointing off" in note
    _, _, note = fit_to_gpu(out.model_copy(update={"memory": out.memory.model_copy(
        update={"gradient_checkpointing": True, "checkpoint_blocks": "all"})}))
    assert note is None  # asked for all: as asked


def test_checkpointing_is_turned_on_only_when_needed(tmp_path):
    from lorakit.plan.memory import fit_to_gpu

    model = fake_model(tmp_path, FLUX, int(11.9e9 * 2))
    cfg = cfg_for(model, "flux", "datacenter", 1024, gradient_checkpointing=False)
    out, est, note = fit_to_gpu(cfg, cap_gib=79.0)  # fits as it is: no recompute
    assert not out.memory.gradient_checkpointing and note is None
    out, est, note = fit_to_gpu(cfg, cap_gib=40.0)  # 1024² without checkpointing needs ~49 GiB
    assert out.memory.gradient_checkpointing and "gradient checkpointing on" in note and est["gib"] < 40


def test_auto_checkpoints_only_the_blocks_that_must_recompute(tmp_path):
    from lorakit.plan.memory import PLAN_MARGIN_GIB, fit_to_gpu

    flux = fake_model(tmp_path / "f", FLUX, int(11.9e9 * 2))
    every = cfg_for(flux, "flux", "rtx4090", 1024, checkpoint_blocks="all")
    out, est, note = fit_to_gpu(every, cap_gib=24.0)
    assert out.memory.checkpoint_blocks == "all" and note is None  # asked for: every block
    auto = cfg_for(flux, "flux", "rtx4090", 1024)  # the default
    assert auto.memory.checkpoint_blocks == "auto"
    out, est, note = fit_to_gpu(auto, cap_gib=24.0)
    n = out.memory.checkpoint_blocks
    assert 0 < n < 57 and out.memory.gradient_checkpointing and f"on {n} of 57 blocks" in note
    assert est["gib"] <= 24.0 - PLAN_MARGIN_GIB
    fewer = out.model_copy(update={"memory": out.memory.model_copy(update={"checkpoint_blocks": n - 1})})
    assert estimate(fewer)["gib"] > 24.0 - PLAN_MARGIN_GIB  # the fewest that fit
    # every block's activations fit on an 80 GiB card: checkpointing off
    out, _, note = fit_to_gpu(auto, cap_gib=79.0)
    assert not out.memory.gradient_checkpointing and "checkpointing off" in note
    # Qwen-Image under 24 GiB already needs all 60 (estimate 23.8): unchanged, no note
    qwen = cfg_for(fake_model(tmp_path / "q", QWEN, int(20.4e9 * 2)), "qwen-image", "rtx4090", 1024,
                   checkpoint_blocks="auto")
    out, est, note = fit_to_gpu(qwen, cap_gib=24.0)
    assert out.memory.checkpoint_blocks == 60 and out.memory.gradient_checkpointing and note is None
    # block swapping keeps whole-model checkpointing
    swap = cfg_for(flux, "flux", "rtx4090", 1024, checkpoint_blocks="auto", blocks_to_swap=4)
    assert fit_to_gpu(swap, cap_gib=24.0)[0].memory.checkpoint_blocks == "auto"


def test_fsdp_keeps_as_many_blocks_gathered_as_the_card_has_room_for(tmp_path):
    """A full fine-tune on 2 GPUs: each kept block's full weights are counted, and auto keeps the most that fit in
    85% of the card (FLUX.1-dev on a 100 GiB card: some; on a 141 GB card: all 57, as measured on 2x H200; on an
    80 GB card: none); one GPU, LoRA or a count given are left as they are; a negative count is refused."""
    from lorakit.errors import ConfigError
    from lorakit.plan.memory import GATHER_HEADROOM, fit_to_gpu

    flux = fake_model(tmp_path, FLUX, int(11.9e9 * 2))
    full = cfg_for(flux, "flux", "datacenter", 1024).model_copy(update={"method": "full"})
    assert full.memory.gathered_blocks == "auto"
    out, est, note = fit_to_gpu(full, cap_gib=100.0, world=2)
    n = out.memory.gathered_blocks
    assert 0 < n < 57 and f"the last {n} of 57 blocks keep their gathered weights" in note
    assert est["gib"] <= 100.0 * (1 - GATHER_HEADROOM)
    more = out.model_copy(update={"memory": out.memory.model_copy(update={"gathered_blocks": n + 1})})
    assert estimate(more, 2)["gib"] > 100.0 * (1 - GATHER_HEADROOM)  # the most that fit
    none = out.model_copy(update={"memory": out.memory.model_copy(update={"gathered_blocks": 0})})
    assert estimate(out, 2)["gib"] - estimate(none, 2)["gib"] == pytest.approx(n * 11.9e9 * 2 / 57 / 2**30, abs=0.1)
    assert fit_to_gpu(full, cap_gib=140.0, world=2)[0].memory.gathered_blocks == 57
    out, _, note = fit_to_gpu(full, cap_gib=79.0, world=2)
    assert out.memory.gathered_blocks == 0 and note is None
    assert fit_to_gpu(full, cap_gib=140.0, world=1)[0].memory.gathered_blocks == "auto"  # no FSDP
    lora = cfg_for(flux, "flux", "datacenter", 1024)
    assert fit_to_gpu(lora, cap_gib=140.0, world=2)[0].memory.gathered_blocks == "auto"
    given = full.model_copy(update={"memory": full.memory.model_copy(update={"gathered_blocks": 3})})
    assert fit_to_gpu(given, cap_gib=140.0, world=2)[0].memory.gathered_blocks == 3
    with pytest.raises(ConfigError, match="gathered_blocks"):
        cfg_for(flux, "flux", "datacenter", 1024, gathered_blocks=-1)


def test_checkpoint_blocks_is_all_auto_or_a_count(tmp_path):
    from lorakit.errors import ConfigError

    flux = fake_model(tmp_path, FLUX, int(11.9e9 * 2))
    assert cfg_for(flux, "flux", "rtx4090", 1024, checkpoint_blocks=12).memory.checkpoint_blocks == 12
    with pytest.raises(ConfigError, match="checkpoint_blocks"):
        cfg_for(flux, "flux", "rtx4090", 1024, checkpoint_blocks=-1)
    with pytest.raises(ConfigError, match="checkpoint_blocks"):
        cfg_for(flux, "flux", "rtx4090", 1024, checkpoint_blocks="some")


def test_a_suggested_swap_keeps_the_plans_margin(tmp_path):
    """Qwen-Image-Edit at 1024² under 24 GiB was told `blocks_to_swap=5`, which the estimate put at 24.0 GiB,
    and ran out of memory at step 1 (H100, 2026-11-26): the count suggested now leaves the plan's margin."""
    import re

    from lorakit.hardware.profiles import load_profile
    from lorakit.plan.memory import PLAN_MARGIN_GIB

    cfg = cfg_for(fake_model(tmp_path, QWEN, int(20.4e9 * 2)), "qwen-image-edit", "rtx4090", 1024)
    with pytest.raises(InputError) as ei:
        run(resolve(cfg))
    n = int(re.search(r"memory\.blocks_to_swap=(\d+)", ei.value.hint).group(1))

    def swapped(k):
        return estimate(cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"blocks_to_swap": k})}))["gib"]

    budget = load_profile("rtx4090").hardware["memory_gib"]  # no GPU here: the profile's card (23.6 GiB)
    assert swapped(n) <= budget - PLAN_MARGIN_GIB < swapped(n - 1) and n > 5


def test_weight_split_counts_what_training_stores():
    from lorakit.plan.memory import weight_split

    tensors = [("transformer_blocks.0.ff.weight", "BF16", (8, 4)), ("transformer_blocks.0.norm.weight", "BF16", (4,)),
               ("single_transformer_blocks.0.proj.weight", "BF16", (2, 4)), ("x_embedder.weight", "BF16", (4, 4)),
               ("pos", "I64", (3,))]
    rest, blocks = weight_split(tensors, "fp8", 2)
    # 8-bit: a block's Linear weights at a byte each plus a float32 scale per row; everything else as loaded
    assert blocks == [8 * 4 + 4 * 8 + 4 * 2, 2 * 4 + 4 * 2] and rest == 16 * 2 + 3 * 8
    rest, blocks = weight_split(tensors, "none", 2)
    assert blocks == [36 * 2, 8 * 2] and rest == 16 * 2 + 3 * 8


def _headers_only(folder, tensors: dict):
    """A safetensors file whose header names `tensors` (name -> shape, bf16) over a sparse data region."""
    import os

    header, off = {}, 0
    for name, shape in tensors.items():
        n = 2 * int.__mul__(*shape) if len(shape) == 2 else 2 * shape[0]
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f = folder / "diffusion_pytorch_model.safetensors"
    with open(f, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
    os.truncate(f, 8 + len(raw) + off)


def test_swapping_counts_unequal_blocks_from_the_files(tmp_path):
    """FLUX.2's double blocks hold twice a single block's weights: swapping N blocks saves what the N smallest
    hold (the swapper sends the last, the single ones), and two of them are on the GPU while they visit."""
    cfg_json = {"_class_name": "Flux2Transformer2DModel", "num_layers": 2, "num_single_layers": 4,
                "num_attention_heads": 48, "attention_head_dim": 128}
    t = tmp_path / "model" / "transformer"
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps(cfg_json))
    (tmp_path / "model" / "model_index.json").write_text("{}")
    shapes = {**{f"transformer_blocks.{i}.ff.weight": (8192, 4096) for i in range(2)},
              **{f"single_transformer_blocks.{i}.proj.weight": (4096, 4096) for i in range(4)},
              "x_embedder.weight": (4096, 128)}
    _headers_only(t, shapes)
    base = {k: estimate(cfg_for(tmp_path / "model", "flux2-dev", "rtx4090", 512, blocks_to_swap=k,
                                gradient_checkpointing=True))["parts"]["base"] for k in (0, 1, 3)}
    single, double = (4096 * 4096 + 4 * 4096) / 2**30, (8192 * 4096 + 4 * 8192) / 2**30
    rest = 4096 * 128 * 2 / 2**30
    assert base[0] == pytest.approx(rest + 2 * double + 4 * single, abs=0.01)
    assert base[1] == pytest.approx(base[0] - single + 2 * single, abs=0.01)
    assert base[3] == pytest.approx(base[0] - 3 * single + 2 * single, abs=0.01)


def test_flux2_dev_estimate_covers_its_measured_peaks():
    """FLUX.2 [dev] at 1024² (H200, 2026-11-26): 76.6 GiB at its peak with 43 of 56 blocks recomputed, 105.2 with
    20; FLUX.1's working set put the second at 94 and the dgx-spark plan ran out of memory."""
    from lorakit.config import deep_merge
    from lorakit.hardware.profiles import load_profile

    for n, measured in ((43, 76.6), (20, 105.2)):
        raw = deep_merge(load_profile("datacenter").defaults, {
            "profile": "datacenter", "model": {"family": "flux2-dev"}, "data": {"resolution": 1024},
            "memory": {"gradient_checkpointing": True, "checkpoint_blocks": n}})
        est = estimate(validate(raw))
        allocated = est["gib"] - est["parts"]["overhead"]  # the measured peak is PyTorch's allocation
        assert measured <= allocated <= measured + 8, (n, est)  # covered, without wasting a card's worth


def test_the_edit_models_uncompiled_estimate_covers_their_measured_peaks(tmp_path):
    """Qwen-Image-Edit-2511 at 1024² with two controls under the dgx-spark profile (no compile; H200, 2026-11-26):
    46.1 GiB at its peak with every block recomputed, 62.6 / 80.9 / 99.2 with 50 / 40 / 30 of 60 recomputed. The
    compiled working set (16) put the plan at 4 recomputed, and all three Edit models ran out of memory at step 1."""
    data = tmp_path / "data"
    for d in ("control", "control_2"):
        (data / d).mkdir(parents=True)
    model = fake_model(tmp_path, {**QWEN, "zero_cond_t": True}, int(20.43e9 * 2))

    def cfg(**mem):
        from lorakit.config import deep_merge
        from lorakit.hardware.profiles import load_profile

        return validate(deep_merge(load_profile("dgx-spark").defaults, {
            "profile": "dgx-spark", "model": {"family": "qwen-image-edit-2511", "path": str(model)},
            "data": {"dirs": [str(data)], "resolution": 1024}, "memory": mem}))

    for n, measured in (("all", 46.1), (50, 62.6), (40, 80.9), (30, 99.2)):
        est = estimate(cfg(gradient_checkpointing=True, checkpoint_blocks=n))
        assert est["uncompiled"] and est["tokens"] == 4096 * 3 + 512
        assert measured <= est["gib"] <= measured + 5, (n, est)  # covered (the context's allowance included)
    compiled = estimate(cfg(gradient_checkpointing=True, checkpoint_blocks=30, compile=True))
    assert not compiled["uncompiled"] and compiled["gib"] < est["gib"] - 15  # the compiled blocks keep less
    assert compiled["uncompiled_gib"] == est["gib"]


def test_an_edit_model_is_also_offered_smaller_control_images(tmp_path):
    """FLUX.2 [dev] Edit under 24 GiB was told to swap 52 of 56 blocks (2026-11-26): half-size control images cut
    its tokens, so the refusal also names them, with the fewer blocks they need swapped (which fit, with the
    margin, and need fewer than the plain count); the matrix keeps to the memory-only way."""
    import re

    from lorakit.bench.matrix import named_settings
    from lorakit.hardware.profiles import load_profile
    from lorakit.plan.memory import PLAN_MARGIN_GIB

    cfg = cfg_for(fake_model(tmp_path, QWEN, int(20.4e9 * 2)), "qwen-image-edit", "rtx4090", 1024)
    with pytest.raises(InputError) as ei:
        run(resolve(cfg))
    hint = ei.value.hint
    plain = int(re.search(r"memory\.blocks_to_swap=(\d+)", hint).group(1))
    got = re.search(r"--set data\.control_resolution=512 --set memory\.blocks_to_swap=(\d+)", hint)
    assert got, hint
    fewer = int(got.group(1))
    small = cfg.model_copy(update={"data": cfg.data.model_copy(update={"control_resolution": 512}),
                                   "memory": cfg.memory.model_copy(update={"blocks_to_swap": fewer})})
    assert fewer < plain and estimate(small)["gib"] <= load_profile("rtx4090").hardware["memory_gib"] - PLAN_MARGIN_GIB
    assert named_settings(hint) == [f"memory.blocks_to_swap={plain}"]
    text2image = cfg_for(fake_model(tmp_path / "t", QWEN, int(20.4e9 * 2)), "qwen-image", "rtx4090", 2048)
    with pytest.raises(InputError) as ei:
        run(resolve(text2image))
    assert "control_resolution" not in ei.value.hint  # no control images, nothing to offer
