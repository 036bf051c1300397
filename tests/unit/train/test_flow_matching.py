"""Numerics against diffusers' own training utilities and schedulers, same seed: equal within 1e-5."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from lorakit.train.flow_matching import loss_weight, noisy, resolution_mu, sample_sigmas

FLUX_SCHED = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                  max_image_seq_len=4096)


@pytest.mark.parametrize("method", ["uniform", "logit_normal"])
def test_density_equals_diffusers(method):
    ours = sample_sigmas(64, method, torch.Generator().manual_seed(3), logit_mean=0.2, logit_std=1.3)
    ref = compute_density_for_timestep_sampling("logit_normal" if method == "logit_normal" else "none", 64,
                                                logit_mean=0.2, logit_std=1.3, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_resolution_shift_equals_the_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(**FLUX_SCHED)
    for seq in (256, 1024, 4096):
        mu = calculate_shift(seq, 256, 4096, 0.5, 1.15)
        assert abs(resolution_mu(seq, dict(sched.config)) - mu) < 1e-9
        u = compute_density_for_timestep_sampling("none", 32, generator=torch.Generator().manual_seed(seq))
        ref = sched.time_shift(mu, 1.0, u)
        ours = sample_sigmas(32, "resolution_shift", torch.Generator().manual_seed(seq), image_seq_len=seq,
                             scheduler_config=dict(sched.config))
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert (sample_sigmas(999, "resolution_shift", torch.Generator().manual_seed(0), image_seq_len=4096,
                          scheduler_config=dict(sched.config)).mean()
            > sample_sigmas(999, "resolution_shift", torch.Generator().manual_seed(0), image_seq_len=256,
                            scheduler_config=dict(sched.config)).mean())  # larger images: noisier


def test_fixed_shift_equals_the_scheduler_shift():
    sched = FlowMatchEulerDiscreteScheduler(shift=7.0)  # Kandinsky 5
    u = torch.rand(16, generator=torch.Generator().manual_seed(1))
    ref = 7.0 * u / (1 + 6.0 * u)
    ours = sample_sigmas(16, "resolution_shift", torch.Generator().manual_seed(1), scheduler_config=dict(sched.config))
    torch.testing.assert_close(ours, ref)
    assert abs(float(sched.config.shift) - 7.0) < 1e-9


def test_noising_target_and_weights():
    x0, n = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    s = torch.tensor([0.0, 0.5, 1.0])
    xt, target = noisy(x0, n, s)
    torch.testing.assert_close(xt[0], x0[0])
    torch.testing.assert_close(xt[2], n[2])
    torch.testing.assert_close(target, n - x0)
    sig = torch.rand(8) * 0.9 + 0.05
    for scheme in ("sigma_sqrt", "cosmap", "none"):
        torch.testing.assert_close(loss_weight(sig, scheme), compute_loss_weighting_for_sd3(scheme, sig).float())
