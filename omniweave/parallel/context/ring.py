"""Ring attention: K/V blocks travel around the ring while every rank attends its own queries.

Each of the ``n`` ring ranks holds queries ``q [L, H, D]`` and keys/values ``k, v [L, Hkv, D]`` of
the same documents, as given chunk ids of each document (``chunks_by_rank[j]``, memory order; the
zigzag layout: ``(j, 2n-1-j)``). At step ``i`` rank ``r`` holds the K/V block of rank ``r - i``:

    forward   post isend(block → r+1), irecv(block ← r-1)   # overlaps the computation below
              for each kernel call of plan_block(my chunks, block's chunks):   # zigzag.py
                  (out_b, lse_b) = block_forward(q rows, block rows)            # kernels.py
                  (out, lse) = merge(out, lse, out_b, lse_b)                    # fp32
              wait; block = received
    backward  the same walk, recomputing each block's probabilities from the saved global lse;
              dq accumulates here, dK/dV of the block accumulate in a buffer that follows the block
              (received from r-1, added to, sent to r+1): after ``n`` steps it is back on its owner.

Saved for backward: ``q, k, v, out, lse`` only. Sliding windows are not supported here (the
all-gather and Ulysses modes handle them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from omniweave.parallel.context.kernels import BlockKernel, merge_partials
from omniweave.parallel.context.zigzag import BlockCall, chunk_lengths, no_memo, plan_block


def _shift(tensor: torch.Tensor, group) -> tuple[list, torch.Tensor]:
    """Post send to the next ring rank and receive from the previous one; returns (works, buffer)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (me + 1) % n), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (me - 1) % n), group),
    ])  # fmt: skip
    return works, received


def _wait(pending: tuple[list, torch.Tensor]) -> torch.Tensor:
    works, received = pending
    for work in works:
        work.wait()
    return received


def _rows(x: torch.Tensor, rows: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return x if rows is None else x.index_select(dim, rows)


def _add_rows(acc: torch.Tensor, rows: torch.Tensor | None, x: torch.Tensor) -> None:
    if rows is None:
        acc.add_(x.float())
    else:
        acc.index_add_(0, rows, x.float())


def ring_forward(q, k, v, plans: list[list[BlockCall]], group, scale: float, kernel: BlockKernel):
    """``(out [L, H, D] in q's dtype, lse fp32 [H, L])`` over all blocks of the ring."""
    n = len(plans)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    kv = torch.stack([k, v])  # [2, L, Hkv, D]: one message per step
    for step, calls in enumerate(plans):
        pending = _shift(kv, group) if step + 1 < n else None
        for call in calls:
            out_b, lse_b = kernel.forward(
                _rows(q, call.q_rows), _rows(kv[0], call.k_rows), _rows(kv[1], call.k_rows),
                call.cu_q, call.cu_k, call.max_q, call.max_k, call.causal, scale,
            )  # fmt: skip
            if call.q_rows is None:
                out, lse = merge_partials(out, lse, out_b, lse_b)
            else:
                merged_out, merged_lse = merge_partials(out[call.q_rows], lse[:, call.q_rows], out_b, lse_b)
                out.index_copy_(0, call.q_rows, merged_out)
                lse.index_copy_(1, call.q_rows, merged_lse)
        if pending is not None:
            kv = _wait(pending)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, plans: list[list[BlockCall]], group, scale: float, kernel: BlockKernel):
    """``(dq, dk, dv)`` in the inputs' dtypes; dk/dv of every block end on the block's owner."""
    n = len(plans)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    incoming = None  # dK/dV of the block now held, accumulated by the previous ranks
    for step, calls in enumerate(plans):
        pending_kv = _shift(kv, group) if step + 1 < n else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for call in calls:
            rows_q = call.q_rows
            dq_b, dk_b, dv_b = kernel.backward(
                _rows(dout, rows_q), _rows(q, rows_q), _rows(kv[0], call.k_rows), _rows(kv[1], call.k_rows),
                _rows(out, rows_q), _rows(lse, rows_q, dim=1),
                call.cu_q, call.cu_k, call.max_q, call.max_k, call.causal, scale,
            )  # fmt: skip
            _add_rows(dq, rows_q, dq_b)
            _add_rows(dkv[0], call.k_rows, dk_b)
            _add_rows(dkv[1], call.k_rows, dv_b)
        if incoming is not None:
            dkv += _wait(incoming)
        if pending_kv is not None:
            kv = _wait(pending_kv)
        if n > 1:
            incoming = _shift(dkv, group)  # to the next rank: it holds this block at the next step
    dkv = _wait(incoming) if n > 1 else dkv  # after n steps every buffer is back on its owner
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plans, group, scale, kernel):
        out, lse = ring_forward(q, k, v, plans, group, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.group, ctx.scale, ctx.kernel = plans, group, scale, kernel
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plans, ctx.group, ctx.scale, ctx.kernel)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, cu_seqlens, group, chunks_by_rank: list[tuple[int, ...]], scale: float,
                   kernel: BlockKernel, memo=no_memo) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of all ring ranks; differentiable.

    ``chunks_by_rank[j]``: chunk ids of every document ring rank ``j`` holds, in memory order (the
    same count on every rank); ``cu_seqlens``: local document boundaries (identical everywhere);
    ``memo(key, build)`` may reuse the block plans across layers (``CPContext.memo``)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if len(chunks_by_rank) != n:
        raise ValueError(f"chunks_by_rank lists {len(chunks_by_rank)} ranks but the ring has {n}")

    def build() -> list[list[BlockCall]]:
        chunk_lens = chunk_lengths(cu_seqlens, len(chunks_by_rank[me]), q.shape[0])
        return [plan_block(chunk_lens, chunks_by_rank[me], chunks_by_rank[(me - i) % n], q.device) for i in range(n)]

    plans = memo(("ring", tuple(chunks_by_rank)), build)
    return _RingAttention.apply(q, k, v, plans, group, scale, kernel)
