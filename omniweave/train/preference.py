"""Reference-free preference losses on the same pairs as DPO: ORPO and SimPO (``train.phase``).

Both score a pair by its answers' *average* token log-probs (each side's log-prob sum over its
token count: no reference model, no length bias), from the same per-row sums as DPO (train/dpo.py:
``DPOObjective.sums`` [P, 4], carried across chunks and CP shards alike), so they run wherever DPO
does, and more (no reference forward: under ``parallel.pp`` too).

ORPO (Hong et al. 2024; TRL 1.16 ``trl.experimental.orpo.ORPOTrainer.odds_ratio_loss``), with
a_c, a_r the chosen / rejected average log-probs and λ = ``train.orpo.beta``:

    log_odds = (a_c − a_r) − (log(1 − e^{a_c}) − log(1 − e^{a_r}))
    loss     = −(a_c) − λ · log σ(log_odds)          (the chosen answer's NLL + the odds-ratio term)
    rewards  λ · a_c, λ · a_r

The NLL term is each chosen answer's mean token NLL, averaged over the pairs; TRL averages it over
the batch's chosen tokens instead (the same when the chosen answers have one length).

SimPO (Meng et al. 2024; TRL 1.16 ``trl.experimental.cpo.CPOTrainer.cpo_loss``, ``loss_type=
"simpo"``), with β = ``train.simpo.beta``, γ = ``train.simpo.gamma``, ε label smoothing:

    z        = (a_c − a_r) − γ / β
    loss     = −(1 − ε) · log σ(β z) − ε · log σ(−β z) + nll_weight · (−a_c)    (TRL's cpo_alpha)
    rewards  β · a_c, β · a_r

KTO (Ethayarajh et al. 2024; TRL 1.16 ``trl.trainer.kto_trainer.KTOTrainer._compute_loss``) is
unpaired: each completion is desirable or not, scored by its sequence log-ratio to the reference
against a reference point z0 (:func:`kto_kl_reference`), see :func:`kto_loss`; the training
objective, its data and its z0 over the step's rows: train/kto.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from omniweave.errors import UserError
from omniweave.train.dpo import DPOObjective


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − e^x) for x < 0, stable at both ends (TRL's ``log1mexp``; Mächler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass(frozen=True)
class ORPOConfig:
    beta: float = 0.1  # λ: the odds-ratio term's weight (TRL's beta)

    def validate(self) -> ORPOConfig:
        if not self.beta > 0:
            raise UserError(f"train.orpo.beta must be > 0, got {self.beta}")
        return self


@dataclass(frozen=True)
class SimPOConfig:
    beta: float = 2.0
    gamma: float = 0.5  # the target reward margin γ (TRL's simpo_gamma)
    label_smoothing: float = 0.0
    nll_weight: float = 0.0  # the chosen answer's NLL added (TRL's cpo_alpha; 0: SimPO as published)

    def validate(self) -> SimPOConfig:
        if not self.beta > 0:
            raise UserError(f"train.simpo.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"train.simpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.nll_weight < 0 or self.gamma < 0:
            raise UserError(f"train.simpo.gamma and nll_weight must be >= 0, got {self.gamma}, {self.nll_weight}")
        return self


def orpo_loss(avg: Tensor, cfg: ORPOConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss [P], chosen reward [P], rejected reward [P], log_odds [P]) of [P, 2] average log-probs."""
    a = avg.float()
    log_odds = (a[:, 0] - a[:, 1]) - (log1mexp(a[:, 0]) - log1mexp(a[:, 1]))
    losses = -a[:, 0] - cfg.beta * F.logsigmoid(log_odds)
    rewards = cfg.beta * a.detach()
    return losses, rewards[:, 0], rewards[:, 1], log_odds.detach()


def simpo_loss(avg: Tensor, cfg: SimPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(loss [P], chosen reward [P], rejected reward [P]) of [P, 2] average log-probs."""
    a = avg.float()
    z = (a[:, 0] - a[:, 1]) - cfg.gamma / cfg.beta
    eps = cfg.label_smoothing
    losses = -F.logsigmoid(cfg.beta * z) * (1 - eps) - F.logsigmoid(-cfg.beta * z) * eps
    if cfg.nll_weight:
        losses = losses - cfg.nll_weight * a[:, 0]
    rewards = cfg.beta * a.detach()
    return losses, rewards[:, 0], rewards[:, 1]


KTO_LOSSES = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KTOConfig:
    beta: float = 0.1
    desirable_weight: float = 1.0  # λ_D: scales the desirable completions' losses (TRL's names)
    undesirable_weight: float = 1.0  # λ_U: to balance unequal numbers of the two kinds
    loss: str = "kto"  # one of KTO_LOSSES (TRL's loss_type)

    def validate(self) -> KTOConfig:
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise UserError(f"train.kto.beta must be a finite number > 0, got {self.beta}")
        for key in ("desirable_weight", "undesirable_weight"):
            w = getattr(self, key)
            if not (math.isfinite(w) and w >= 0):
                raise UserError(f"train.kto.{key} must be a finite number >= 0, got {w}")
        if self.loss not in KTO_LOSSES:
            raise UserError(f"train.kto.loss must be one of {', '.join(KTO_LOSSES)}, got {self.loss!r}")
        return self


def kto_kl_reference(policy_kl: Tensor, ref_kl: Tensor, group=None) -> Tensor:
    """KTO's reference point z0, a detached fp32 scalar, as TRL 1.16's ``KTOTrainer._compute_loss``:

        z0 = max(0, mean over the processes of (mean over the batch of policy_kl − ref_kl))

    ``policy_kl`` / ``ref_kl`` [M]: the sequence log-probs of mismatched (prompt, completion) pairs
    (TRL pairs each prompt with the batch's next completion) under the policy and the reference.
    With ``group`` the per-process means are averaged over its ranks (TRL's ``gather_for_metrics``
    then mean: each process weighs the same, whatever its batch size); every rank gets one z0."""
    if policy_kl.shape != ref_kl.shape or policy_kl.numel() == 0:
        raise ValueError(f"need two non-empty [M] tensors of one shape, got {tuple(policy_kl.shape)} and "
                         f"{tuple(ref_kl.shape)}")
    z0 = (policy_kl.detach().float() - ref_kl.detach().float()).mean()
    if group is not None:
        dist.all_reduce(z0, group=group)
        z0 = z0 / dist.get_world_size(group)
    return z0.clamp(min=0)


def kto_loss(policy: Tensor, ref: Tensor, desirable: Tensor, z0: Tensor | float | None,
             cfg: KTOConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(loss per completion [N], desirable rewards [N_D], undesirable rewards [N_U]), fp32; the
    rewards are detached. ``policy`` / ``ref`` [N]: the completions' sequence log-probs;
    ``desirable`` [N] bool; ``z0``: :func:`kto_kl_reference` (unused by ``apo_zero_unpaired``).
    With r = policy − ref (Ethayarajh et al. 2024, eq. 7; TRL 1.16 ``KTOTrainer._compute_loss``):

        kto                desirable  λ_D · (1 − σ(β (r − z0)))    undesirable  λ_U · (1 − σ(β (z0 − r)))
        apo_zero_unpaired  desirable  λ_D · (1 − σ(β r))           undesirable  λ_U · σ(β r)
        rewards            β · r

    The batch loss is the mean over all N completions (TRL's ``losses.nanmean()``), in input order
    here where TRL puts the desirable ones first (the mean is the same)."""
    if not (policy.shape == ref.shape == desirable.shape) or policy.dim() != 1:
        raise ValueError(f"policy, ref and desirable must be [N] of one shape, got {tuple(policy.shape)}, "
                         f"{tuple(ref.shape)}, {tuple(desirable.shape)}")
    r = policy.float() - ref.detach().float()
    if cfg.loss == "kto":
        if z0 is None:
            raise ValueError("the kto loss needs its reference point z0 (kto_kl_reference)")
        shift = torch.as_tensor(z0, dtype=torch.float32, device=r.device).detach()
        good, bad = 1 - torch.sigmoid(cfg.beta * (r - shift)), 1 - torch.sigmoid(cfg.beta * (shift - r))
    else:
        good, bad = 1 - torch.sigmoid(cfg.beta * r), torch.sigmoid(cfg.beta * r)
    want = desirable.to(device=r.device, dtype=torch.bool)
    losses = torch.where(want, cfg.desirable_weight * good, cfg.undesirable_weight * bad)
    rewards = cfg.beta * r.detach()
    return losses, rewards[want], rewards[~want]


class _ReferenceFree(DPOObjective):
    """The pair objective without a reference (``row_inputs`` gives zeros, never a forward)."""

    def __init__(self, cfg, engine):
        from omniweave.train.dpo import DPOConfig

        self.settings, self.engine = DPOConfig(ref="none"), engine
        self.reference, self.stored = None, None


class ORPOObjective(_ReferenceFree):
    name = "orpo"

    def __init__(self, cfg, engine):
        from omniweave.config import section

        super().__init__(cfg, engine)
        self.orpo = ORPOConfig(float(section(cfg, "train").orpo.beta)).validate()

    def pair_losses(self, policy: Tensor, ref: Tensor, lengths: Tensor):
        losses, chosen, rejected, _ = orpo_loss(policy / lengths, self.orpo)
        return losses, chosen, rejected


class SimPOObjective(_ReferenceFree):
    name = "simpo"

    def __init__(self, cfg, engine):
        from omniweave.config import section

        super().__init__(cfg, engine)
        s = section(cfg, "train").simpo
        self.simpo = SimPOConfig(float(s.beta), float(s.gamma), float(s.label_smoothing), float(s.nll_weight)).validate()

    def pair_losses(self, policy: Tensor, ref: Tensor, lengths: Tensor):
        return simpo_loss(policy / lengths, self.simpo)


OBJECTIVES = {"orpo": ORPOObjective, "simpo": SimPOObjective}


def check_settings(cfg) -> None:
    """``train.orpo.*`` / ``train.simpo.*`` / ``train.kto.*`` valid (before any rank starts)."""
    from omniweave.config import section

    tc = section(cfg, "train")
    if tc.phase == "orpo":
        ORPOConfig(float(tc.orpo.beta)).validate()
    elif tc.phase == "simpo":
        SimPOConfig(float(tc.simpo.beta), float(tc.simpo.gamma), float(tc.simpo.label_smoothing),
                    float(tc.simpo.nll_weight)).validate()
    elif tc.phase == "kto":
        from omniweave.train.kto import kto_settings

        kto_settings(cfg)
