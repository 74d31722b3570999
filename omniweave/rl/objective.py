"""GRPO as a training objective (train/objective.py): a sum over the response tokens.

Each update row carries per token (``token_data``, rl/batch.py) the sampling policy's log-prob
``old_logp``, the sample's ``advantages``, the aggregation ``weights`` (1, or 1 / the sequence's
length for ``seq-mean-token-mean``) and, with ``rl.kl_coef`` > 0, the reference's ``ref_logp``.
The loss of a row is Σ weight · GRPO token loss (rl/grpo.py) over its response tokens, so a
chunk's or a CP shard's is its own tokens' (``token_sum``): GRPO runs under every layout.

GSPO (``rl.importance_sampling: sequence``; Zheng et al. 2025, TRL 1.16's GRPOTrainer with
``importance_sampling_level="sequence"``) clips one ratio per sequence, exp of the mean over its
tokens of log π − log π_old, so its loss is a function of per-sequence sums (``token_sum`` False):
[Σ (log π − log π_old), tokens, Σ KL k3, Σ advantage] per sequence (``seq_slot``, rl/batch.py),
summed over a CP group and across chunks before the loss: per sequence the clipped surrogate of
its ratio plus ``rl.kl_coef`` × its mean token KL, each sequence once (``seq-mean-token-mean``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from omniweave.rl.batch import num_sequences
from omniweave.rl.grpo import grpo_token_loss, kl_k3, policy_loss
from omniweave.train.objective import Objective, Target, slot_sums


class GRPOObjective(Objective):
    name = "grpo"
    stat_keys = ("tokens", "clipped", "kl_sum")

    def __init__(self, grpo, temperature: float, cp_group=None, cp: int = 1):
        """``grpo``: GRPOConfig; ``temperature``: the log-probs are of ``logits / temperature``, as
        the rollout sampled them; ``cp_group`` / ``cp``: the context-parallel group whose shards
        a sequence-level (GSPO) objective sums before its loss."""
        self.grpo, self.temperature, self.cp_group, self.cp = grpo, temperature, cp_group, cp
        self.token_sum = grpo.importance_sampling == "token"

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        if self.token_sum:
            return {}
        return {"num_seqs": torch.tensor([int(mb.get("num_seqs", 0))], device=mb["labels"].device)}

    def sums(self, model, h: Tensor, target: Target) -> Tensor:
        """[S, 4] per sequence of the row: Σ (log π − log π_old), tokens, Σ KL k3, Σ advantage."""
        td, mask = target.tokens, target.labels != -100
        logp = model.token_logps(h, target.labels, self.temperature)
        zero = torch.zeros_like(logp)
        kl = kl_k3(logp, td["ref_logp"]) if "ref_logp" in td else zero
        values = torch.stack([torch.where(mask, logp - td["old_logp"].float(), zero), mask.float(),
                              torch.where(mask, kl, zero), torch.where(mask, td["advantages"].float(), zero)], 1)
        return slot_sums(values, td["seq_slot"], int(target.row["num_seqs"][0]))

    def from_sums(self, sums: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        if self.cp > 1:  # each cp rank holds a share of every sequence's tokens
            from omniweave.train.dpo import sum_over_group

            sums = sum_over_group(sums, self.cp_group)
        tokens = sums[:, 1].detach()
        live = tokens > 0
        n = tokens.clamp(min=1)
        log_ratio, adv = sums[:, 0] / n, (sums[:, 3] / n).detach()
        g = self.grpo
        pg, stats = policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, g.clip_low, g.clip_high, g.dual_clip)
        loss = pg + g.kl_coef * sums[:, 2] / n
        loss = torch.where(live, loss, 0.0)
        extra = {"tokens": tokens.sum().double(), "clipped": (stats["clipped"] * tokens).sum().double(),
                 "kl_sum": sums[:, 2].detach().sum().double()}
        return loss.sum() / self.cp, {k: v / self.cp for k, v in extra.items()}

    def count(self, packs: list[dict]) -> float:
        """The mini-batch's response tokens (``token-mean``) or sequences (the per-sequence modes)."""
        if self.grpo.loss_agg == "token-mean" and self.token_sum:
            return float(sum(r["num_loss_tokens"] for r in packs))
        return float(sum(num_sequences(r) for r in packs))

    def loss(self, model, h: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        if not self.token_sum:  # GSPO: the row's sequences' sums, then their losses
            return self.from_sums(self.sums(model, h, target), target)
        td, mask = target.tokens, target.labels != -100
        logp = model.token_logps(h, target.labels, self.temperature)
        ref = td["ref_logp"][mask] if "ref_logp" in td else None
        per_token, stats = grpo_token_loss(logp[mask], td["old_logp"][mask], ref, td["advantages"][mask], self.grpo)
        zero = torch.zeros((), dtype=torch.float64, device=logp.device)
        extra = {"tokens": mask.sum().double(), "clipped": stats["clipped"].sum().double(),
                 "kl_sum": stats["kl"].sum().double() if "kl" in stats else zero}
        return (per_token * td["weights"][mask]).sum(), extra
