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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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

    def validate(self) -> "ORPOConfig":
        if not self.beta > 0:
            raise UserError(f"train.orpo.beta must be > 0, got {self.beta}")
        return self


@dataclass(frozen=True)
class SimPOConfig:
    beta: float = 2.0
    gamma: float = 0.5  # the target reward margin γ (TRL's simpo_gamma)
    label_smoothing: float = 0.0
    nll_weight: float = 0.0  # the chosen answer's NLL added (TRL's cpo_alpha; 0: SimPO as published)

    def validate(self) -> "SimPOConfig":
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


class _ReferenceFree(DPOObjective):
    """The pair objective without a reference (``row_inputs`` gives zeros, never a forward)."""

    def __init__(self, cfg, engine):
        from omniweave.train.dpo import DPOConfig

        self.settings, self.engine = DPOConfig(ref="none"), engine
        self.base_is_reference, self.reference, self.stored = False, None, None


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
    """``train.orpo.*`` / ``train.simpo.*`` valid (before any rank starts)."""
    from omniweave.config import section

    tc = section(cfg, "train")
    if tc.phase == "orpo":
        ORPOConfig(float(tc.orpo.beta)).validate()
    elif tc.phase == "simpo":
        SimPOConfig(float(tc.simpo.beta), float(tc.simpo.gamma), float(tc.simpo.label_smoothing),
                    float(tc.simpo.nll_weight)).validate()
