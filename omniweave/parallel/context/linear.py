"""Context parallelism for linear-attention layers (Gated DeltaNet, Qwen3.5 / Qwen3-Next) by passing
states down the CP ranks: no all-to-all of the sequence, whatever ``parallel.cp_attention`` the
full-attention layers use.

The zigzag layout (sharding.py) cuts each document into 2·cp chunks of c rows and gives rank r
chunks r and 2cp−1−r, so every rank holds two *pieces* of every document, and a piece needs what
the chunks before it in its document left: the convolution's last K−1 inputs and the recurrent
state. Both are cheap to pass because both are exact functions of small per-piece summaries:

1. the convolution window before chunk g is the last K−1 rows of the pre-convolution inputs of
   chunks < g: each rank sends each piece's last K−1 rows (all-gather), every rank chains them
   in the document's chunk order (a piece shorter than K−1 rows passes the window on);
2. the recurrent state is affine in the state a piece starts from: ``S_out = M·S_in + S_x``, with
   ``S_x`` the piece's final state from zero and ``M`` [dk, dk] per value head the product of its
   tokens' transitions ``α_t (I − β_t k_t k_tᵀ)`` — which is the final state of the same rule run
   with values 0 from the state ``I``. So one kernel call over the pieces with the values widened
   by dk zero columns, from ``[0 | I]``, gives ``[S_x | M]``; one all-gather of those (fp32) and
   every rank chains ``S ← M_g·S + S_x,g`` over chunks g = 0 … 2cp−1 of each document;
3. the pieces run once more from their true windows and states: the outputs.

The gathers are differentiable (their backward sums each slot's gradient back to its rank), and
everything else is ordinary autograd, so the gradients are exact as well. Per layer each rank
sends ``2·D·(K−1)·conv_dim`` inputs and ``2·D·HV·dk·(dk + dv)`` fp32 state numbers for a row of D
documents (4 MiB per piece at Qwen3.5's sizes: HV 32, dk = dv = 128), independent of length; the
kernel runs twice over the rank's rows (the summary pass, then the outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from omniweave.parallel.context.allgather import gather_stacked


def _plan(cu_seqlens: torch.Tensor, cp: int, rank: int, W: int):
    """(piece boundaries int32 [2D+1], tail row index [2D, W], tail valid [2D, W], rows per chunk
    c [D], the (rank, piece) of each chunk g of a document, this rank's chunk of each piece)."""
    c = ((cu_seqlens[1:] - cu_seqlens[:-1]) // 2).to(torch.long)  # local document = 2 pieces of c rows
    pieces = torch.stack([c, c], 1).reshape(-1)
    cu_p = torch.cat([pieces.new_zeros(1), pieces.cumsum(0)]).to(torch.int32)
    ends = cu_p[1:].to(torch.long)
    offs = torch.arange(W, device=c.device) - W
    idx = ends[:, None] + offs  # the last W rows of each piece
    valid = idx >= cu_p[:-1].to(torch.long)[:, None]
    where = [(g, 0) if g < cp else (2 * cp - 1 - g, 1) for g in range(2 * cp)]
    mine = (rank, 2 * cp - 1 - rank)
    return cu_p, idx.clamp(min=0), valid, c, where, mine


def _chain_windows(tails: torch.Tensor, c: torch.Tensor, W: int) -> list[torch.Tensor]:
    """``tails`` [2cp, D, W, C] (chunk order; a chunk shorter than W rows right-aligned) -> the
    window before each chunk [D, W, C]: the last W inputs of the document's earlier chunks."""
    win = tails.new_zeros(tails.shape[1:])
    t = c.clamp(max=W)[:, None]  # valid rows of a chunk's tail
    s = torch.arange(W, device=c.device)[None] + t  # position in [window | tail's valid rows]
    idx = (s + (s >= W) * (W - t))[..., None].expand(-1, -1, tails.shape[-1])
    before = []
    for tail in tails:
        before.append(win)
        win = torch.gather(torch.cat([win, tail], 1), 1, idx)
    return before


def _chain_states(summary: torch.Tensor, dv: int) -> list[torch.Tensor]:
    """``summary`` [2cp, D, HV, dk, dv + dk] ([S_x | M] per chunk, chunk order) -> the state
    before each chunk [D, HV, dk, dv]."""
    S = summary.new_zeros(*summary.shape[1:-1], dv)
    before = []
    for s in summary:
        before.append(S)
        S = s[..., dv:] @ S + s[..., :dv]
    return before


def _in_chunk_order(x: torch.Tensor, where) -> torch.Tensor:
    """[cp, 2D, …] gathered per rank -> [2cp, D, …] per chunk of each document."""
    per_rank = x.reshape(x.shape[0], -1, 2, *x.shape[2:])  # [cp, D, 2, …]
    return torch.stack([per_rank[r, :, j] for r, j in where])


@dataclass
class LinearCP:
    """A Gated DeltaNet layer's ``cp_fn`` (components/linear_attention.py): ``ctx`` is the run's
    CPContext (its group, and its per-micro-batch memo of index plans)."""

    ctx: object

    def __call__(self, module, pre: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        W = module.cfg.conv_kernel - 1
        cu_p, idx, valid, c, where, mine = self.ctx.memo(cu_seqlens, ("linear", W), lambda: _plan(cu_seqlens, cp, rank, W))

        def own(before: list[torch.Tensor]) -> torch.Tensor:  # this rank's two pieces of each document
            return torch.stack([before[mine[0]], before[mine[1]]], 1).flatten(0, 1)

        windows = None
        if W:
            tails = pre[idx] * valid[..., None].to(pre.dtype)  # [2D, W, C], right-aligned
            tails = _in_chunk_order(gather_stacked(tails, group), where)
            windows = own(_chain_windows(tails, c, W))
        q, k, v, _ = module.conv(pre, cu_p, windows)
        L, hv, dv = v.shape
        dk = k.shape[-1]
        eye = torch.eye(dk, dtype=torch.promote_types(v.dtype, torch.float32), device=v.device)
        start = torch.cat([eye.new_zeros(dk, dv), eye], 1).expand(len(cu_p) - 1, hv, dk, dv + dk)
        _, summary = module.rule(q, k, torch.cat([v, v.new_zeros(L, hv, dk)], -1), g, beta, cu_p, start)
        summary = _in_chunk_order(gather_stacked(summary.contiguous(), group), where)
        o, _ = module.rule(q, k, v, g, beta, cu_p, own(_chain_states(summary, dv)))
        return o


def apply_linear_cp(layers, ctx) -> None:
    """Every linear-attention layer of ``layers`` runs context-parallel over ``ctx``'s group."""
    for layer in layers:
        if layer.linear:
            layer.linear_attn.cp_fn = LinearCP(ctx)


__all__ = ["LinearCP", "apply_linear_cp"]
