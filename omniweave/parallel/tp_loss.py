"""Vocab-parallel cross-entropy: the loss of a tensor-parallel LM head without ever holding
[L, V] logits, nor gathering them over the vocabulary.

Under tensor parallelism the LM head weight is sharded over the vocabulary: rank r holds rows
``[r·V/tp, (r+1)·V/tp)`` (``Shard(0)`` of ``[V, D]``) and the final hidden states are sequence
sharded (``Shard(0)`` of ``[L, D]``). Per chunk of ``c`` loss positions::

    hidden      [L, D]   all-gathered over tp (backward: reduce-scatter of the partial grads)
    logits      [c, V/tp] = hidden_chunk @ weight_local.T            (fp32, this rank's vocab)
    max         [c]       all_reduce(MAX) of the local row maxima     (no gradient)
    sum_exp     [c]       all_reduce(SUM) of Σ exp(logits - max)
    target      [c]       all_reduce(SUM) of the target's logit - max (0 on ranks not owning it)
    loss        [c]       log(sum_exp) - target

The backward is local (Megatron's vocab-parallel CE): d loss / d logits = softmax - one_hot on
the rank's own columns. The loss is the same on every tp rank (replicated), so every rank runs
the same backward with the same upstream gradient. Like :func:`chunked_ce_sum`, each chunk runs
under activation checkpointing so its logits are recomputed rather than kept; the recompute
repeats the chunk's all-reduces in the same order on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from omniweave.models.components.loss import sum_over_chunks, tokens_over_chunks


class _VocabParallelCE(torch.autograd.Function):
    """Per-row loss [c] of local logits [c, V/tp] (columns from ``vocab_start``) and targets [c]."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, group):
        row_max = logits.max(-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max[:, None]).exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        local = target - vocab_start
        owned = (local >= 0) & (local < logits.shape[1])
        local = local.clamp(0, logits.shape[1] - 1)
        target_logit = torch.where(owned, logits.gather(1, local[:, None])[:, 0] - row_max, 0.0)
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, owned)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, owned = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= owned.to(grad.dtype)
        return grad * grad_loss[:, None], None, None, None


def _chunk_losses(hidden, weight_local, labels, vocab_start: int, group) -> torch.Tensor:
    logits = (hidden @ weight_local.t()).float()  # [c, V/tp]
    return _VocabParallelCE.apply(logits, labels, vocab_start, group)


def _chunk_loss(hidden, weight_local, labels, vocab_start: int, group) -> torch.Tensor:
    return _chunk_losses(hidden, weight_local, labels, vocab_start, group).sum()


def _local_operands(hidden, lm_head_weight, mesh):
    """(full hidden [L, D] with a Partial gradient, local weight [V/tp, D], vocab start, group)."""
    if not isinstance(lm_head_weight, DTensor) or not lm_head_weight.placements[0].is_shard(0):
        raise ValueError("the vocab-parallel loss needs the LM head weight sharded over the vocabulary (Shard(0))")
    if not isinstance(hidden, DTensor):  # a plain tensor here is this rank's sequence shard
        raise ValueError("the vocab-parallel loss needs the final hidden states as a DTensor on the tp mesh")
    vocab, tp = lm_head_weight.shape[0], mesh.size()
    if vocab % tp:
        raise ValueError(f"vocab_size={vocab} is not divisible by tp={tp}")
    # every rank needs every position; each rank's gradient covers only its vocab shard (Partial)
    full = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])  # [L, D]
    return full, lm_head_weight.to_local(), mesh.get_local_rank() * (vocab // tp), mesh.get_group()


def vocab_parallel_ce_sum(
    hidden: DTensor, lm_head_weight: DTensor, labels: torch.Tensor, chunk: int = 1024, *, mesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum fp32 0-d, num_tokens int64 0-d), replicated on every rank of the 1-D ``mesh``:
    the same values as ``chunked_ce_sum`` of the unsharded hidden [L, D] and weight [V, D]."""
    full, weight, vocab_start, group = _local_operands(hidden, lm_head_weight, mesh)
    return sum_over_chunks(_chunk_loss, full, weight, labels, chunk, vocab_start, group)


def vocab_parallel_ce_tokens(hidden: DTensor, lm_head_weight: DTensor, labels: torch.Tensor, chunk: int = 1024, *,
                             mesh) -> torch.Tensor:
    """Per-token losses [L], replicated on every tp rank: ``chunked_ce_tokens`` of the unsharded row."""
    full, weight, vocab_start, group = _local_operands(hidden, lm_head_weight, mesh)
    return tokens_over_chunks(_chunk_losses, full, weight, labels, chunk, vocab_start, group)
