"""Wan 2.1 / 2.2: lorakit's transformer call, text, latents, I2V condition and sampling sigmas equal the stock
pipelines'; the folder tells the family; an expert trains on its own part of the trajectory only."""

import json

import pytest
import torch
from PIL import Image

from lorakit.config import validate
from lorakit.errors import ConfigError, InputError
from lorakit.models.base import family_adapter, load_adapter, trained_dir
from lorakit.models.registry import family_of_folder

WAN = ["wan2.1-t2v", "wan2.2-t2v", "wan2.2-i2v", "wan2.2-ti2v-5b"]


def _euler(pipe):
    """The pipeline with one Euler step from sigma 1 to 0 (x = noise - v: its output reveals the velocity)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", WAN)
def test_velocity_equals_the_pipelines_one_step(tiny, family):
    """Text padded with zeros to 512 tokens, timestep sigma x 1000 (TI2V-5B: one per token), the high-noise expert at
    sigma 1, and for I2V the first frame's mask + latents as the pipeline builds them from the image."""
    from diffusers import DiffusionPipeline

    folder = tiny(family)
    a = load_adapter(family, folder)
    pipe = _euler(DiffusionPipeline.from_pretrained(folder))
    side, frames = (64, 5)
    lat = a.latent_channels
    f = a.vae_factor
    noise = torch.randn(1, lat, 2, side // f, side // f, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle moving from left to right on a blue background", "a dot"]
    texts = a.encode_prompts(prompts)
    assert texts[1]["prompt_embeds"].shape[0] < texts[0]["prompt_embeds"].shape[0]  # the zero padding dropped
    e = texts[0]["prompt_embeds"][None]
    kw = dict(num_inference_steps=1, output_type="latent", height=side, width=side, num_frames=frames,
              guidance_scale=1.0)
    controls = None
    with torch.no_grad():
        if family == "wan2.2-i2v":
            image = Image.new("RGB", (side, side), (200, 30, 30))
            out = pipe(image=image, prompt=prompts[0], latents=noise.clone(), **kw).frames
            first = pipe.video_processor.preprocess(image, height=side, width=side)  # (1, 3, H, W) in [-1, 1]
            clip = first[:, :, None].repeat(1, 1, frames, 1, 1)  # later frames: the condition zeroes them
            controls = [a.encode_clip_condition(clip)]
            assert controls[0].shape == (1, 4 + lat, 2, side // f, side // f)
        else:
            out = pipe(prompt=prompts[0], latents=noise.clone(), **kw).frames
        v_ref = noise - out
        v = a.predict(pipe.transformer, noise, torch.tensor([1.0]), {"prompt_embeds": e}, controls=controls)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["wan2.2-t2v", "wan2.2-ti2v-5b"])
def test_latents_and_text_equal_the_pipelines(tiny, family):
    """encode_video normalises as the pipeline un-normalises before decoding; prompt embeddings are the pipeline's
    own without its zero padding."""
    a = load_adapter(family, tiny(family))
    ours = a.encode_prompts(["a red circle"])[0]["prompt_embeds"]
    a.load(("vae",))
    pipe = a.pipeline()
    clip = torch.rand(1, 3, 5, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    lat = a.encode_video(clip)
    vae = a.parts["vae"]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    raw = vae.encode(clip).latent_dist.mode()
    torch.testing.assert_close(lat * std + mean, raw, rtol=1e-5, atol=1e-5)
    assert lat.shape[1] == a.latent_channels and lat.shape[-1] == 64 // a.vae_factor
    padded, _ = pipe.encode_prompt("a red circle", do_classifier_free_guidance=False, max_sequence_length=512)
    n = ours.shape[0]
    torch.testing.assert_close(padded[0, :n], ours)
    assert not padded[0, n:].any()


def test_sampling_sigmas_are_unipcs_flow_sigmas(tiny):
    """The training-time sampler steps through the sigmas Wan's UniPC scheduler sets (flow sigmas, flow_shift)."""
    from diffusers import UniPCMultistepScheduler

    from lorakit.train.sampling import sigma_schedule
    from lorakit.train.trainer import scheduler_config

    folder = tiny("wan2.2-t2v")
    cfg = scheduler_config(folder)
    assert cfg["shift"] == cfg["flow_shift"] == 3.0
    sched = UniPCMultistepScheduler.from_pretrained(folder / "scheduler")
    for steps in (4, 30):
        sched.set_timesteps(steps)
        torch.testing.assert_close(sigma_schedule(steps, 256, cfg), sched.sigmas.float(), rtol=1e-6, atol=1e-6)


def test_each_wan_folder_tells_its_family_and_a_wrong_one_is_refused_by_name(tiny, tmp_path):
    from lorakit.config.paths import model_folder_problems

    for family in WAN:
        assert family_of_folder(tiny(family)) == family
    problems = model_folder_problems(tiny("wan2.1-t2v"), "model.path", "wan2.2-t2v")
    assert problems and "is not a wan2.2-t2v model (its model_index.json lacks: transformer_2 set)" in problems[0]
    assert "it is a wan2.1-t2v model: set model.family: wan2.1-t2v" in problems[0]


def test_an_expert_trains_its_own_transformer_on_its_own_sigmas(tiny):
    from lorakit.train import flow_matching as fm

    a = load_adapter("wan2.2-t2v", tiny("wan2.2-t2v"))
    assert a.boundary() == 0.875 and a.expert(None) == "low"
    assert a.trained_part("high") == "transformer" and a.trained_part("low") == "transformer_2"
    assert a.sigma_range("high") == (0.875, 1.0) and a.sigma_range(None) == (0.0, 0.875)
    g = torch.Generator().manual_seed(0)
    for expert, ok in (("high", lambda s: s >= 0.875), ("low", lambda s: s < 0.875)):
        lo, hi = a.sigma_range(expert)
        s = fm.in_range(lambda k: fm.sample_sigmas(k, "logit_normal", g), 4096, lo, hi)
        assert bool(ok(s).all()) and s.std() > 0.01  # spread over the range, not clamped to an edge
    cfg = validate({"model": {"family": "wan2.2-t2v", "path": str(tiny("wan2.2-t2v")), "expert": "high"}})
    assert trained_dir(cfg).name == "transformer"
    assert trained_dir(validate({"model": {"family": "wan2.2-i2v", "path": "x"}})).name == "transformer_2"
    assert family_adapter("wan2.2-ti2v-5b").sigma_range(None) == (0.0, 1.0)
    with pytest.raises(ConfigError, match="flux has one transformer, no experts"):
        validate({"model": {"family": "flux", "expert": "low"}})
    with pytest.raises(InputError, match=r"model.expert: high — wan2.1-t2v has one transformer, no experts"):
        family_adapter("wan2.1-t2v").expert("high")  # one sentence, not its letters as a list of problems
    with pytest.raises(ConfigError, match=r"model.expert: 'both' is not an expert of wan2.2-t2v"):
        family_adapter("wan2.2-t2v").expert("both")  # `lorakit train` splits both into its two runs first


def test_the_boundary_is_read_from_the_folder(tiny, tmp_path):
    import shutil

    folder = tmp_path / "wan"
    shutil.copytree(tiny("wan2.2-i2v"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.9
    index["boundary_ratio"] = 0.8
    (folder / "model_index.json").write_text(json.dumps(index))
    assert load_adapter("wan2.2-i2v", folder).sigma_range("high") == (0.8, 1.0)
