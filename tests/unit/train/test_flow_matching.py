"""Numerics against diffusers' own training utilities and schedulers, same seed: equal within 1e-5."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from lorakit.train.flow_matching import loss_weight, noisy, resolution_mu, sample_sigmas

FLUX_SCHED = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                  max_image_seq_len=4096)


@pytest.mark.parametrize("method", ["uniform", "logit_normal", "mode"])
def test_density_equals_diffusers(method):
    ours = sample_sigmas(64, method, torch.Generator().manual_seed(3), logit_mean=0.2, logit_std=1.3, scale=1.29)
    ref = compute_density_for_timestep_sampling({"uniform": "none"}.get(method, method), 64, logit_mean=0.2,
                                                logit_std=1.3, mode_scale=1.29,
                                                generator=torch.Generator().manual_seed(3))
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


def _ks(draws, cdf) -> float:
    """Kolmogorov-Smirnov distance between the draws and a CDF (vectorized over float64 tensors)."""
    xs = draws.double().sort().values
    n = len(xs)
    f = cdf(xs)
    i = torch.arange(n, dtype=torch.float64)
    return float(torch.maximum(((i + 1) / n - f).abs(), (i / n - f).abs()).max())


def _phi(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def _logit(t):
    return torch.log(t / (1 - t))


def _mode_cdf(scale: float):
    def cdf(t):  # f(u) = 1 - u - scale (cos²(pi u/2) - 1 + u) falls from 1 to 0: P(f(u) <= t) = 1 - f^-1(t)
        lo, hi = torch.zeros_like(t), torch.ones_like(t)
        for _ in range(50):
            mid = (lo + hi) / 2
            above = (1 - mid - scale * (torch.cos(math.pi * mid / 2) ** 2 - 1 + mid)) > t
            lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
        return 1 - (lo + hi) / 2

    return cdf


MU = resolution_mu(4096, {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                          "max_shift": 1.15})
CASES = [
    ("uniform", {}, lambda t: t),
    ("logit_normal", {"logit_mean": 0.3, "logit_std": 1.2}, lambda t: _phi((_logit(t) - 0.3) / 1.2)),
    ("sigmoid", {"scale": 1.0}, lambda t: _phi(_logit(t))),
    ("sigmoid", {"scale": 2.5}, lambda t: _phi(_logit(t) / 2.5)),
    ("mode", {"scale": 1.29}, _mode_cdf(1.29)),
    ("mode", {"scale": -0.5}, _mode_cdf(-0.5)),
    ("shift", {"shift": 3.0}, lambda t: t / (3 - 2 * t)),
    ("resolution_shift", {"image_seq_len": 4096, "scheduler_config": {"use_dynamic_shifting": True}},
     lambda t: 1 / (1 + math.exp(MU) * (1 / t - 1))),
]


@pytest.mark.parametrize("method,kw,cdf", CASES, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(CASES)])
def test_samplers_draw_their_density(method, kw, cdf):
    """100k draws against the sampler's CDF (KS at the 0.1 % level); the same draws fail a wrong density."""
    import torch

    n = 100_000
    draws = sample_sigmas(n, method, torch.Generator().manual_seed(7), **kw)
    assert draws.min() > 0 and draws.max() < 1
    critical = 1.95 / math.sqrt(n)
    assert _ks(draws, cdf) < critical
    assert _ks(draws, lambda t: cdf((t * 1.05).clamp(1e-9, 1 - 1e-9))) > critical  # the test can fail


def test_timestep_scale_is_checked():
    from lorakit.config.schema import ScheduleConfig

    assert ScheduleConfig(timesteps="mode").scale == 1.29
    assert ScheduleConfig(timesteps="sigmoid", timestep_scale=2.0).scale == 2.0
    for bad in ({"timesteps": "mode", "timestep_scale": 2.0}, {"timesteps": "sigmoid", "timestep_scale": -1},
                {"timesteps": "uniform", "timestep_scale": 1.0}):
        with pytest.raises(ValueError, match="timestep_scale"):
            ScheduleConfig(**bad)
