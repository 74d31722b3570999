"""Rollout/training mismatch correction (``rl.rollout.correction``).

An engine other than the native one (vLLM) samples with its own kernels, so the log-probs it reports
(μ, the behaviour policy) differ from the trainer's forward on the same weights (π_old), and a
PPO ratio π_θ / μ would carry that gap as if it were policy change. The correction (Yao et al.,
"Your efficient RL framework secretly brings you off-policy RL training"; verl's
``rollout_corr_helper.py``; TRL's ``vllm_importance_sampling_correction``):

* ``recompute``: π_old is recomputed by the trainer's forward on the packed update rows (before the
  first optimizer step of the step), and the PPO ratio is π_θ / π_old (decoupled PPO);
* ``token_tis``: in addition each token's loss is weighted by ``w = min(π_old / μ, C)``
  (``rl.rollout.tis_cap``), a constant (no gradient flows through it: the weight must be detached,
  or the gradient gains a ``log π · ∇w`` bias);
* ``seq_tis``: one weight per sequence, ``min(Π_t π_old / μ, C)`` (unbiased, higher variance);
* ``none``: the engine's log-probs are π_old (the native engine's equal the trainer's within 1e-5).

``auto`` (the default) is ``token_tis`` on vLLM or one step off-policy (``rl.rollout.off_policy: 1``,
where μ is the previous step's policy: decoupled PPO as AReaL's) and ``none`` on the native engine
on-policy. ``log ρ`` is
clamped to ±20 before the exponential, as verl's is. Each step records how far the engine is
from the trainer, over the response tokens (sampled from μ), with ρ = π_old / μ: ``rollout/kl`` =
mean(log μ − log π_old) and ``rollout/k3_kl`` = mean(ρ − log ρ − 1) (two estimators of KL(μ ‖ π_old)),
the weights' mean and max, and the fraction truncated at C (``rollout/is_clip_frac``).
"""

from __future__ import annotations

import torch

MODES = ("none", "recompute", "token_tis", "seq_tis")
SAFETY = 20.0  # |log ρ| clamp (verl's SAFETY_BOUND)
STAT_KEYS = ("tokens", "kl", "k3_kl", "is_sum", "is_clipped")


def resolve(mode: str, engine: str, off_policy: int = 0) -> str:
    """The correction a run applies: ``auto`` by engine and staleness (token_tis unless the native
    engine samples on-policy); an unknown mode is a ValueError."""
    if mode == "auto":
        return "none" if engine == "native" and not off_policy else "token_tis"
    if mode not in MODES:
        raise ValueError(f"rl.rollout.correction must be auto, {', '.join(MODES)}; got {mode!r}")
    return mode


def correct_row(row: dict, trainer_logp: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """Apply ``mode`` to one update row in place: its ``token_data["old_logp"]`` (the engine's μ)
    kept as ``engine_logp`` and replaced by ``trainer_logp`` [L] (π_old), its ``weights`` multiplied
    by the truncated importance weight. Returns this row's statistics [len(STAT_KEYS)] (float64
    sums; the weights' max is :func:`max_weight`'s). ``mode`` is not ``none``."""
    td = row["token_data"]
    mask = row["labels"] != -100
    mu = td["old_logp"].float()
    old = torch.where(mask, trainer_logp.float(), 0.0)
    td["engine_logp"], td["old_logp"] = mu, old
    raw = torch.where(mask, old - mu, 0.0)  # log ρ; clamped before an exponential only (verl's SAFETY_BOUND)
    if mode == "token_tis":
        weight = raw.clamp(-SAFETY, SAFETY).exp().clamp(max=cap)
    elif mode == "seq_tis":  # the sequence's sum of log ρ, clamped once
        slot = td["seq_slot"].long()
        per_seq = torch.zeros(int(slot.max()) + 1 if slot.numel() else 1, dtype=raw.dtype).index_add_(0, slot, raw)
        weight = per_seq.clamp(-SAFETY, SAFETY).exp().clamp(max=cap)[slot]
    else:
        weight = torch.ones_like(raw)
    weight = torch.where(mask, weight, 0.0)
    td["weights"] = td["weights"] * weight
    td["is_weight"] = weight
    lr = raw.double()  # ρ − log ρ − 1 ~ (log ρ)²/2: in fp32 it rounds to 0 for |log ρ| < 1e-4
    k3 = torch.where(mask, torch.expm1(lr.clamp(-SAFETY, SAFETY)) - lr, 0.0)
    return torch.stack([mask.sum().double(), -lr.sum(), k3.sum(), weight.sum().double(),
                        (mask & (weight >= cap)).sum().double()])


def max_weight(rows: list[dict]) -> float:
    """The largest importance weight of the rows' response tokens (0 without any)."""
    return max((float(r["token_data"]["is_weight"].max()) for r in rows if "is_weight" in r["token_data"]
                and r["token_data"]["is_weight"].numel()), default=0.0)


def metrics(sums: list[float], is_max: float) -> dict:
    """The step's record entries from the global sums of :data:`STAT_KEYS`."""
    tokens, kl, k3, is_sum, clipped = sums
    n = max(tokens, 1.0)
    return {"rollout/kl": kl / n, "rollout/k3_kl": k3 / n, "rollout/is_mean": is_sum / n, "rollout/is_max": is_max,
            "rollout/is_clip_frac": clipped / n}
