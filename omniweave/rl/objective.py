"""GRPO as a training objective (train/objective.py): a sum over the response tokens.

Each update row carries per token (``token_data``, rl/batch.py) the sampling policy's log-prob
``old_logp``, the sample's ``advantages``, the aggregation ``weights`` (1, or 1 / the sequence's
length for ``seq-mean-token-mean``) and, with ``rl.kl_coef`` > 0, the reference's ``ref_logp``.
The loss of a row is Σ weight · GRPO token loss (rl/grpo.py) over its response tokens, so a
chunk's or a CP shard's is its own tokens' (``token_sum``): GRPO runs under every layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from omniweave.rl.batch import num_sequences
from omniweave.rl.grpo import grpo_token_loss
from omniweave.train.objective import Objective, Target


class GRPOObjective(Objective):
    name = "grpo"
    stat_keys = ("tokens", "clipped", "kl_sum")

    def __init__(self, grpo, temperature: float):
        """``grpo``: GRPOConfig; ``temperature``: the log-probs are of ``logits / temperature``, as
        the rollout sampled them."""
        self.grpo, self.temperature = grpo, temperature

    def count(self, packs: list[dict]) -> float:
        """The mini-batch's response tokens (``token-mean``) or sequences (the per-sequence modes)."""
        if self.grpo.loss_agg == "token-mean":
            return float(sum(r["num_loss_tokens"] for r in packs))
        return float(sum(num_sequences(r) for r in packs))

    def loss(self, model, h: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        td, mask = target.tokens, target.labels != -100
        logp = model.token_logps(h, target.labels, self.temperature)
        ref = td["ref_logp"][mask] if "ref_logp" in td else None
        per_token, stats = grpo_token_loss(logp[mask], td["old_logp"][mask], ref, td["advantages"][mask], self.grpo)
        zero = torch.zeros((), dtype=torch.float64, device=logp.device)
        extra = {"tokens": mask.sum().double(), "clipped": stats["clipped"].sum().double(),
                 "kl_sum": stats["kl"].sum().double() if "kl" in stats else zero}
        return (per_token * td["weights"][mask]).sum(), extra
