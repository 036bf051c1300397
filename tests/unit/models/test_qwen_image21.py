"""Qwen-Image-2.1: lorakit's transformer call, sampling sigmas and FLOP count equal the stock pipeline's and
torch's; the LoRA file is in the layout both readers take; the real-arithmetic rotary equals the stock complex one."""

import pytest
import torch

from lorakit.models.base import family_adapter, load_adapter

FAMILY = "qwen-image-2.1"


def _euler(pipe):
    """The pipeline with one Euler step from sigma 1 to 0 (x = noise - v: its output reveals the velocity)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_velocity_equals_the_pipelines_one_step_for_a_batch_of_two_caption_lengths(tiny):
    """Tokens unpatched (64 channels, one per latent), the text's slots then one image slot per 2x2 target tokens,
    timestep = sigma; two captions of different lengths in one batch (padded, with the mask) give each what the
    pipeline gives it alone. 64 x 96 pixels: a non-square target, so rows and columns cannot be swapped."""
    from diffusers import DiffusionPipeline

    folder = tiny(FAMILY)
    a = load_adapter(FAMILY, folder)
    pipe = _euler(DiffusionPipeline.from_pretrained(folder))
    h, w = 64 // 16, 96 // 16
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 64, h, w, generator=g)
    prompts = ["a red circle in the center on a blue background with small dots", "a dot"]
    texts = a.encode_prompts(prompts)
    n0, n1 = (t["prompt_embeds"].shape[0] for t in texts)
    assert n1 < n0
    emb = torch.zeros(2, n0, texts[0]["prompt_embeds"].shape[1])
    emb[0], emb[1, :n1] = texts[0]["prompt_embeds"], texts[1]["prompt_embeds"]
    mask = torch.zeros(2, n0, dtype=torch.long)
    mask[0], mask[1, :n1] = 1, 1
    with torch.no_grad():
        v = a.predict(pipe.transformer, noise, torch.tensor([1.0, 1.0]), {"prompt_embeds": emb, "prompt_embeds_mask": mask})
        for i, p in enumerate(prompts):
            tokens = noise[i:i + 1].reshape(1, 64, h * w).transpose(1, 2)
            out = pipe(prompt=p, latents=tokens.clone(), height=64, width=96, num_inference_steps=1,
                       output_type="latent", sigmas=[1.0]).images
            ref = (tokens - out).transpose(1, 2).reshape(1, 64, h, w)
            torch.testing.assert_close(v[i:i + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", [FAMILY, "qwen-image"])
def test_sampling_sigmas_equal_the_pipelines_scheduler(tiny, family):
    """The dynamic shift from the token count (2.1: one token per latent, 4096 at 1024²), as the pipeline passes
    mu, and the stretch to the scheduler's shift_terminal (0.02 in both Qwen-Image lines' scheduler configs)."""
    from diffusers import DiffusionPipeline

    from lorakit.train.sampling import sigma_schedule

    folder = tiny(family)
    a = load_adapter(family, folder)
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert pipe.scheduler.config.shift_terminal == 0.02
    if family == FAMILY:
        assert a.image_seq_len((64, 64, 64)) == 4096 and a.image_tokens(1024) == 4096
    for steps, (hh, ww) in ((4, (64, 64)), (7, (32, 48))):
        seq = a.image_seq_len((a.latent_channels, hh, ww))
        cfg = dict(pipe.scheduler.config)
        mu = a.shift_mu(seq, cfg, steps)
        pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).numpy(), mu=mu)
        torch.testing.assert_close(sigma_schedule(steps, seq, cfg, mu),
                                   pipe.scheduler.sigmas.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("res,text_len", [(128, 7), (256, 16)])
def test_the_flop_count_equals_torchs_count_of_the_real_forward(res, text_len):
    """bench's MFU for this family comes from `forward_flops` (its transformer cannot run on the meta device):
    it must equal what FlopCounterMode counts on a real forward with SDPA as matmuls, as other families are
    counted on the meta device."""
    from diffusers import QwenImage21Transformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    a = family_adapter(FAMILY)
    assert not a.meta_forward
    cfg = dict(a.full_config, num_layers=2, num_attention_heads=2, attention_head_dim=16, context_in_dim=32,
               axes_dims_rope=(4, 6, 6))
    model = QwenImage21Transformer2DModel(**cfg)
    b = a.example_inputs(cfg, res, text_len, torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, torch.no_grad():
        a.predict(model, b.latents, torch.tensor([0.5]), b.text)
    assert fc.get_total_flops() == a.forward_flops(cfg, b)


def test_the_lora_file_is_in_the_layout_both_readers_take():
    """Attention: the original names (ComfyUI's, which diffusers' reader strips); on the SwiGLU's gate or up
    projection (fused into gate_up in the original checkpoint, a name diffusers cannot load): diffusers' names."""
    a = family_adapter(FAMILY)
    assert a.file_layout(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.img_mlp.out"]) == "comfyui"
    assert a.file_layout(["transformer_blocks.0.attn.to_q", "transformer_blocks.3.img_mlp.proj"]) == "diffusers"
    fused = {n.native: n.targets for n in a.native_names}["transformer_blocks.{i}.img_mlp.gate_up"]
    assert fused == ("transformer_blocks.{i}.img_mlp.gate_layer", "transformer_blocks.{i}.img_mlp.proj")


def test_real_rotary_equals_the_stock_complex_product(tiny):
    """`before_compile` swaps the complex rotation for the same product in real arithmetic (inductor cannot
    generate complex code); the transformer's output is unchanged, and a stock transformer in the same process
    still takes complex frequencies."""
    from diffusers import QwenImage21Transformer2DModel

    folder = tiny(FAMILY)
    a = family_adapter(FAMILY)
    ours = QwenImage21Transformer2DModel.from_pretrained(folder / "transformer")
    stock = QwenImage21Transformer2DModel.from_pretrained(folder / "transformer")
    b = a.example_inputs(dict(ours.config), 64, 5, torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = a.predict(ours, b.latents, torch.tensor([0.3]), b.text)
        a.before_compile(ours)
        after = a.predict(ours, b.latents, torch.tensor([0.3]), b.text)
        plain = a.predict(stock, b.latents, torch.tensor([0.3]), b.text)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, before, rtol=0, atol=0)
