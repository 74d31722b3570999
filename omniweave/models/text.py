"""Text-only model: a foundation decoder + chunked loss + greedy generation (the model contract).

``ModelOutput`` and :func:`greedy_generate` are shared with ``OmniModel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from omniweave.models.components.decoder import KVCache
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


@torch.no_grad()
def greedy_generate(
    foundation: nn.Module,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
) -> list[int]:
    """Greedy decoding of one prompt ([L, D] embeddings, [A, L] positions) with a KV cache.

    New tokens continue at ``max(position_ids) + 1`` on every axis (M-RoPE's rule for text after
    the prompt; equal to ``L`` for 1-D positions)."""
    eos = set(int(e) for e in eos_ids)
    cache = KVCache(len(foundation.layers))
    hidden = foundation(inputs_embeds=inputs_embeds, position_ids=position_ids, kv_cache=cache)
    next_pos = int(position_ids.max()) + 1
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(foundation.logits(hidden[-1:]).argmax(-1))
        out.append(tok)
        if tok in eos:
            break
        ids = torch.tensor([tok], device=inputs_embeds.device)
        pos = torch.full((position_ids.shape[0], 1), next_pos, dtype=position_ids.dtype, device=ids.device)
        hidden = foundation(input_ids=ids, position_ids=pos, kv_cache=cache)
        next_pos += 1
    return out


class LMHeadMixin:
    """The model contract on top of ``hidden(batch) -> [L, D]``: chunked loss and logits.

    ``ce_sum`` / ``ce_tokens`` are the hooks through which ``parallel/`` swaps the loss for a
    vocab-parallel one (same signatures as :func:`chunked_ce_sum` / :func:`chunked_ce_tokens`);
    the model itself never sets them."""

    ce_sum = staticmethod(chunked_ce_sum)
    ce_tokens = staticmethod(chunked_ce_tokens)

    def forward(self, batch: dict, token_logprobs: bool = False, temperature: float = 1.0) -> ModelOutput:
        """The loss sum; with ``token_logprobs`` also each label's log-prob under
        ``log_softmax(logits / temperature)`` (RL: the policy's log-probs of sampled tokens)."""
        h = self.hidden(batch)
        weight, labels = self.foundation.lm_head.weight, batch["labels"]
        if token_logprobs:
            losses = self.ce_tokens(h / temperature if temperature != 1.0 else h, weight, labels, self.loss_chunk)
            return ModelOutput(losses.sum(), (labels != -100).sum(), token_logp=-losses)
        loss_sum, n = self.ce_sum(h, weight, labels, self.loss_chunk)
        return ModelOutput(loss_sum, n)

    def logits(self, batch: dict) -> torch.Tensor:
        """[L, V] (tests / eval only)."""
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
        )

    def generate(self, batch_prompt: dict, max_new_tokens: int, eos_ids: Iterable[int] = ()) -> list[int]:
        ids = batch_prompt["input_ids"]
        pos = _positions(batch_prompt, ids.shape[0], ids.device)
        return greedy_generate(self.foundation, self.foundation.embed(ids), pos, max_new_tokens, eos_ids)
