"""UniPC multistep sampling for rectified-flow video diffusion, as Wan 2.1 / 2.2 sample by default.

diffusers' ``WanPipeline`` checkpoints ship ``UniPCMultistepScheduler(prediction_type=
"flow_prediction", use_flow_sigmas=True, flow_shift=3.0 (5.0 at 720p), solver_order=2,
solver_type="bh2", predict_x0=True, lower_order_final=True, disable_corrector=[])``. This is that
configuration, our own code, equal to diffusers' loop (tests/test_diffusion_unipc.py); diffusers'
other options (epsilon / v prediction, bh1, karras sigmas, thresholding, solver_p) are left out.

UniPC (Zhao et al. 2023, arXiv:2302.04867) is an exponential-integrator solver in the log-SNR
``lambda = log(alpha / sigma)``, here with alpha = 1 - sigma (x = alpha·x0 + sigma·noise). Each
step converts the velocity to a clean-latent prediction ``x0 = x - sigma·v`` and

- **corrects** (UniC) the sample it predicted last step, now that the model has been evaluated
  there: the same update from the previous sample again, with the new x0 as an extra point;
- **predicts** (UniP) the next sample from the last ``order`` x0 predictions (a multistep method:
  one model call per step, the older calls' outputs reused).

The order ramps up over the first steps (only that many x0s exist yet) and drops to 1 on the last
step (``lower_order_final``), whose target sigma 0 puts lambda at infinity: there the update is
simply x = x0. With 1 step UniPC is a single jump to x0.

Two quirks of diffusers', kept so that a sampled video equals WanPipeline's for the same model:
the schedule's first sigma is 1 - 1e-6 (log(alpha) would be -inf at sigma 1), and the model's
time input is the *integer* ``int(sigma·1000)`` (diffusers casts its timesteps to int64), while
the solver itself steps with the exact sigmas.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from omniweave.diffusion.schedule import shift_sigmas

UNIPC_MAX_ORDER = 3


def unipc_schedule(num_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)``: float32 [num_steps + 1] descending to a final 0, and int64 [num_steps]
    the model's time input at each step (diffusers' ``set_timesteps`` with ``use_flow_sigmas``).

    Unlike :func:`~omniweave.diffusion.schedule.inference_sigmas` (the Euler scheduler's), the
    steps are spaced evenly over the *unshifted* range 1 .. 1/N and shifted once. Computed in
    float64 as diffusers does with numpy; the timesteps come from the float64 sigmas (truncated),
    the returned sigmas are cast to float32 as diffusers stores them."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    # numpy's linspace (start + i * step), not torch's (which counts the second half from the end):
    # the two differ in the last bit, enough to move int(sigma * 1000) across an integer
    step = (1 / num_train_timesteps - 1) / num_steps
    sigmas = 1 + torch.arange(num_steps, dtype=torch.float64) * step
    sigmas = shift_sigmas(sigmas, shift)
    if abs(float(sigmas[0]) - 1) < 1e-6:  # shift maps 1 to 1: move it off, or lambda = log(0 / 1)
        sigmas[0] -= 1e-6
    timesteps = (sigmas * num_train_timesteps).to(torch.int64)  # truncation, as numpy's astype in diffusers
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1)]), timesteps


def _log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma; +inf at sigma 0 (the clean end)."""
    return math.inf if sigma == 0 else math.log(1 - sigma) - math.log(sigma)


def _weights(lam_s0: float, lam_t: float, lam_prev: list[float]) -> tuple[float, float, list[float], Tensor, Tensor]:
    """The B(h) ("bh2") coefficients of one step from lambda_s0 to lambda_t that uses the older
    points ``lam_prev`` (nearest first): ``(h_phi_1, B_h, r, R, b)`` with h = lambda_t - lambda_s0,
    ``h_phi_1 = e^-h - 1`` (the data-prediction, i.e. x0, form integrates with -h), r the older
    points' offsets in units of h, and R (Vandermonde rows r^0, r^1, ...) and b whose solution
    gives the weights of the x0 differences (the paper's rho: R rho = b)."""
    h = lam_t - lam_s0
    hh = -h
    h_phi_1 = math.expm1(hh)  # -1 at the last step (lambda_t = inf)
    b_h = h_phi_1  # bh2: B(h) = e^hh - 1
    r = [(lam - lam_s0) / h for lam in lam_prev] + [1.0]
    # b_k = k! · hh·phi_{k+1}(hh) / B(h) for the exponential-integrator phi functions; h_phi_k holds
    # hh·phi_{k+1}(hh), built by their recurrence phi_{k+1}(z) = (phi_k(z) - 1/k!) / z from phi_1
    h_phi_k, factorial, b = h_phi_1 / hh - 1, 1, []
    for k in range(1, len(r) + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    rks = torch.tensor(r, dtype=torch.float64)
    big_r = torch.stack([rks ** k for k in range(len(r))])
    return h_phi_1, b_h, r[:-1], big_r, torch.tensor(b, dtype=torch.float64)


def _update(x: Tensor, sigma_s0: float, sigma_t: float, h_phi_1: float, b_h: float, x0: Tensor,
            correction: Tensor | None) -> Tensor:
    """The exponential-integrator step in x0 form: ``x_t = sigma_t/sigma_s0 · x - alpha_t (e^-h - 1)
    x0 - alpha_t B(h) · correction`` (the first two terms alone are DDIM, i.e. order 1)."""
    alpha_t = 1 - sigma_t
    out = (sigma_t / sigma_s0) * x - (alpha_t * h_phi_1) * x0
    if correction is not None:
        out = out - (alpha_t * b_h) * correction
    return out


def unipc_sample(velocity_fn: Callable[[Tensor, Tensor], Tensor], noise: Tensor, sigmas: Tensor,
                 order: int = 2, timesteps: Tensor | None = None, num_train_timesteps: int = 1000) -> Tensor:
    """Sample with UniPC from ``noise`` along ``sigmas`` (descending, ending at 0: :func:`unipc_schedule`).

    ``velocity_fn(x, sigma)`` as for :func:`~omniweave.diffusion.schedule.euler_sample` (x in
    ``noise``'s dtype, sigma a 0-d tensor, the model's time being sigma · 1000), except that sigma
    is float64 and, with ``timesteps`` (the schedule's), is ``timesteps[i] / num_train_timesteps``:
    float64 so that sigma · 1000 gives back diffusers' integer exactly. Without ``timesteps`` the
    model sees the solver's sigma. ``order`` 1 to 3 (Wan: 2). x and the x0 predictions stay
    float32 between steps; returns ``noise``'s dtype."""
    if sigmas.dim() != 1 or len(sigmas) < 2 or float(sigmas[-1]) != 0:
        raise ValueError(f"sigmas must be a 1-D schedule of at least 2 values ending at 0, got {sigmas.tolist()}")
    if not 1 <= order <= UNIPC_MAX_ORDER:
        raise ValueError(f"UniPC order must be 1 to {UNIPC_MAX_ORDER}, got {order}")
    s = sigmas.tolist()  # the float32 values as float64: the coefficients are computed in float64
    n = len(s) - 1
    if not all(0 < v < 1 for v in s[:-1]):
        raise ValueError("UniPC needs sigmas strictly between 0 and 1 before the final 0 (unipc_schedule makes them)")
    if timesteps is not None and len(timesteps) != n:
        raise ValueError(f"{len(timesteps)} timesteps for {n} steps")
    lam = [_log_snr(v) for v in s]
    x = noise.float()
    x0s: list[Tensor] = []  # the x0 predictions so far, newest last (only the last `order` are used)
    last_x, last_order = None, 0
    for i in range(n):
        t_in = s[i] if timesteps is None else int(timesteps[i]) / num_train_timesteps
        v = velocity_fn(x.to(noise.dtype), torch.tensor(t_in, dtype=torch.float64, device=noise.device))
        x0 = x - s[i] * v.float()  # flow prediction -> data prediction, at the uncorrected sample
        if last_x is not None:
            # UniC: redo last step's update from last_x with this step's x0 as one more point;
            # its order is the predictor's, and the new point always gets the final weight
            prev = x0s[-last_order:][::-1]  # m0 = the previous x0, then older ones
            h_phi_1, b_h, r, big_r, b = _weights(lam[i - 1], lam[i], [lam[i - 1 - k] for k in range(1, last_order)])
            rho = [0.5] if last_order == 1 else torch.linalg.solve(big_r, b).tolist()
            corr = rho[-1] * (x0 - prev[0])
            for k in range(1, last_order):
                corr = corr + rho[k - 1] * ((prev[k] - prev[0]) / r[k - 1])
            x = _update(last_x, s[i - 1], s[i], h_phi_1, b_h, prev[0], corr)
        x0s = (x0s + [x0])[-order:]
        # warm-up (as many points as exist) and lower_order_final (order 1 into sigma 0, 2 before it...)
        p = min(order, n - i, i + 1)
        prev = x0s[-p:][::-1]
        h_phi_1, b_h, r, big_r, b = _weights(lam[i], lam[i + 1], [lam[i - k] for k in range(1, p)])
        corr = None
        if p > 1:
            # UniP: weights of the older points' divided differences; order 2 uses 0.5 (diffusers' shortcut)
            rho = [0.5] if p == 2 else torch.linalg.solve(big_r[:-1, :-1], b[:-1]).tolist()
            corr = sum(rho[k - 1] * ((prev[k] - prev[0]) / r[k - 1]) for k in range(1, p))
        last_x, last_order = x, p
        x = _update(x, s[i], s[i + 1], h_phi_1, b_h, prev[0], corr)
    return x.to(noise.dtype)
