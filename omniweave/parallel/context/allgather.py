"""All-gather context-parallel attention (Llama-3 style): gather K/V, attend the local queries.

    k, v [L, Hkv, D] on each of n ranks  --all_gather-->  [n·L, Hkv, D] (rank after rank)
    key rows: for each document, each local query chunk j ∈ {r, 2n-1-r} gets the padded keys
              [0, (j+1)·c_d) it can see (with a window of W: only from chunk ⌊(j·c_d - W + 1)/c_d⌋)
    one varlen kernel call: query segments = the local chunks as they lie, key segment = that prefix,
              causal bottom-right aligned (the chunk's queries are the prefix's last c_d positions)

The gather is differentiable: its backward reduce-scatters (sums) the gathered gradient — on NCCL
``reduce_scatter_tensor``, elsewhere ``all_reduce`` and this rank's slice. With ``head_groups = g``
K/V are gathered and attended ``Hkv/g`` KV heads (and their query heads) at a time, which bounds
the transient gathered K/V to 1/g; what the kernel saves for backward (its gathered key prefixes)
still adds up over the groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omniweave.models.components.attention import attn
from omniweave.parallel.context.zigzag import chunk_lengths, chunk_rows, no_memo, zigzag_chunks


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """[n, *x.shape]: every rank's x in rank order."""
    n = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":
        gathered = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        return gathered.view(n, *x.shape)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


def _reduce_scatter(grad: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks of grad [n, *shape], slot of this rank."""
    if dist.get_backend(group) == "nccl":
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(mine, grad.contiguous().flatten(0, 1), group=group)
        return mine
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)
    return grad[dist.get_rank(group)]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


def gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """[n, *x.shape]: every rank's x (same shape everywhere) in rank order; differentiable, the
    backward reduce-scatters (sums over ranks) the gradient of each rank's slot back to it."""
    return _AllGather.apply(x, group)


def _first_visible_chunk(j: int, c: int, window: int | None) -> int:
    """First chunk holding a key that some query of chunk ``j`` sees (``c`` rows per chunk)."""
    return 0 if window is None or c == 0 else max(0, (j * c - window + 1) // c)


def _plan(cu_seqlens, rows: int, n: int, me: int, window: int | None, device):
    """(key rows into the gathered K/V, cu_q, cu_k) of the one kernel call (module docstring)."""
    chunk_lens = chunk_lengths(cu_seqlens, 2, rows)
    doc_chunks, seg_q, seg_k = [], [0], [0]
    for c in chunk_lens:
        spans = [range(_first_visible_chunk(j, c, window), j + 1) for j in zigzag_chunks(n, me)]
        doc_chunks.append([b for span in spans for b in span])
        if c == 0:
            continue  # an empty document adds no segment
        for span in spans:
            seg_q.append(seg_q[-1] + c)
            seg_k.append(seg_k[-1] + len(span) * c)
    key_rows = chunk_rows(chunk_lens, rows, list(range(n)), n, doc_chunks, device)
    cu_q, cu_k = (torch.tensor(s, dtype=torch.int32, device=device) for s in (seg_q, seg_k))
    return key_rows, cu_q, cu_k


def allgather_attention(q, k, v, cu_seqlens, group, window: int | None, scale: float, backend: str,
                        head_groups: int = 1, memo=no_memo) -> torch.Tensor:
    """Causal attention of this rank's zigzag rows over the gathered keys; differentiable.
    ``memo(key, build)`` may reuse the index plan across layers (``CPContext.memo``)."""
    n, me, rows = dist.get_world_size(group), dist.get_rank(group), q.shape[0]
    heads, kv_heads = q.shape[1], k.shape[1]
    if head_groups < 1 or kv_heads % head_groups:
        raise ValueError(f"head_groups={head_groups} must divide the {kv_heads} key/value heads")
    key_rows, cu_q, cu_k = memo(("allgather", window), lambda: _plan(cu_seqlens, rows, n, me, window, q.device))
    kv_per, q_per = kv_heads // head_groups, heads // head_groups
    outs = []
    for g in range(head_groups):
        kv = torch.stack([k[:, g * kv_per:(g + 1) * kv_per], v[:, g * kv_per:(g + 1) * kv_per]])
        kv_all = gather_stacked(kv, group).transpose(0, 1).flatten(1, 2)  # [2, n·L, kv_per, D]
        out, _ = attn(q[:, g * q_per:(g + 1) * q_per], kv_all[0][key_rows], kv_all[1][key_rows], cu_q, cu_k,
                      True, window, backend=backend, scale=scale, need_lse=False)
        outs.append(out)
    return torch.cat(outs, dim=1)
