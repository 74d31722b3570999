"""The rectified-flow noise schedule of video diffusion (Wan 2.1 / 2.2), as diffusers' and
DiffSynth-Studio's training and sampling code run it. Pure functions, no model.

Convention (diffusers' ``FlowMatchEulerDiscreteScheduler``; the same as the VLA action expert's,
models/components/flow.py): sigma = 1 is pure noise, sigma = 0 the clean latent.

    x_sigma  = sigma * noise + (1 - sigma) * x0        what the DiT sees (``scale_noise``)
    v        = noise - x0                              what it is trained to predict (dx/dsigma)
    timestep = sigma * num_train_timesteps             what its time embedding reads (0..1000)
    shift    : sigma' = s * sigma / (1 + (s - 1) * sigma)   more steps at the noisy end (Wan: 3 to 5)

Training draws one sigma per clip from the *shifted table* of ``num_train_timesteps`` values
(diffusers' scheduler ``sigmas`` at construction == DiffSynth's ``set_timesteps(1000,
training=True)``): uniform over the table (DiffSynth, LoongForge), or SD3's logit-normal / mode
densities mapped to a table index (diffusers' ``compute_density_for_timestep_sampling`` as its
SD3 / Wan training scripts use it). The per-clip loss weight is one of: none, DiffSynth's bell
curve over the table, SD3's ``sigma_sqrt`` or ``cosmap``.

Sampling integrates dx/dsigma = v with Euler steps over :func:`inference_sigmas` -- diffusers'
``set_timesteps(n)``, which spaces the n timesteps between the *shifted* table's ends and then
shifts them again (its quirk, kept so that a sampled video equals diffusers' for the same model).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

TIMESTEP_SAMPLING = ("uniform", "logit_normal", "mode")
LOSS_WEIGHTING = ("none", "bell", "sigma_sqrt", "cosmap")


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """``shift * sigma / (1 + (shift - 1) * sigma)``: shift 1 is the identity; > 1 moves sigma up."""
    if shift <= 0:
        raise ValueError(f"the timestep shift must be positive, got {shift}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def train_sigmas(shift: float = 1.0, num_train_timesteps: int = 1000) -> Tensor:
    """float32 [N]: the training table, 1 down to 1/N, shifted (descending)."""
    # float32 throughout, in diffusers' order of operations: the table equals its bit for bit
    base = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float32)
    return shift_sigmas(base / num_train_timesteps, shift)


def inference_sigmas(num_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000) -> Tensor:
    """float32 [num_steps + 1]: the sampling schedule, ending with 0 (diffusers' ``set_timesteps``).

    The steps are spaced evenly between the shifted table's first and last timestep, divided by
    N, shifted again, and a terminal 0 appended -- computed in float64 where diffusers uses numpy's
    float64 too, then cast."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    table = train_sigmas(shift, num_train_timesteps)
    hi, lo = float(table[0]) * num_train_timesteps, float(table[-1]) * num_train_timesteps
    timesteps = torch.linspace(hi, lo, num_steps, dtype=torch.float64)
    sigmas = shift_sigmas(timesteps / num_train_timesteps, shift).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


def sample_train_sigmas(n: int, generator: torch.Generator, *, shift: float = 1.0, sampling: str = "uniform",
                        logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29,
                        num_train_timesteps: int = 1000) -> Tensor:
    """float32 [n]: one training sigma per clip, drawn from ``generator`` alone (reproducible).

    ``uniform``: a uniform index into the shifted table. ``logit_normal`` / ``mode``: SD3's
    densities u in (0, 1) (diffusers' ``compute_density_for_timestep_sampling``), index
    ``int(u * N)`` into the same table, as diffusers' SD3 and Wan training scripts do."""
    if sampling not in TIMESTEP_SAMPLING:
        raise ValueError(f"timestep sampling {sampling!r}: choose from {', '.join(TIMESTEP_SAMPLING)}")
    table = train_sigmas(shift, num_train_timesteps)
    device = generator.device
    if sampling == "uniform":
        index = torch.randint(0, num_train_timesteps, (n,), generator=generator, device=device)
    else:
        if sampling == "logit_normal":
            u = torch.sigmoid(torch.normal(logit_mean, logit_std, (n,), generator=generator, device=device))
        else:
            u = torch.rand(n, generator=generator, device=device)
            u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        index = (u * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)
    return table.to(device)[index]


def loss_weights(sigmas: Tensor, weighting: str = "none", *, shift: float = 1.0,
                 num_train_timesteps: int = 1000) -> Tensor:
    """float32 per-clip loss weights for ``sigmas``.

    ``bell``: DiffSynth-Studio's ``linear_timesteps_weights``: y = exp(-2 ((t - N/2) / N)^2) over
    the shifted table's timesteps, minus its minimum, scaled to sum N; each sigma takes the weight
    of its nearest table entry. ``sigma_sqrt`` = sigma^-2 and ``cosmap`` = 2 / (pi (1 - 2 sigma +
    2 sigma^2)) are SD3's (diffusers' ``compute_loss_weighting_for_sd3``)."""
    if weighting not in LOSS_WEIGHTING:
        raise ValueError(f"loss weighting {weighting!r}: choose from {', '.join(LOSS_WEIGHTING)}")
    sigmas = sigmas.float()
    if weighting == "none":
        return torch.ones_like(sigmas)
    if weighting == "sigma_sqrt":
        return sigmas ** -2.0
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    table = train_sigmas(shift, num_train_timesteps).to(sigmas.device)
    t = table * num_train_timesteps
    n = num_train_timesteps
    y = torch.exp(-2 * ((t - n / 2) / n) ** 2)
    y = y - y.min()
    weights = y * (n / y.sum())
    nearest = (table[None, :] - sigmas[:, None]).abs().argmin(dim=1)
    return weights[nearest]


def noisy_latents(x0: Tensor, noise: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_sigma, v)`` for latents ``x0`` and ``noise`` of one shape and a ``sigma`` that broadcasts
    against them (a scalar, or one value per token of a packed row): the DiT's input and target."""
    sigma = sigma.to(x0.dtype)
    return sigma * noise + (1 - sigma) * x0, noise - x0


def euler_sample(velocity_fn: Callable[[Tensor, Tensor], Tensor], noise: Tensor, sigmas: Tensor) -> Tensor:
    """Integrate dx/dsigma = ``velocity_fn(x, sigma)`` from ``noise`` along ``sigmas`` (descending,
    ending at 0, as :func:`inference_sigmas` makes them): ``x <- x + (sigma_next - sigma) * v``.
    x stays float32 between steps (diffusers upcasts each step but rounds x back to the model's
    dtype after it: the same in float32, a little more exact in bf16); returns ``noise``'s dtype."""
    if sigmas.dim() != 1 or len(sigmas) < 2:
        raise ValueError(f"sigmas must be a 1-D schedule of at least 2 values, got shape {tuple(sigmas.shape)}")
    x = noise.float()
    for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        v = velocity_fn(x.to(noise.dtype), torch.tensor(sigma, dtype=torch.float32, device=noise.device))
        x = x + (sigma_next - sigma) * v.float()
    return x.to(noise.dtype)


def guided(v_text: Tensor, v_empty: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance: ``v_empty + scale * (v_text - v_empty)`` (scale 1: the text branch)."""
    return v_empty + scale * (v_text - v_empty)
