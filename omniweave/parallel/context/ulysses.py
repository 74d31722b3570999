"""Ulysses (all-to-all) context-parallel attention, and the hybrid of Ulysses inside a ring.

Ulysses over a group of ``n`` ranks trades the sequence shard for a head shard::

    q [L, H, D] (zigzag rows of this rank)  --all_to_all-->  [n·L, H/n, D] (every rank's rows, rank
    after rank, heads [j·H/n, (j+1)·H/n) on rank j)  --reorder-->  full padded documents in natural
    order  --local varlen kernel (causal, window ok)-->  --reorder back, all_to_all back-->  [L, H, D]

The all-to-all is its own adjoint, so its backward is the reverse all-to-all. q, k and v travel in
one message.

GQA: rank ``j`` needs the key/value heads of its query heads. When ``Hkv % n == 0`` the K/V heads
are split like the query heads; otherwise they are first replicated (``repeat_interleave`` by the
smallest factor ``f`` with ``Hkv·f`` divisible by ``n`` and dividing ``H``, at most ``H/Hkv``), so
each rank's slice of the replicated heads is exactly the K/V of its query heads; autograd sums
the replicas' gradients back.

Hybrid (``cp = u·m``): Ulysses inside each group of ``u`` consecutive CP ranks turns the group's
``2u`` chunks of every document into one block of ``H/u`` heads; ring attention (ring.py) then runs
across the ``m`` groups over those chunk sets, and Ulysses turns the result back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omniweave.models.components.attention import attn
from omniweave.parallel.context.kernels import BlockKernel
from omniweave.parallel.context.ring import ring_attention
from omniweave.parallel.context.zigzag import chunk_lengths, chunk_rows, no_memo, zigzag_chunks


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [n, ...]: slot j goes to rank j; the result's slot j came from rank j."""
    x = x.contiguous()
    received = torch.empty_like(x)  # after contiguous(): empty_like keeps a view's strides
    dist.all_to_all_single(received, x, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def seq_to_heads(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Each ``[L, h, D]`` (sequence-sharded) -> ``[n·L, h/n, D]``: head slice ``me`` of every rank's
    rows, rank after rank. All tensors share one all-to-all."""
    n, rows, dim = dist.get_world_size(group), tensors[0].shape[0], tensors[0].shape[-1]
    heads = [t.shape[1] // n for t in tensors]
    packed = torch.cat([t.reshape(rows, n, h, dim) for t, h in zip(tensors, heads)], dim=2)
    received = _AllToAll.apply(packed.transpose(0, 1), group)  # [n, L, Σh/n, D]
    return [x.reshape(n * rows, h, dim) for x, h in zip(received.split(heads, dim=2), heads)]


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[n·L, h/n, D]`` -> ``[L, h, D]``: the inverse of :func:`seq_to_heads`."""
    n = dist.get_world_size(group)
    rows, heads, dim = x.shape[0] // n, x.shape[1], x.shape[2]
    received = _AllToAll.apply(x.reshape(n, rows, heads, dim), group)  # slot j: my rows, head slice j
    return received.transpose(0, 1).reshape(rows, n * heads, dim)


def kv_replication(num_heads: int, num_kv_heads: int, n: int) -> int:
    """Smallest factor ``f`` such that ``num_kv_heads·f`` is divisible by ``n`` and divides
    ``num_heads`` (``f = num_heads/num_kv_heads`` always is once ``num_heads % n == 0``)."""
    if num_heads % n:
        raise ValueError(f"Ulysses splits the {num_heads} attention heads over {n} ranks: "
                         f"H={num_heads} is not divisible by cp={n}")
    return next(f for f in range(1, num_heads // num_kv_heads + 1)
                if (num_kv_heads * f) % n == 0 and num_heads % (num_kv_heads * f) == 0)


def _split_heads(q, k, v, group):
    """q, k, v sequence-sharded -> head-sharded (replicating K/V heads when needed)."""
    f = kv_replication(q.shape[1], k.shape[1], dist.get_world_size(group))
    if f > 1:
        k, v = k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)
    return seq_to_heads([q, k, v], group)


def _natural_order(cu_seqlens, rows: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of the gathered zigzag chunks in each document's natural order, its inverse)."""
    chunk_lens = chunk_lengths(cu_seqlens, 2, rows)
    natural = chunk_rows(chunk_lens, rows, list(range(n)), n, [list(range(2 * n))] * len(chunk_lens), device)
    return natural, torch.argsort(natural)


def ulysses_attention(q, k, v, cu_seqlens, group, window: int | None, scale: float, backend: str,
                      memo=no_memo) -> torch.Tensor:
    """Causal attention of zigzag-sharded rows via one all-to-all each way (see module docstring);
    ``memo(key, build)`` may reuse the reordering across layers (``CPContext.memo``)."""
    n, rows = dist.get_world_size(group), q.shape[0]
    natural, back = memo("ulysses", lambda: _natural_order(cu_seqlens, rows, n, q.device))
    qh, kh, vh = _split_heads(q, k, v, group)
    cu_full = cu_seqlens * n  # every document whole: 2n chunks
    out, _ = attn(qh[natural], kh[natural], vh[natural], cu_full, cu_full, True, window,
                  backend=backend, scale=scale, need_lse=False)
    return heads_to_seq(out[back], group)


def hybrid_attention(q, k, v, cu_seqlens, cp_group, ulysses_group, ring_group, scale: float,
                     kernel: BlockKernel, memo=no_memo) -> torch.Tensor:
    """Ulysses inside groups of ``u`` consecutive CP ranks, ring attention across the groups."""
    cp, me = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    u, m = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    if u * m != cp or dist.get_rank(ulysses_group) != me % u or dist.get_rank(ring_group) != me // u:
        raise ValueError(
            f"hybrid groups do not tile the CP group: CP rank {me} of {cp} is rank "
            f"{dist.get_rank(ulysses_group)} of {u} in its Ulysses group and {dist.get_rank(ring_group)} of {m} "
            f"in its ring group; expected Ulysses groups of {u} consecutive CP ranks and rings of equal inner index"
        )
    rows = q.shape[0]
    chunks_by_group = [tuple(sorted(c for r in range(g * u, (g + 1) * u) for c in zigzag_chunks(cp, r)))
                       for g in range(m)]

    def build() -> tuple[torch.Tensor, torch.Tensor]:  # the group's rows ordered by chunk id, and back
        chunk_lens = chunk_lengths(cu_seqlens, 2, rows)
        members = list(range((me // u) * u, (me // u + 1) * u))
        order = chunk_rows(chunk_lens, rows, members, cp, [list(chunks_by_group[me // u])] * len(chunk_lens), q.device)
        return order, torch.argsort(order)

    order, back = memo("hybrid", build)
    qh, kh, vh = _split_heads(q, k, v, ulysses_group)  # [u·L, H/u, D]
    out = ring_attention(qh[order], kh[order], vh[order], cu_seqlens * u, ring_group, chunks_by_group, scale, kernel,
                         memo)
    return heads_to_seq(out[back], ulysses_group)
