"""UniPC sampling (omniweave/diffusion/unipc.py) equals diffusers' ``UniPCMultistepScheduler`` in the
configuration the Wan 2.1 diffusers checkpoints ship (flow prediction, flow sigmas, bh2, x0
prediction, lower-order final step, corrector on), driven the way WanPipeline drives it:
``set_timesteps(steps)``, ``set_begin_index(0)``, then per timestep t the model at t and ``step``.

Measured (CPU, fp32, a [2, 3, 7] sample): schedules bit for bit (sigmas) and equal (integer
timesteps) for 1 to 1000 steps; samples (values up to ~3) within 1.4e-6 max abs over steps
{1, 2, 5, 20}, shifts {1, 3, 5}, orders {1, 2, 3}, and 3.8e-6 at 50 steps (the test allows 1e-5).
Without the corrector, at order 1, or with the model fed the exact sigma rather than diffusers'
integer timestep, the same sample moves by 2e-2, 9e-2 and 2e-3."""

from __future__ import annotations

import pytest
import torch

from omniweave.diffusion.schedule import euler_sample, inference_sigmas
from omniweave.diffusion.unipc import unipc_sample, unipc_schedule


def _scheduler(shift, order=2, **kw):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                                   flow_shift=shift, solver_order=order, solver_type="bh2", predict_x0=True,
                                   lower_order_final=True, **kw)


_g = torch.Generator().manual_seed(1)
_W = torch.randn(7, 7, generator=_g) * 0.4
_B = torch.randn(3, 7, generator=_g)


def velocity(x, sigma):
    """A fixed smooth "model": nonlinear in x and dependent on its time input, so a wrong timestep,
    a skipped corrector or a wrong history weight each show far above the tolerance."""
    return torch.tanh(x @ _W) * (1 + sigma) + _B * sigma.float() ** 2 - 0.3 * x


def _noise():
    return torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(2))


def _diffusers_loop(ref, steps, noise):
    ref.set_timesteps(steps)
    ref.set_begin_index(0)  # as WanPipeline does
    x = noise.clone()
    for t in ref.timesteps:
        x = ref.step(velocity(x, t / 1000), t, x).prev_sample
    return x


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_schedule_equals_set_timesteps(shift):
    ref = _scheduler(shift)
    for steps in (1, 2, 3, 5, 7, 20, 30, 50, 333, 999, 1000):
        ref.set_timesteps(steps)
        sigmas, timesteps = unipc_schedule(steps, shift)
        assert sigmas.dtype == torch.float32 and sigmas.shape == (steps + 1,) and sigmas[-1] == 0
        assert torch.equal(sigmas, ref.sigmas), steps  # bit for bit
        assert timesteps.dtype == torch.int64 and torch.equal(timesteps, ref.timesteps), steps


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("steps", [1, 2, 5, 20, 50])
def test_unipc_sample_equals_the_scheduler_loop(steps, shift, order):
    noise = _noise()
    ref = _diffusers_loop(_scheduler(shift, order), steps, noise)
    sigmas, timesteps = unipc_schedule(steps, shift)
    ours = unipc_sample(velocity, noise, sigmas, order=order, timesteps=timesteps)
    assert ours.shape == noise.shape and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-5


def test_the_parity_is_not_vacuous():
    """What the tolerance separates: the same loop without the corrector, at order 1, or with
    the model fed the exact sigma instead of diffusers' integer timestep each lands > 1e-3 away."""
    noise, steps, shift = _noise(), 10, 3.0
    sigmas, timesteps = unipc_schedule(steps, shift)
    ours = unipc_sample(velocity, noise, sigmas, order=2, timesteps=timesteps)
    no_corrector = _diffusers_loop(_scheduler(shift, disable_corrector=list(range(steps))), steps, noise)
    assert (ours - no_corrector).abs().max() > 1e-3
    assert (ours - unipc_sample(velocity, noise, sigmas, order=1, timesteps=timesteps)).abs().max() > 1e-3
    assert (ours - unipc_sample(velocity, noise, sigmas, order=2)).abs().max() > 1e-3


def test_straight_paths_land_exactly_and_unipc_beats_euler():
    """A velocity that is exactly noise - x0 makes every x0 prediction exact: any step count lands
    on x0. On a curved field UniPC (order 2) at 8 steps is closer to a 400-step reference than
    Euler at 8 steps."""
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    sigmas, timesteps = unipc_schedule(3, 3.0)
    out = unipc_sample(lambda x, s: noise - x0, noise, sigmas, timesteps=timesteps)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)

    def curved(x, sigma):  # the model sees the solver's sigma here (no timesteps): a pure ODE
        return torch.tanh(x @ _W) * (1 + 2 * sigma) - 0.5 * x

    start = _noise()[0]
    fine = euler_sample(curved, start, inference_sigmas(400, 3.0))
    unipc8 = unipc_sample(curved, start, unipc_schedule(8, 3.0)[0])
    euler8 = euler_sample(curved, start, inference_sigmas(8, 3.0))
    assert (unipc8 - fine).abs().max() < 0.5 * (euler8 - fine).abs().max()


def test_bf16_noise_and_bad_arguments():
    sigmas, timesteps = unipc_schedule(4, 3.0)
    out = unipc_sample(lambda x, s: velocity(x.float(), s).bfloat16(), _noise().bfloat16(), sigmas, timesteps=timesteps)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    with pytest.raises(ValueError, match="order must be 1 to 3"):
        unipc_sample(velocity, _noise(), sigmas, order=4)
    with pytest.raises(ValueError, match="ending at 0"):
        unipc_sample(velocity, _noise(), sigmas[:-1])
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        unipc_sample(velocity, _noise(), torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="3 timesteps for 4 steps"):
        unipc_sample(velocity, _noise(), sigmas, timesteps=timesteps[:3])
    with pytest.raises(ValueError, match="num_steps"):
        unipc_schedule(0)
