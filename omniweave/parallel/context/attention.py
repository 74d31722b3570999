"""Context-parallel causal attention over zigzag-sharded packed rows: the one entry point.

Input layout (the sharding module builds it): every document of the packed row is padded at its
end to ``2·cp·c_d`` rows and cut into ``2·cp`` chunks; CP rank ``r`` holds chunks ``r`` and
``2cp-1-r`` of each document, as ``[chunk r | chunk 2cp-1-r]`` per document, so the local
``cu_seqlens`` is the same on every rank. :func:`cp_attention` returns, on the rows this rank holds,
the causal varlen attention over the full padded documents.

Modes (``CPContext.mode``):

- ``ring``       K/V blocks circulate over P2P, overlapped with the block computation; linear
                 memory; balanced by the zigzag layout (ring.py). No sliding window.
- ``allgather``  all-gather K/V (optionally ``head_groups`` KV heads at a time), one local kernel
                 call over the key prefixes each local chunk sees; windows work (allgather.py).
- ``ulysses``    all-to-all sequence -> heads, the local kernel over whole documents, and back;
                 needs ``H % cp == 0``; windows work (ulysses.py).
- ``hybrid``     Ulysses inside groups of ``u`` consecutive CP ranks, ring across the groups.

A :class:`CPContext` is itself a decoder ``attn_fn`` (``ctx(q, k, v, cu_seqlens, window)``), which is
how ``parallel/`` swaps it into ``models.components.decoder.Attention`` from outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from omniweave.models.components.attention import autocast_inputs, resolve
from omniweave.parallel.context.allgather import allgather_attention, gather_stacked
from omniweave.parallel.context.ring import ring_attention
from omniweave.parallel.context.ulysses import hybrid_attention, ulysses_attention
from omniweave.parallel.context.zigzag import whole_row_index, zigzag_chunks

MODES = ("ring", "allgather", "ulysses", "hybrid")


@dataclass
class CPContext:
    """How one run does context-parallel attention; built once, process groups passed in."""

    group: ProcessGroup  # the whole CP group (size cp, rank r = dist.get_rank(group))
    mode: str = "ring"  # ring | allgather | ulysses | hybrid
    ulysses_group: ProcessGroup | None = None  # hybrid: the inner group (size u, consecutive CP ranks)
    ring_group: ProcessGroup | None = None  # hybrid: ranks with the same inner index across inner groups
    head_groups: int = 1  # allgather: gather K/V in this many KV-head groups to bound memory
    backend: str = "auto"  # local kernel: a components.attention backend name (ring blocks: its block kernel)
    # index plans of the current micro-batch, keyed by its cu_seqlens tensor (see ``memo``)
    _plans: tuple = field(default=(None, {}), init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown context-parallel attention mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.mode == "hybrid" and (self.ulysses_group is None or self.ring_group is None):
            raise ValueError("mode 'hybrid' needs ulysses_group and ring_group (see make_hybrid_groups)")
        if self.head_groups < 1:
            raise ValueError(f"head_groups must be >= 1, got {self.head_groups}")

    def __call__(self, q, k, v, cu_seqlens, window: int | None = None) -> torch.Tensor:
        """The decoder's ``attn_fn`` hook."""
        return cp_attention(q, k, v, cu_seqlens, self, window)

    def row_map(self, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu int32 [D+1] of the whole zigzag-padded row, int64 [local rows]: each local row's place
        in it), for attention layouts that see the whole row (a VLA prefix: models/components/
        prefix_attention.py); made once per micro-batch."""
        n, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        return self.memo(cu_seqlens, "row_map", lambda: tuple(
            t.to(cu_seqlens.device) for t in whole_row_index(cu_seqlens.cpu(), n, me)))

    def gather_row(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``x`` [local rows, ...] of every CP rank -> [whole padded row, ...] in row order; the
        backward sums each rank's share of the gradient back to it (all-gather / reduce-scatter)."""
        n, rows = dist.get_world_size(self.group), x.shape[0]

        def order():  # row g of the whole row = row order[g] of the ranks' rows stacked in rank order
            held = torch.cat([whole_row_index(cu_seqlens.cpu(), n, r)[1] for r in range(n)])
            return torch.argsort(held).to(x.device)

        return gather_stacked(x, self.group).reshape(n * rows, *x.shape[1:])[self.memo(cu_seqlens, "row_order", order)]

    def memo(self, cu_seqlens: torch.Tensor, key, build: Callable):
        """``build()`` once per micro-batch: the row indices and kernel segments depend only on the
        document boundaries, and every decoder layer gets the same ``cu_seqlens`` tensor, so the
        plans (and the host sync of reading ``cu_seqlens``) are made once, not once per layer."""
        tensor, plans = self._plans
        if tensor is not cu_seqlens:  # a new micro-batch (holding the tensor keeps its id unique)
            plans = {}
            self._plans = (cu_seqlens, plans)
        if key not in plans:
            plans[key] = build()
        return plans[key]


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, ctx: CPContext,
                 window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """``q [L, H, D]``, ``k, v [L, Hkv, D]`` zigzag rows of this rank -> ``out [L, H, D]`` in q's dtype,
    differentiable w.r.t. q, k, v. ``cu_seqlens``: the local document boundaries."""
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"expected q [L, H, D] and k, v [L, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if window is not None and ctx.mode in ("ring", "hybrid"):
        raise ValueError(f"a sliding window ({window}) is not supported by {ctx.mode} context-parallel attention; "
                         f"choose mode 'allgather' or 'ulysses'")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = autocast_inputs(q, k, v)  # one dtype for the kernels and the K/V messages
    memo = partial(ctx.memo, cu_seqlens)
    if ctx.mode == "allgather":
        return allgather_attention(q, k, v, cu_seqlens, ctx.group, window, scale, ctx.backend, ctx.head_groups, memo)
    if ctx.mode == "ulysses":
        return ulysses_attention(q, k, v, cu_seqlens, ctx.group, window, scale, ctx.backend, memo)
    kernel = resolve(ctx.backend, q, k, block=True).block
    if ctx.mode == "ring":
        cp = dist.get_world_size(ctx.group)
        chunks = [zigzag_chunks(cp, r) for r in range(cp)]
        return ring_attention(q, k, v, cu_seqlens, ctx.group, chunks, scale, kernel, memo)
    return hybrid_attention(q, k, v, cu_seqlens, ctx.group, ctx.ulysses_group, ctx.ring_group, scale, kernel, memo)


def make_hybrid_groups(cp_ranks: list[int], ulysses_size: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """(Ulysses group, ring group) of this rank for the CP group of global ranks ``cp_ranks``.

    Every rank of the default group must call this with the same arguments (``dist.new_group`` is
    collective); ranks outside ``cp_ranks`` get ``(None, None)``."""
    cp_ranks, u = sorted(cp_ranks), ulysses_size
    if u < 1 or len(cp_ranks) % u:
        raise ValueError(f"ulysses_size={u} must divide the CP size {len(cp_ranks)}")
    me, inner, ring = dist.get_rank(), None, None
    for g in range(len(cp_ranks) // u):
        ranks = cp_ranks[g * u:(g + 1) * u]
        group = dist.new_group(ranks)
        inner = group if me in ranks else inner
    for i in range(u):
        ranks = cp_ranks[i::u]
        group = dist.new_group(ranks)
        ring = group if me in ranks else ring
    return inner, ring
