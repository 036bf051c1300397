"""lorakit's forward conventions equal the stock pipelines': one Euler step from sigma 1 to 0 gives
x = noise - v, so the pipeline's own one-step output reveals the velocity its transformer predicted."""

import pytest
import torch
from PIL import Image

from lorakit.models.base import load_adapter
from lorakit.models.registry import family_info


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", "qwen-image", "qwen-image-edit", "qwen-image-edit-plus",
                                    "qwen-image-edit-2511"])
def test_velocity_equals_the_pipelines_one_step(tiny, family):
    from diffusers import DiffusionPipeline

    folder = tiny(family)
    a = load_adapter(family, folder)
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    # Qwen-Image-Edit(-Plus, -2511) encodes control images at ~1024² whatever the output size: use that size
    variant = family_info(family).variant
    side = 1024 if variant else 64
    noise = torch.randn(1, 16, side // 8, side // 8, generator=torch.Generator().manual_seed(0))
    prompt = "a red circle in the center on a blue background"
    kw = dict(num_inference_steps=1, output_type="latent", height=side, width=side)
    control = Image.new("RGB", (side, side), (200, 30, 30))
    with torch.no_grad():
        if family == "flux":
            text = a.encode_prompts([prompt])[0]
            text = {k: v[None] for k, v in text.items()}
            packed = pipe._pack_latents(noise, 1, 16, 8, 8)
            out = pipe(prompt_embeds=text["prompt_embeds"], pooled_prompt_embeds=text["pooled"], latents=packed,
                       guidance_scale=3.5, **kw).images
            v_ref = pipe._unpack_latents(packed - out, 64, 64, 8)
            v = a.predict(transformer, noise, torch.tensor([1.0]), text, guidance=3.5)
        else:
            controls = [[control]] if variant else None  # Edit-2511: control tokens modulated at timestep 0
            e = a.encode_prompts([prompt], controls=controls)[0]["prompt_embeds"][None]
            text = {"prompt_embeds": e, "prompt_embeds_mask": torch.ones(1, e.shape[1], dtype=torch.long)}
            packed = pipe._pack_latents(noise, 1, 16, side // 8, side // 8)
            extra = {"image": control if variant == "edit" else [control]} if controls else {}
            # Qwen's scheduler stretches sigmas to a terminal value, which needs >= 2 steps: capture the
            # latents after the first step (sigma 1 -> s1): x1 = noise + (s1 - 1) v
            seen = {}

            def grab(p, i, t, kw_):
                seen.setdefault("x1", kw_["latents"].clone())
                seen.setdefault("s1", float(p.scheduler.sigmas[1]))
                return kw_

            pipe(prompt_embeds=e, prompt_embeds_mask=text["prompt_embeds_mask"], latents=packed, **extra,
                 **{**kw, "num_inference_steps": 2}, callback_on_step_end=grab)
            v_ref = pipe._unpack_latents((packed - seen["x1"]) / (1 - seen["s1"]), side, side, 8)[:, :, 0]
            ctrl = None
            if controls:
                from lorakit.models.pixels import to_pixels as _pixels

                ctrl = [a.encode_images(_pixels([control]))]
            v = a.predict(transformer, noise, torch.tensor([1.0]), text, controls=ctrl)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def test_kontext_velocity_equals_the_pipelines_one_step(tiny):
    """FluxKontextPipeline appends the control image's packed latents (position ids with first coordinate 1)."""
    from diffusers import FluxKontextPipeline

    from lorakit.models.pixels import to_pixels as _pixels

    folder = tiny("flux-kontext")
    a = load_adapter("flux-kontext", folder)
    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    control = Image.new("RGB", (48, 80), (200, 30, 30))  # another size than the target: its own positions
    text = {k: v[None] for k, v in a.encode_prompts(["make the circle red"])[0].items()}
    packed = pipe._pack_latents(noise, 1, 16, 8, 8)
    with torch.no_grad():
        out = pipe(prompt_embeds=text["prompt_embeds"], pooled_prompt_embeds=text["pooled"], latents=packed,
                   image=control, _auto_resize=False, guidance_scale=2.5, num_inference_steps=1,
                   output_type="latent", height=64, width=64, max_area=64 * 64).images
        v_ref = pipe._unpack_latents(packed - out, 64, 64, 8)
        ctrl = a.encode_images(_pixels([control]))
        v = a.predict(pipe.transformer, noise, torch.tensor([1.0]), text, guidance=2.5, controls=[ctrl])
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["kandinsky5-t2i", "kandinsky5-t2v"])
def test_kandinsky_velocity_equals_the_pipelines_one_step(tiny, family):
    from diffusers import DiffusionPipeline

    folder = tiny(family)
    a = load_adapter(family, folder)
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    video = family.endswith("t2v")
    side = 64 if video else 1024  # T2I only takes its listed sizes
    g = torch.Generator().manual_seed(0)
    shape = (1, 16, 2, side // 8, side // 8) if video else (1, 16, side // 8, side // 8)
    noise = torch.randn(shape, generator=g)
    prompt = "a red circle moving from left to right on a blue background"
    text = a.encode_prompts([prompt])[0]
    text = {"prompt_embeds": text["prompt_embeds"][None], "pooled": text["pooled"][None]}
    lat = noise.permute(0, 2, 3, 4, 1) if video else noise.unsqueeze(2).permute(0, 2, 3, 4, 1)
    if video:
        lat = torch.cat([lat, torch.zeros_like(lat), torch.zeros(*lat.shape[:-1], 1)], dim=-1)
    kw = dict(num_frames=5) if video else {}
    with torch.no_grad():
        out = pipe(prompt=prompt, latents=lat.clone(), num_inference_steps=1, height=side, width=side,
                   guidance_scale=1.0, output_type="latent", **kw)
        got = (out.frames if video else out.image)
        got = got[..., :16] if video else got
        v_ref = (lat[..., :16] - got).permute(0, 4, 1, 2, 3)
        v_ref = v_ref if video else v_ref[:, :, 0]
        v = a.predict(pipe.transformer, noise, torch.tensor([1.0]), text)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def test_z_image_velocity_equals_the_pipelines_one_step(tiny):
    """ZImagePipeline: a list of (C, 1, h, w) latents and unpadded captions, timestep 1 - sigma, the negated output as
    the velocity; one step from sigma 1 to 0 (its default one-step sigmas, no shift at 1) gives noise - v."""
    from diffusers import ZImagePipeline

    folder = tiny("z-image")
    a = load_adapter("z-image", folder)
    pipe = ZImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    texts = ["a red circle in the center on a blue background", "green"]  # two lengths: the mask path
    e = [t["prompt_embeds"] for t in a.encode_prompts(texts)]
    with torch.no_grad():
        out = pipe(prompt_embeds=e, latents=noise.clone(), num_inference_steps=1, guidance_scale=0.0, height=64,
                   width=64, output_type="latent").images
        n = max(x.shape[0] for x in e)
        padded = torch.stack([torch.cat([x, x.new_zeros(n - x.shape[0], x.shape[1])]) for x in e])
        mask = torch.stack([torch.arange(n) < x.shape[0] for x in e]).long()
        v = a.predict(pipe.transformer, noise, torch.tensor([1.0, 1.0]), {"prompt_embeds": padded,
                                                                          "prompt_embeds_mask": mask})
    torch.testing.assert_close(v, noise - out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["flux2-dev", "flux2-klein", "flux2-dev-edit", "flux2-klein-edit"])
def test_flux2_velocity_equals_the_pipelines_first_step(tiny, family):
    """Flux2Pipeline / Flux2KleinPipeline: row-major tokens with 4-axis ids, timestep = sigma, dev's embedded
    guidance; their sampling shift is the empirical mu of tokens and steps. The latents after the first of two
    steps (sigma 1 -> s1) give the velocity: x1 = noise + (s1 - 1) v."""
    from diffusers import DiffusionPipeline

    from lorakit.train.sampling import sigma_schedule

    folder = tiny(family)
    a = load_adapter(family, folder)
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 64, 4, 6, generator=torch.Generator().manual_seed(0))  # 64 x 96 pixels
    e = a.encode_prompts(["a red circle in the center on a blue background"])[0]["prompt_embeds"][None]
    seen = {}

    def grab(p, i, t, kw_):
        seen.setdefault("x1", kw_["latents"].clone())
        seen.setdefault("sigmas", p.scheduler.sigmas.clone())
        return kw_

    guidance = 1.0 if "klein" in family else 3.5
    # edit: two reference images of other sizes than the target's (the second one shrunk and cropped by the rules)
    refs = [Image.new("RGB", (80, 64), (200, 30, 30)), Image.new("RGB", (70, 100), (30, 60, 200))] \
        if family.endswith("-edit") else None
    with torch.no_grad():
        pipe(prompt_embeds=e, latents=noise.clone(), num_inference_steps=2, guidance_scale=guidance, height=64,
             width=96, output_type="latent", callback_on_step_end=grab, **({"image": refs} if refs else {}))
        s1 = float(seen["sigmas"][1])
        x1 = seen["x1"].permute(0, 2, 1).reshape(noise.shape)
        v_ref = (noise - x1) / (1 - s1)
        ctrl = [c[None] for c in a.encode_controls(refs)] if refs else None
        if refs:
            assert [tuple(c.shape[-2:]) for c in ctrl] == [(4, 5), (6, 4)]  # 80x64 -> 80x64; 70x100 -> 64x96
        v = a.predict(pipe.transformer, noise, torch.tensor([1.0]), {"prompt_embeds": e}, guidance=guidance,
                      controls=ctrl)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
    # lorakit's sampler steps through the same sigmas
    ours = sigma_schedule(2, 24, dict(pipe.scheduler.config), a.shift_mu(24, dict(pipe.scheduler.config), 2))
    torch.testing.assert_close(ours, seen["sigmas"].float(), rtol=1e-6, atol=1e-6)
