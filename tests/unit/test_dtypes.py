"""bf16 on a CPU without bf16 convolution kernels: the VAE computes in float32 behind the dtype its pipeline sees."""

import torch

from lorakit.dtypes import float32_inside, slow_on_cpu
from lorakit.models.tiny_vae import flux_vae, qwen_vae


def test_only_half_precision_on_a_cpu_is_ever_slow():
    assert not slow_on_cpu("cpu", torch.float32) and not slow_on_cpu("cuda:0", torch.bfloat16)
    assert slow_on_cpu("cpu", torch.bfloat16) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _bf16_weights(make):
    vae = make(0).eval().to(torch.bfloat16)
    ref = make(0).eval()  # float32 with the same (bf16-rounded) weights: what float32 compute gives
    ref.load_state_dict({k: v.float() for k, v in vae.state_dict().items()})
    return vae, ref


def test_a_vae_inside_float32_takes_and_gives_bf16_and_decodes_as_float32_compute_does():
    vae, ref = _bf16_weights(flux_vae)
    float32_inside(vae)
    assert {p.dtype for p in vae.parameters()} == {torch.float32}
    z = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        out, mean = vae.decode(z).sample, vae.encode(x).latent_dist.mean
        want, want_mean = ref.decode(z.float()).sample, ref.encode(x.float()).latent_dist.mean
    assert out.dtype == torch.bfloat16 and mean.dtype == torch.bfloat16  # what a bf16 pipeline expects back
    assert torch.equal(out, want.bfloat16()) and torch.equal(mean, want_mean.bfloat16())


def test_a_video_vae_with_its_frame_cache_decodes_as_float32_compute_does_up_to_bf16_between_its_parts():
    vae, ref = _bf16_weights(qwen_vae)
    float32_inside(vae)
    z = torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        out, want = vae.decode(z).sample, ref.decode(z.float()).sample
    assert out.dtype == torch.bfloat16  # its decoder is called frame by frame: bf16 rounding between the calls
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=4e-3)
