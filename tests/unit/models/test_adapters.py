"""The stock diffusers pipeline is the oracle: adapters' text embeddings and latents equal its own."""

import pytest
import torch
from PIL import Image

from lorakit.errors import InputError
from lorakit.models.base import family_adapter, load_adapter
from lorakit.models.registry import family_info, family_names

TEXTS = ["a red circle in the center on a blue background", "make the square green"]


def controls():
    return [[Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (64, 64), (30, 30, 200))]] * 2


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", family_names())
def test_text_embeddings_equal_the_pipeline(tiny, family):
    from diffusers import DiffusionPipeline

    folder = tiny(family)
    ours = load_adapter(family, folder).encode_prompts(TEXTS, controls=controls())
    pipe = DiffusionPipeline.from_pretrained(folder)
    with torch.no_grad():
        for i, text in enumerate(TEXTS):
            if family_adapter(family).arch == "flux":
                e, p, _ = pipe.encode_prompt(prompt=[text], prompt_2=None, max_sequence_length=512)
                close(ours[i]["prompt_embeds"], e[0])
                close(ours[i]["pooled"], p[0])
            elif family.startswith("kandinsky5"):
                q, c, cu = pipe.encode_prompt(prompt=[text], max_sequence_length=512)
                close(ours[i]["prompt_embeds"], q[0, : int(cu[1])])
                close(ours[i]["pooled"], c[0])
            elif family_adapter(family).arch == "flux2":  # the whole padded sequence, three layers stacked
                e, _ = pipe.encode_prompt(prompt=[text])
                close(ours[i]["prompt_embeds"], e[0])
            elif family_adapter(family).arch == "wan":  # padded with zeros to 512 tokens: the padding dropped
                e, _ = pipe.encode_prompt(prompt=[text], do_classifier_free_guidance=False)
                n = ours[i]["prompt_embeds"].shape[0]
                close(ours[i]["prompt_embeds"], e[0, :n])
                assert n < 512 and not e[0, n:].any()
            elif family == "qwen-image-2.1":  # Qwen3-VL's pre-norm hidden states, the system prefix dropped
                e, m, slots = pipe.encode_prompt(prompt=[text])
                n = int(m[0].sum()) if m is not None else e.shape[1]
                close(ours[i]["prompt_embeds"], e[0, :n])
                assert not slots.any()  # text only: no image slot in the prompt
            elif family == "z-image":  # a list of unpadded captions
                e, _ = pipe.encode_prompt(prompt=[text], do_classifier_free_guidance=False)
                close(ours[i]["prompt_embeds"], e[0])
            else:
                kw = {}
                variant = family_info(family).variant
                if variant == "edit":  # the pipeline prompts with the image resized to 1024² area
                    kw["image"] = pipe.image_processor.resize(controls()[i][0], 1024, 1024)
                elif variant == "edit-plus":  # the pipeline resizes prompt images to 384² area (Edit-2511 too)
                    kw["image"] = [pipe.image_processor.resize(im, 384, 384) for im in controls()[i]]
                e, m = pipe.encode_prompt(prompt=[text], **kw)
                n = int(m[0].sum()) if m is not None else e.shape[1]
                close(ours[i]["prompt_embeds"], e[0, :n])


@pytest.mark.parametrize("family", family_names())
def test_latents_equal_the_pipeline_convention(tiny, family):
    from diffusers import DiffusionPipeline

    folder = tiny(family)
    a = load_adapter(family, folder)
    pipe = DiffusionPipeline.from_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    pix = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    with torch.no_grad():
        if family == "qwen-image-2.1":  # RGBA in: an RGB picture with alpha 1, as the pipeline converts it
            rgba = torch.cat([pix, torch.ones_like(pix[:, :1])], dim=1).unsqueeze(2)
            close(a.encode_images(pix), pipe._encode_vae_image(rgba, None)[:, :, 0])
            mean, std = (torch.tensor(pipe.vae.config[k]).view(1, 64, 1, 1, 1) for k in ("latents_mean", "latents_std"))
            lat = pipe.vae.encode(rgba).latent_dist.mode()
            close(a.decode_latents(a.encode_images(pix)), pipe.vae.decode(lat).sample[:, :3, 0])
            assert (lat - mean).abs().max() > 0 and (std != 1).any()  # the normalisation is not the identity
        elif family.startswith("qwen"):
            from diffusers import QwenImageEditPipeline

            ref = QwenImageEditPipeline(**{k: v for k, v in pipe.components.items() if k != "processor"},
                                        processor=None)._encode_vae_image(pix.unsqueeze(2), None)[:, :, 0]
            close(a.encode_images(pix), ref)
        elif family_adapter(family).arch == "flux2":  # 2x2 patches, normalised by the VAE's batch-norm statistics
            close(a.encode_images(pix), pipe._encode_vae_image(pix, None))
            back = a.decode_latents(a.encode_images(pix))
            lat = pipe.vae.encode(pix).latent_dist.mode()
            close(back, pipe.vae.decode(lat).sample)  # decoding undoes the normalisation and the patches
        elif family_adapter(family).arch in ("flux", "z-image"):  # FluxImg2ImgPipeline._encode_vae_image's
            # normalisation (ZImagePipeline decodes latents / scaling_factor + shift_factor: its inverse)
            from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

            lat = retrieve_latents(pipe.vae.encode(pix), sample_mode="argmax")
            ref = (lat - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
            close(a.encode_images(pix), ref)
        elif family_adapter(family).arch == "wan":  # the pipelines decode latents * std + mean
            x = pix.unsqueeze(2).repeat(1, 1, 5, 1, 1)
            n = pipe.vae.config.z_dim
            mean = torch.tensor(pipe.vae.config.latents_mean).view(1, n, 1, 1, 1)
            std = torch.tensor(pipe.vae.config.latents_std).view(1, n, 1, 1, 1)
            close(a.encode_video(x) * std + mean, pipe.vae.encode(x).latent_dist.mode())
            close(a.encode_images(pix), a.encode_video(pix.unsqueeze(2))[:, :, 0])
        else:  # Kandinsky 5 decodes latents / scaling_factor: encoding is its inverse on the VAE mean
            vid = family.endswith("t2v")
            x = pix.unsqueeze(2).repeat(1, 1, 5, 1, 1) if vid else pix
            lat = a.encode_video(x) if vid else a.encode_images(x)
            close(lat, pipe.vae.encode(x).latent_dist.mode() * pipe.vae.config.scaling_factor)


def test_wrong_model_folder_for_family(tiny):
    with pytest.raises(InputError, match="QwenImagePipeline"):
        load_adapter("qwen-image", tiny("flux"))


def test_identity_changes_with_the_model_not_the_run(tiny, tmp_path):
    import shutil

    a = load_adapter("flux", tiny("flux"))
    assert a.identity() == load_adapter("flux", tiny("flux")).identity()
    copy = shutil.copytree(tiny("flux"), tmp_path / "m")
    te = copy / "text_encoder" / "model.safetensors"
    data = bytearray(te.read_bytes())
    data[-100] ^= 0xFF
    te.write_bytes(bytes(data))
    assert load_adapter("flux", copy).identity() != a.identity()
