"""Chunked cross-entropy: the sum of token losses without ever holding [L, V] logits.

Only positions with a label (``!= -100``) are projected. Each chunk of ``chunk`` positions is
projected, reduced to a loss sum and dropped; the chunk runs under activation checkpointing, so
the backward recomputes its logits instead of keeping them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # [c, V]
    return F.cross_entropy(logits, labels, reduction="sum")


def chunked_ce_sum(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum fp32 0-d, num_tokens int64 0-d) of hidden [L, D] against labels [L] (already
    shifted, -100 = no loss); logits computed ``chunk`` rows at a time."""
    return sum_over_chunks(_chunk_loss, hidden, lm_head_weight, labels, chunk)


def _chunk_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="none")


def chunked_ce_tokens(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                      chunk: int = 1024) -> torch.Tensor:
    """Per-token losses fp32 [L] of hidden [L, D] against labels [L] (0 where the label is -100):
    what RL needs (log-probs of given tokens); same chunking and checkpointing as the sum."""
    return tokens_over_chunks(_chunk_token_losses, hidden, lm_head_weight, labels, chunk)


def tokens_over_chunks(chunk_losses, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                       *extra) -> torch.Tensor:
    """``chunk_losses(h [c, D], weight, y [c], *extra) -> [c]`` over the labelled rows, scattered
    back to [L] (0 elsewhere); each chunk under activation checkpointing."""
    keep = labels != IGNORE_INDEX
    out = hidden.new_zeros(labels.shape[0], dtype=torch.float32)
    h, y = hidden[keep], labels[keep]
    if h.shape[0] == 0:  # keep the graph connected so every rank runs the same backward
        return out + 0.0 * hidden.sum() + 0.0 * weight.sum()
    parts = []
    for s in range(0, h.shape[0], chunk):
        hc, yc = h[s : s + chunk], y[s : s + chunk]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            parts.append(checkpoint(chunk_losses, hc, weight, yc, *extra, use_reentrant=False))
        else:
            parts.append(chunk_losses(hc, weight, yc, *extra))
    return out.index_put((keep.nonzero()[:, 0],), torch.cat(parts))


def sum_over_chunks(chunk_loss, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                    *extra) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_loss(h [c, D], weight, y [c], *extra) -> loss sum`` over the labelled rows, ``chunk``
    rows at a time, each chunk under activation checkpointing; returns (loss_sum, num_tokens)."""
    keep = labels != IGNORE_INDEX
    num_tokens = keep.sum()
    h, y = hidden[keep], labels[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    if h.shape[0] == 0:  # keep the graph connected so every rank runs the same backward
        return total + 0.0 * hidden.sum() + 0.0 * weight.sum(), num_tokens
    for s in range(0, h.shape[0], chunk):
        hc, yc = h[s : s + chunk], y[s : s + chunk]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            total = total + checkpoint(chunk_loss, hc, weight, yc, *extra, use_reentrant=False)
        else:
            total = total + chunk_loss(hc, weight, yc, *extra)
    return total, num_tokens
