"""Text-only model: a foundation decoder + chunked loss (the model contract).

``ModelOutput`` and ``LMHeadMixin`` are shared with ``OmniModel``. Generation (eval, RL rollouts)
is :class:`omniweave.generation.TorchRollout`, for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omniweave.models.components.loss import chunked_ce_sum, chunked_ce_tokens


@dataclass
class ModelOutput:
    loss_sum: torch.Tensor  # fp32 0-d: SUM of token losses of this micro-batch
    num_tokens: torch.Tensor  # int 0-d: how many tokens carried a label
    token_logp: torch.Tensor | None = None  # fp32 [L]: log-prob of each label (0 where -100), if asked


def _positions(batch: dict, length: int, device) -> torch.Tensor:
    pos = batch.get("position_ids")
    if pos is None:
        return torch.arange(length, device=device)[None]
    return pos[None] if pos.dim() == 1 else pos


def _cu_seqlens(batch: dict, length: int, device) -> torch.Tensor:
    cu = batch.get("cu_seqlens")
    return torch.tensor([0, length], dtype=torch.int32, device=device) if cu is None else cu.to(torch.int32)


class LMHeadMixin:
    """The model contract on top of ``hidden(batch) -> [L, D]``: chunked loss and logits.

    ``ce_sum`` / ``ce_tokens`` are the hooks through which ``parallel/`` swaps the loss for a
    vocab-parallel one (same signatures as :func:`chunked_ce_sum` / :func:`chunked_ce_tokens`);
    the model itself never sets them."""

    ce_sum = staticmethod(chunked_ce_sum)
    ce_tokens = staticmethod(chunked_ce_tokens)

    def forward(self, batch: dict, token_logprobs: bool = False, temperature: float = 1.0, head=None):
        """The loss sum (each token's loss times its ``token_data["loss_weight"]`` where the batch has
        one: turns with a fractional loss_weight); with ``token_logprobs`` also each label's log-prob under
        ``log_softmax(logits / temperature)`` (RL: the policy's log-probs of sampled tokens).

        ``head(model, hidden, batch)``: what the forward returns instead, from the final hidden
        states (after the final norm; a tp foundation's are sequence-sharded: read them through
        :meth:`token_logps` / :meth:`loss_sum`). A training objective applies the LM head and its
        loss this way (train/objective.py), inside the forward, so FSDP's and TP's hooks run."""
        h = self.hidden(batch)
        if head is not None:
            return head(self, h, batch)
        weight, labels = self.foundation.lm_head.weight, batch["labels"]
        if token_logprobs:
            losses = self.ce_tokens(h / temperature if temperature != 1.0 else h, weight, labels, self.loss_chunk)
            return ModelOutput(losses.sum(), (labels != -100).sum(), token_logp=-losses)
        token_weights = (batch.get("token_data") or {}).get("loss_weight")
        if token_weights is not None:  # fractional per-turn loss weights scale their tokens' losses
            return ModelOutput(self.loss_sum(h, labels, token_weights), (labels != -100).sum())
        loss_sum, n = self.ce_sum(h, weight, labels, self.loss_chunk)
        return ModelOutput(loss_sum, n)

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The cross-entropy sum of final hidden states ``h`` [L, D] against ``labels``, each token's
        loss times its ``weights`` entry where given (fractional per-turn loss weights); the one
        place the forward and a pipeline's last stage take their loss from."""
        head = self.foundation.lm_head.weight
        if weights is None:
            return self.ce_sum(h, head, labels, self.loss_chunk)[0]
        return (self.ce_tokens(h, head, labels, self.loss_chunk) * weights.to(torch.float32)).sum()

    def token_logps(self, h: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Each label's log-prob fp32 [L] under ``log_softmax(lm_head(h) / temperature)`` (0 where
        the label is -100), through the model's (possibly vocab-parallel) ``ce_tokens``."""
        h = h / temperature if temperature != 1.0 else h
        return -self.ce_tokens(h, self.foundation.lm_head.weight, labels, self.loss_chunk)

    def logits(self, batch: dict) -> torch.Tensor:
        """[L, V] (tests, ``omniweave hf verify``)."""
        return self.foundation.logits(self.hidden(batch))


class CausalLM(LMHeadMixin, nn.Module):
    """Wraps a foundation; ``model.foundation.layers`` are the blocks the trainer shards."""

    def __init__(self, foundation: nn.Module, loss_chunk: int = 1024):
        super().__init__()
        self.foundation = foundation
        self.loss_chunk = loss_chunk

    def hidden(self, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        return self.foundation(
            input_ids=ids,
            position_ids=_positions(batch, ids.shape[0], ids.device),
            cu_seqlens=_cu_seqlens(batch, ids.shape[0], ids.device),
            token_valid=batch.get("token_valid"),
        )
