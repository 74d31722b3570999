"""GRPO math as pure functions on per-token tensors (fp32, no processes, no meshes).

The training loop flattens the response tokens of a micro-batch into 1-D tensors (``logp``,
``old_logp``, ``ref_logp``, ``advantages`` broadcast per token, ``seq_ids`` naming each token's
sequence), calls :func:`grpo_token_loss` and :func:`aggregate`, and sums the numerators and
denominators over every micro-batch and rank before dividing once. That is the SFT rule of
docs/design.md ("divide by the global count") and why every parallel layout gives the same loss.
GSPO's sequence-level ratio is :func:`gspo_token_loss`; RLOO's advantages :func:`rloo_advantages`.

Semantics follow verl (``core_algos.py``: ``compute_grpo_outcome_advantage``,
``compute_policy_loss_vanilla``, ``kl_penalty`` ``low_var_kl``, ``agg_loss``) and EasyR1, which
agree; TRL's GRPOTrainer computes the same loss without the dual clip (tests/test_grpo.py runs it).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from omniweave.errors import UserError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# exp(±20) ≈ 5e8 / 2e-9: beyond that the ratio is noise and exp would overflow (verl, EasyR1).
LOG_RATIO_LIMIT = 20.0
# k3 is clamped to ±10 so one token the reference finds impossible cannot dominate (verl).
KL_LIMIT = 10.0


class GRPOConfigError(UserError, ValueError):
    """A GRPO setting outside its valid range; the message names the key and the value."""


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Rewards as fp32 [N, G]; sample j of prompt i is at flat index i*G + j."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    r = rewards.detach().float()
    if r.dim() == 2:
        if r.shape[1] != group_size:
            raise ValueError(f"rewards have shape {tuple(r.shape)}, expected [N, {group_size}]")
    elif r.dim() != 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be [N*G] or [N, G] with G={group_size}; got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        # A NaN here would turn its whole group's advantages (and the loss) into NaN.
        raise ValueError("rewards contain NaN/inf: drop the groups of failed samples first")
    return r.reshape(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Per-sample advantage [N*G]: reward minus its group's mean, over the group's std if ``scale``.

    The std is the unbiased one (``torch.std``), as verl, EasyR1 and TRL ``scale_rewards="group"``
    use; ``scale=False`` is Dr.GRPO (no std: easy/hard prompts are not up-weighted). A group of
    size 1 has no baseline to compare against, so its advantage is 0 (verl instead divides by a
    std of 1, which trains on the raw reward).
    """
    r = _grouped(rewards, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Per-sample REINFORCE leave-one-out advantage [N*G] (Ahmadian et al. 2024): the reward minus
    the mean of the *other* samples of its group, r_i − (Σ_j r_j − r_i) / (G − 1); TRL 1.16's
    ``RLOOTrainer`` (``normalize_advantages=False``, its default). It equals G / (G − 1) times the
    group-centred reward, so no std is involved; a group of size 1 has no baseline (0)."""
    r = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).reshape(-1)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - baseline).reshape(-1)


ADVANTAGES = ("grpo", "rloo")


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """BoolTensor [N]: groups whose rewards are all equal, so every advantage is 0 (no signal).

    Exact equality: rewards computed by the same function on equally good answers are bitwise
    equal, and a near-equal group already gets advantages of about |Δr|/eps, not 0-by-accident.
    """
    r = _grouped(rewards, group_size)
    return r.max(dim=1).values == r.min(dim=1).values


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        # Broadcasting [N] advantages against [T] tokens would silently compute nonsense.
        raise ValueError(f"per-token tensors must have one shape, got {shapes}")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate per token (verl ``compute_policy_loss_vanilla``), fp32.

    ratio = exp(clamp(logp - old_logp, ±20)); loss = max(-A·ratio, -A·clip(ratio, 1-clip_low,
    1+clip_high)). For tokens with A < 0 (and only those) the dual clip caps the loss at -A·c,
    so a token whose ratio exploded cannot push the policy arbitrarily hard; A ≥ 0 tokens are
    untouched, exactly as verl's ``torch.where(advantages < 0, ...)``. ``old_logp`` and
    ``advantages`` are constants (detached); the gradient flows through ``logp``.

    ``stats`` holds detached per-token fp32 tensors (sum them and divide by the token count, e.g.
    with :func:`aggregate`, to get the logged fractions):

    - ``ratio``: the importance ratio.
    - ``clipped``: the trust-region clip is active, i.e. the clipped term won the max (A>0 and
      ratio > 1+clip_high, or A<0 and ratio < 1-clip_low). Its mean is verl's ``pg_clipfrac``
      (``gt(pg_losses2, pg_losses1)``) and EasyR1's ``pg_clipfrac_higher``, which despite the
      name counts both sides; TRL's ``clip_ratio/region_mean``.
    - ``clipped_low`` / ``clipped_high``: the two sides of ``clipped``; means are TRL's
      ``clip_ratio/low_mean`` / ``clip_ratio/high_mean``.
    - ``dual_clipped``: A<0 and the dual clip capped the loss. Its mean is verl's and EasyR1's
      ``pg_clipfrac_lower`` (that name is the dual clip, not the low side of the trust region).
    - ``ppo_kl``: old_logp - logp (log ratio clamped as above); its mean is verl's ``ppo_kl``,
      the k1 estimate of KL(old ‖ new) on the sampled tokens.
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages)
    if not 0.0 < clip_low < 1.0 or clip_high <= 0.0:
        raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    adv = advantages.detach().float()
    log_ratio = (logp.float() - old_logp.detach().float()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    negative = adv < 0
    if dual_clip is not None:
        loss_cap = -adv * dual_clip
        dual_clipped = negative & (loss > loss_cap)
        loss = torch.where(negative, torch.minimum(loss, loss_cap), loss)
    else:
        dual_clipped = torch.zeros_like(negative)
    ratio_d = ratio.detach()
    clipped_low = negative & (ratio_d < 1.0 - clip_low)
    clipped_high = (adv > 0) & (ratio_d > 1.0 + clip_high)
    stats = {
        "ratio": ratio_d,
        "clipped": (clipped_low | clipped_high).float(),
        "clipped_low": clipped_low.float(),
        "clipped_high": clipped_high.float(),
        "dual_clipped": dual_clipped.float(),
        "ppo_kl": -log_ratio.detach(),
    }
    return loss, stats


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref): e^(ref-logp) - (ref-logp) - 1, in [-10, 10].

    Schulman's low-variance, always non-negative estimator (verl/EasyR1 ``low_var_kl``, TRL's
    ``per_token_kl``); the difference is clamped to ±20 before exp and the result to ±10, as verl.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    diff = (ref_logp.detach().float() - logp.float()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (diff.exp() - diff - 1.0).clamp(-KL_LIMIT, KL_LIMIT)


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k1 estimate logp - ref_logp: unbiased but noisy (can be negative); for logging."""
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    return logp.float() - ref_logp.detach().float()


def aggregate(per_token_loss: Tensor, seq_ids: Tensor, mode: str) -> tuple[Tensor, float]:
    """(numerator, denominator) of the loss of one micro-batch; the caller divides their sums.

    - ``token-mean``: Σ loss over tokens / number of tokens (DAPO; verl's and our default).
    - ``seq-mean-token-mean``: Σ over sequences of the sequence's mean loss / number of
      sequences (the original GRPO; a long response's tokens each weigh less).
    - ``seq-mean-token-sum``: Σ over sequences of the sequence's summed loss / number of sequences.

    ``seq_ids`` [T] says which sequence each token belongs to (any ids, any order). A sequence
    must lie wholly in one call, otherwise it is counted once per call. Zero tokens give a
    numerator of 0 that is still connected to the graph (every rank can call backward).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; modes: {', '.join(LOSS_AGG_MODES)}")
    loss = per_token_loss.float()
    if loss.dim() != 1 or seq_ids.shape != loss.shape:
        raise ValueError(
            f"per_token_loss and seq_ids must both be 1-D of one length, got "
            f"{tuple(loss.shape)} and {tuple(seq_ids.shape)}"
        )
    if mode == "token-mean":
        return loss.sum(), float(loss.numel())
    unique_ids, seq_index = torch.unique(seq_ids, return_inverse=True)
    num_seqs = unique_ids.numel()
    seq_sum = loss.new_zeros(num_seqs).index_add(0, seq_index, loss)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum(), float(num_seqs)
    seq_len = torch.bincount(seq_index, minlength=num_seqs).to(loss.dtype)
    return (seq_sum / seq_len).sum(), float(num_seqs)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy (nats) of the softmax of each row of ``logits`` [..., V] -> [...], fp32.

    H = logsumexp(z) - Σ softmax(z)·z, which never takes the log of an underflowed probability,
    on z shifted by its row max (H is shift-invariant; unshifted, logits near 1000 lose 4 digits
    of H to cancellation in fp32). -inf logits (masked vocabulary) contribute 0. Rows are
    independent, so the caller may run it on chunks of tokens to bound the [T, V] temporaries.
    """
    z = logits.float()
    row_max = z.detach().amax(dim=-1, keepdim=True)
    z = z - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.softmax(z, dim=-1)
    z_finite = torch.where(torch.isneginf(z), torch.zeros_like(z), z)
    return torch.logsumexp(z, dim=-1) - (probs * z_finite).sum(dim=-1)


@dataclasses.dataclass
class GRPOConfig:
    """GRPO loss settings (recipe section ``rl``); defaults: DAPO clip-higher, dual clip, no KL."""

    scale_rewards: bool = True  # divide advantages by the group std (False: Dr.GRPO)
    clip_low: float = 0.2  # ratio floor 1 - clip_low for A < 0
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high for A > 0 (DAPO clip-higher)
    dual_clip: float | None = 3.0  # cap -A·c on A < 0 tokens; None disables
    kl_coef: float = 0.0  # weight of k3 KL to the reference model in the loss; 0: no reference
    loss_agg: str = "token-mean"  # one of LOSS_AGG_MODES
    filter_zero_std: bool = True  # drop groups whose rewards are all equal (no signal)
    advantage: str = "grpo"  # one of ADVANTAGES: group-normalised (GRPO) or leave-one-out (RLOO)
    importance_sampling: str = "token"  # "sequence": GSPO's sequence-level ratio (gspo_token_loss)

    def validate(self) -> GRPOConfig:
        """Raise GRPOConfigError naming every bad value; return self for chaining."""
        problems = []
        for key in ("scale_rewards", "filter_zero_std"):
            if not isinstance(getattr(self, key), bool):
                problems.append(f"rl.{key} must be true or false, got {getattr(self, key)!r}")

        def number(key: str) -> float | None:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"rl.{key} must be a finite number, got {value!r}")
                return None
            return float(value)

        clip_low, clip_high, kl_coef = number("clip_low"), number("clip_high"), number("kl_coef")
        if clip_low is not None and not 0.0 < clip_low < 1.0:
            problems.append(f"rl.clip_low must be in (0, 1), got {clip_low}")
        if clip_high is not None and clip_high <= 0.0:
            problems.append(f"rl.clip_high must be > 0, got {clip_high}")
        if self.dual_clip is not None and (dual := number("dual_clip")) is not None and dual <= 1.0:
            problems.append(f"rl.dual_clip must be > 1 (or null to disable), got {dual}")
        if kl_coef is not None and kl_coef < 0.0:
            problems.append(f"rl.kl_coef must be >= 0, got {kl_coef}")
        if self.importance_sampling not in ("token", "sequence"):
            problems.append(f"rl.importance_sampling must be token or sequence; got {self.importance_sampling!r}")
        elif self.importance_sampling == "sequence" and self.loss_agg != "seq-mean-token-mean":
            problems.append("rl.importance_sampling=sequence (GSPO) weighs each sequence once: set "
                            f"rl.loss_agg=seq-mean-token-mean (got {self.loss_agg})")
        if self.advantage not in ADVANTAGES:
            problems.append(f"rl.advantage must be one of {', '.join(ADVANTAGES)}; got {self.advantage!r}")
        if self.loss_agg not in LOSS_AGG_MODES:
            problems.append(f"rl.loss_agg must be one of {', '.join(LOSS_AGG_MODES)}; got {self.loss_agg!r}")
        if problems:
            raise GRPOConfigError("; ".join(problems))
        return self


def grpo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    cfg: GRPOConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GRPO loss: :func:`policy_loss` + ``cfg.kl_coef`` · :func:`kl_k3`.

    ``stats`` is :func:`policy_loss`'s plus ``pg_loss`` (the policy term alone) and, whenever
    ``ref_logp`` is given (even with kl_coef 0, for logging), ``kl`` (k3 per token). kl_coef > 0
    without ``ref_logp`` is an error: silently training without the KL term would hide a bug.
    """
    cfg.validate()
    loss, stats = policy_loss(logp, old_logp, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    return _with_kl(loss, stats, logp, ref_logp, cfg)


def _with_kl(loss: Tensor, stats: dict[str, Tensor], logp: Tensor, ref_logp: Tensor | None,
             cfg: GRPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy term ``loss`` plus ``cfg.kl_coef`` · k3 per token; ``pg_loss`` / ``kl`` stats."""
    stats["pg_loss"] = loss.detach()
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp)
        stats["kl"] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise ValueError(f"rl.kl_coef is {cfg.kl_coef} but no ref_logp was given")
    return loss, stats


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, seq_ids: Tensor) -> Tensor:
    """Per token [T], fp32: the mean of logp − old_logp over the tokens of its sequence, log s_i of
    GSPO (Zheng et al. 2025), on flat tokens where ``seq_ids`` names each token's sequence (any ids,
    any order, as :func:`aggregate`: a packed row's sequences work). ``old_logp`` is a constant; the
    gradient reaches every token of the sequence through the mean, as in TRL 1.16 (no stop-gradient).
    A sequence must lie wholly in one call: a CP shard or a chunk must sum Σ(logp − old_logp) and
    the token count with the others first."""
    _check_same_shape(logp=logp, old_logp=old_logp, seq_ids=seq_ids)
    diff = logp.float() - old_logp.detach().float()
    _, index = torch.unique(seq_ids, return_inverse=True)
    num_seqs = int(index.max()) + 1 if index.numel() else 0
    sums = diff.new_zeros(num_seqs).index_add(0, index, diff)
    counts = torch.bincount(index, minlength=num_seqs).to(diff.dtype)
    return (sums / counts)[index]


def gspo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    seq_ids: Tensor,
    cfg: GRPOConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO loss [T] (Zheng et al. 2025): the clipped surrogate of the sequence ratio
    s_i = exp(:func:`sequence_log_ratio`), the same value on each of the sequence's tokens, plus
    ``cfg.kl_coef`` · k3 per token:

        loss_t = max(−A_t · s_i, −A_t · clip(s_i, 1 − clip_low, 1 + clip_high)) + kl_coef · k3_t

    (and the dual clip unless ``cfg.dual_clip`` is None; TRL has none). Through :func:`aggregate`
    with ``seq-mean-token-mean`` it is TRL 1.16's ``GRPOTrainer._compute_loss`` with
    ``importance_sampling_level="sequence"``, ``loss_type="grpo"`` (the GSPO paper's; value and
    gradient, ``epsilon`` / ``epsilon_high`` = clip_low / clip_high), with ``token-mean`` its
    ``bnpo``. ``stats`` as :func:`grpo_token_loss`'s, ``ratio`` / ``clipped*`` the sequence's."""
    cfg.validate()
    log_ratio = sequence_log_ratio(logp, old_logp, seq_ids)
    loss, stats = policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, cfg.clip_low, cfg.clip_high,
                              cfg.dual_clip)
    return _with_kl(loss, stats, logp, ref_logp, cfg)
