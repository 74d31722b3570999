"""Flow matching for action chunks (Pi0.5): time embedding and sampling, targets and loss, the
Euler sampler, and the prefix/suffix attention mask and positions. Pure functions, no model.

Time runs the way openpi's and lerobot's code run it (the Pi0 paper prints the opposite sign):
t = 1 is pure noise, t = 0 the actions.

    x_t = t·noise + (1 − t)·actions        the noisy chunk the expert sees
    u_t = noise − actions                  the velocity it is trained to predict (dx_t/dt)
    t  ~ Beta(1.5, 1)·0.999 + 0.001        density ∝ t^0.5: the noisier end is drawn more often

Sampling integrates dx/dt = v from t = 1 (noise) to t = 0 with Euler steps dt = −1/num_steps.

The attention pattern of one sample is a prefix (images, language: bidirectional, never sees the
actions) followed by a suffix of action tokens (sees the whole prefix and itself bidirectionally).
A packed row holds several such samples, block-diagonally, with positions restarting per sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

# --- time ------------------------------------------------------------------------------------


def sinusoidal_time_embedding(
    t: Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0, dtype: torch.dtype | None = None
) -> Tensor:
    """[B, dim] ``[sin(2π t / p), cos(2π t / p)]`` for ``t`` [B], with the dim/2 periods ``p``
    geometric from ``min_period`` to ``max_period`` (lerobot's ``create_sinusoidal_pos_embedding``).

    Computed in float64, because 2π t / 4e-3 reaches ~1.6e3 rad, where float32's phase error is
    ~1e-4; then cast to ``dtype`` (default: ``t``'s floating dtype, else float32).
    """
    if dim % 2:
        raise ValueError(f"the time embedding's dim must be even ([sin, cos] halves), got {dim}")
    if t.dim() != 1:
        raise ValueError(f"t must be [B] (one time per sample), got shape {tuple(t.shape)}")
    if dtype is None:
        dtype = t.dtype if t.is_floating_point() else torch.float32
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = t.to(torch.float64)[:, None] * (2 * math.pi / period)[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(dtype)


def _standard_gamma(shape: torch.Size, concentration: float, generator: torch.Generator) -> Tensor:
    """Gamma(concentration, 1) variates drawn only from ``generator`` (``torch._standard_gamma``
    and ``torch.distributions`` take no generator): Marsaglia & Tsang's exact rejection method,
    vectorised, redrawing the rejected entries until none is left (acceptance > 95 % for
    concentration ≥ 1, so a few rounds). Concentration < 1 uses Gamma(a) = Gamma(a + 1)·U^(1/a)."""
    device = generator.device
    if concentration < 1.0:
        boost = torch.rand(shape, generator=generator, device=device).pow(1.0 / concentration)
        return _standard_gamma(shape, concentration + 1.0, generator) * boost
    d = concentration - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(shape, device=device).flatten()
    pending = torch.arange(out.numel(), device=device)
    while pending.numel():
        x = torch.randn(pending.numel(), generator=generator, device=device)
        u = torch.rand(pending.numel(), generator=generator, device=device)
        v = (1.0 + c * x) ** 3
        accept = (v > 0) & (torch.log(u) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp_min(1e-30)))
        out[pending[accept]] = d * v[accept]
        pending = pending[~accept]
    return out.view(shape)


def sample_flow_time(batch: int, generator: torch.Generator, alpha: float = 1.5, beta: float = 1.0) -> Tensor:
    """[batch] float32 flow times ``Beta(alpha, beta)·0.999 + 0.001`` in [0.001, 1] (t = 1 is pure
    noise), reproducible from ``generator`` alone (drawn on its device).

    Beta(α, β) = Gα / (Gα + Gβ) for independent Gamma(α, 1), Gamma(β, 1) variates, each drawn with
    the generator (see :func:`_standard_gamma`); lerobot's ``torch.distributions.Beta`` cannot
    take a generator, so its draws are not reproducible per call.
    """
    shape = torch.Size([batch])
    g_alpha = _standard_gamma(shape, alpha, generator)
    g_beta = _standard_gamma(shape, beta, generator)
    return (g_alpha / (g_alpha + g_beta)) * 0.999 + 0.001


# --- training targets and loss ---------------------------------------------------------------


def _per_sample(t: Tensor, like: Tensor) -> Tensor:
    """``t`` [B] viewed as [B, 1, …] to broadcast against ``like`` [B, H, D]."""
    return t.reshape(t.shape[0], *([1] * (like.dim() - 1))).to(like.dtype)


def flow_matching_targets(actions: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_t, u_t)`` for ``actions``, ``noise`` [B, H, D] and ``t`` [B]: the noisy chunk
    ``t·noise + (1 − t)·actions`` and the target velocity ``noise − actions``."""
    tb = _per_sample(t, actions)
    return tb * noise + (1.0 - tb) * actions, noise - actions


class FlowLoss(NamedTuple):
    """The loss of one batch and the parts a global normalisation needs: ``mean = sum / count``
    (0 when nothing counts); a packed or distributed caller sums ``sum`` and ``count`` over its
    micro-batches and ranks and divides once."""

    mean: Tensor  # float32 scalar
    sum: Tensor  # float32 scalar: summed squared error over the counted elements
    count: Tensor  # int64 scalar: unpadded steps × real action columns


def flow_matching_loss(
    v_pred: Tensor, u_t: Tensor, action_is_pad: Tensor | None = None, action_dim: int | Tensor | None = None
) -> FlowLoss:
    """Mean squared error between the predicted and target velocities [B, H, D_max], in float32
    (float64 for float64 inputs).

    ``action_dim`` keeps only the first (real) action columns: the chunk is zero-padded to the
    model's ``max_action_dim``, and the padded columns are not scored (as lerobot truncates). An
    int holds for the batch; a tensor [B] gives each sample its own (datasets of different robots
    in one row). ``action_is_pad`` [B, H] (True: a step past the episode's end, which the LeRobot
    reader fills by repeating the last frame) excludes those steps. lerobot 0.4.4 does *not* mask
    them (nor does LoongForge), so it trains on the repeated frames; we mask them, as issue 37
    asks, so a loss here differs from lerobot's on chunks that cross an episode's end.
    """
    if isinstance(action_dim, int):
        v_pred, u_t = v_pred[..., :action_dim], u_t[..., :action_dim]
    acc = torch.promote_types(v_pred.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
    sq = (v_pred.to(acc) - u_t.to(acc)).pow(2)  # [B, H, D]
    keep = torch.ones(sq.shape[:-1], dtype=torch.bool, device=sq.device)  # [B, H]
    if action_is_pad is not None:
        keep = ~action_is_pad.to(device=sq.device, dtype=torch.bool)
    columns = torch.ones(sq.shape[0], sq.shape[-1], dtype=torch.bool, device=sq.device)  # [B, D]
    if isinstance(action_dim, Tensor):
        columns = torch.arange(sq.shape[-1], device=sq.device)[None] < action_dim.to(sq.device).reshape(-1, 1)
    scored = keep[..., None] & columns[:, None, :]  # [B, H, D]
    total = (sq * scored).sum()  # multiply, not index: no host sync, same graph
    count = scored.sum()
    return FlowLoss(total / count.clamp_min(1), total, count)


# --- sampling --------------------------------------------------------------------------------


def euler_sample(velocity_fn: Callable[[Tensor, Tensor], Tensor], noise: Tensor, num_steps: int = 10) -> Tensor:
    """Integrate dx/dt = ``velocity_fn(x, t)`` from t = 1 (``x = noise`` [B, H, D]) to t = 0 with
    ``num_steps`` Euler steps ``x ← x + dt·v``, ``dt = −1/num_steps``; returns x at t = 0.

    ``velocity_fn`` gets ``t`` as float32 [B] (one time per sample, as the expert's time
    embedding takes it). The k-th step's time is ``1 − k/num_steps`` computed afresh, where lerobot
    accumulates ``time += dt`` in float32 (a difference of ~1e-7 in t).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    dt = -1.0 / num_steps
    x = noise
    for k in range(num_steps):
        t = torch.full((noise.shape[0],), 1.0 - k / num_steps, dtype=torch.float32, device=noise.device)
        x = x + dt * velocity_fn(x, t)
    return x


# --- attention mask and positions ------------------------------------------------------------


def prefix_suffix_mask(
    prefix_lens: Sequence[int], suffix_lens: Sequence[int], device: torch.device | str | None = None
) -> Tensor:
    """Dense bool [N, N] (True: may attend) for a packed row of samples, each its prefix tokens
    then its suffix tokens, N the total length: token i attends j iff both are of the same sample
    and ``block(j) <= block(i)`` with block 0 the prefix and 1 the suffix. So a prefix is
    bidirectional and never sees its suffix; a suffix sees its whole prefix and itself
    bidirectionally; no token sees another sample."""
    if len(prefix_lens) != len(suffix_lens):
        raise ValueError(f"{len(prefix_lens)} prefix lengths but {len(suffix_lens)} suffix lengths")
    sample, block = [], []
    for s, (p, a) in enumerate(zip(prefix_lens, suffix_lens)):
        sample += [s] * (p + a)
        block += [0] * p + [1] * a
    sample_id = torch.tensor(sample, dtype=torch.long, device=device)
    block_id = torch.tensor(block, dtype=torch.long, device=device)
    same_sample = sample_id[:, None] == sample_id[None, :]
    return same_sample & (block_id[None, :] <= block_id[:, None])


def att_2d_mask(att: Tensor, pad: Tensor) -> Tensor:
    """big_vision's / lerobot's ``make_att_2d_masks``: [B, N, N] bool from ``att`` [B, N] (1: the
    token starts a new block that earlier tokens cannot see) and ``pad`` [B, N] (True: a real
    token); i attends j iff ``cumsum(att)[j] <= cumsum(att)[i]`` and both are real. Pi0.5 uses
    ``att = [0]*prefix + [1] + [0]*(suffix − 1)``; kept to check :func:`prefix_suffix_mask`."""
    if att.dim() != 2 or pad.dim() != 2:
        raise ValueError(f"att and pad must be [B, N], got {tuple(att.shape)} and {tuple(pad.shape)}")
    cum = torch.cumsum(att.long(), dim=1)
    blocks_visible = cum[:, None, :] <= cum[:, :, None]
    both_real = pad[:, None, :].bool() & pad[:, :, None].bool()
    return blocks_visible & both_real


def prefix_suffix_positions(prefix_valid: Tensor, suffix_len: int) -> Tensor:
    """Positions [..., P + suffix_len] for ``prefix_valid`` [..., P] (True: a real prefix token):
    ``cumsum(valid) − 1`` over the prefix then the suffix (all real), so padding does not advance
    the positions and the suffix continues right after the last real prefix token. A padded slot
    repeats the position before it (−1 before any real token), as in lerobot; its attention is
    masked anyway."""
    valid = prefix_valid.bool()
    suffix = valid.new_ones((*valid.shape[:-1], suffix_len))
    return torch.cumsum(torch.cat([valid, suffix], dim=-1).long(), dim=-1) - 1
