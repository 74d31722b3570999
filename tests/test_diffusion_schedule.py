"""The video-diffusion noise schedule equals diffusers' FlowMatchEulerDiscreteScheduler (training
table, sampling schedule, noising, Euler step), diffusers' SD3 timestep densities and loss
weightings, and DiffSynth-Studio's bell-curve weights (formula transcribed in the test)."""

from __future__ import annotations

import math

import pytest
import torch

from omniweave.diffusion import schedule as fs


def _scheduler(shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_train_table_equals_diffusers(shift):
    ref = _scheduler(shift)
    torch.testing.assert_close(fs.train_sigmas(shift), ref.sigmas.float(), rtol=0, atol=0)  # bit for bit
    torch.testing.assert_close(fs.train_sigmas(shift) * 1000, ref.timesteps.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("shift,steps", [(1.0, 10), (3.0, 7), (5.0, 50)])
def test_inference_sigmas_equal_set_timesteps(shift, steps):
    ref = _scheduler(shift)
    ref.set_timesteps(steps)
    ours = fs.inference_sigmas(steps, shift)
    assert ours.shape == (steps + 1,) and ours[-1] == 0
    torch.testing.assert_close(ours, ref.sigmas.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[:-1] * 1000, ref.timesteps.float(), rtol=0, atol=1e-3)


def test_noising_and_target_equal_scale_noise():
    ref = _scheduler(3.0)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, 6, 10, generator=g), torch.randn(2, 4, 3, 6, 10, generator=g)
    timesteps = ref.timesteps[torch.tensor([17, 803])]
    sigma = ref.sigmas[torch.tensor([17, 803])].reshape(2, 1, 1, 1, 1)
    x_t, v = fs.noisy_latents(x0, noise, sigma)
    torch.testing.assert_close(x_t, ref.scale_noise(x0, timesteps, noise), rtol=0, atol=1e-6)
    torch.testing.assert_close(v, noise - x0)  # diffusers' step x + (s' - s) v means v = dx/dsigma = noise - x0


def test_euler_sample_equals_scheduler_steps():
    shift, steps = 3.0, 6
    ref = _scheduler(shift)
    ref.set_timesteps(steps)
    weight = torch.randn(5, 5, generator=torch.Generator().manual_seed(1)) * 0.3

    def velocity(x, sigma):  # any smooth function of (x, sigma)
        return torch.tanh(x @ weight) * (1 + sigma)

    noise = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    x = noise.clone()
    for t in ref.timesteps:
        x = ref.step(velocity(x, t / 1000), t, x).prev_sample
    ours = fs.euler_sample(velocity, noise, fs.inference_sigmas(steps, shift))
    torch.testing.assert_close(ours, x, rtol=0, atol=2e-6)


def test_sampled_sigmas_come_from_the_table_and_follow_the_density():
    from diffusers.training_utils import compute_density_for_timestep_sampling

    table = fs.train_sigmas(3.0)
    s = fs.sample_train_sigmas(4000, torch.Generator().manual_seed(0), shift=3.0)
    assert torch.isin(s, table).all()
    assert abs(s.mean().item() - table.mean().item()) < 0.02  # uniform over the table's entries
    # logit-normal: the same u as diffusers' density for the same generator state, then the table index
    u = compute_density_for_timestep_sampling("logit_normal", 64, logit_mean=0.0, logit_std=1.0,
                                              generator=torch.Generator().manual_seed(5))
    ours = fs.sample_train_sigmas(64, torch.Generator().manual_seed(5), shift=3.0, sampling="logit_normal")
    torch.testing.assert_close(ours, table[(u * 1000).long()], rtol=0, atol=0)
    u = compute_density_for_timestep_sampling("mode", 64, mode_scale=1.29, generator=torch.Generator().manual_seed(6))
    ours = fs.sample_train_sigmas(64, torch.Generator().manual_seed(6), shift=3.0, sampling="mode")
    torch.testing.assert_close(ours, table[(u * 1000).long().clamp(0, 999)], rtol=0, atol=0)
    # reproducible from the generator alone
    again = fs.sample_train_sigmas(4000, torch.Generator().manual_seed(0), shift=3.0)
    assert torch.equal(s, again)


@pytest.mark.parametrize("scheme", ["sigma_sqrt", "cosmap"])
def test_sd3_weightings_equal_diffusers(scheme):
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sigmas = fs.train_sigmas(3.0)[torch.tensor([0, 100, 500, 999])]
    torch.testing.assert_close(fs.loss_weights(sigmas, scheme), compute_loss_weighting_for_sd3(scheme, sigmas).float())


def test_bell_weights_equal_diffsynth_formula():
    # DiffSynth-Studio FlowMatchScheduler.set_training_weight over set_timesteps(1000, training=True)
    shift = 5.0
    sigmas = shift * torch.linspace(1, 0, 1001)[:-1] / (1 + (shift - 1) * torch.linspace(1, 0, 1001)[:-1])
    t = sigmas * 1000
    y = torch.exp(-2 * ((t - 500) / 1000) ** 2)
    y = y - y.min()
    ref = y * (1000 / y.sum())
    ours = fs.loss_weights(fs.train_sigmas(shift), "bell", shift=shift)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert math.isclose(ours.sum().item(), 1000, rel_tol=1e-5) and ours.min() == 0
    assert fs.loss_weights(torch.tensor([0.3, 0.9]), "none").tolist() == [1.0, 1.0]


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="timestep sampling 'beta'"):
        fs.sample_train_sigmas(2, torch.Generator(), sampling="beta")
    with pytest.raises(ValueError, match="loss weighting 'snr'"):
        fs.loss_weights(torch.ones(2), "snr")
    with pytest.raises(ValueError, match="shift must be positive"):
        fs.train_sigmas(0.0)
    with pytest.raises(ValueError, match="num_steps"):
        fs.inference_sigmas(0)


def test_guidance_formula():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0])
    torch.testing.assert_close(fs.guided(a, b, 1.0), a)
    torch.testing.assert_close(fs.guided(a, b, 5.0), b + 5 * (a - b))
