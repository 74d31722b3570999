"""Sequence parallelism over a video-diffusion generator's tokens (``parallel.cp`` with
``train.phase=diffusion``): one packed row of clips split across the ranks of the CP group.

    apply_sequence_split(model.generator, group, mode, backend)   # parallel/context: apply_cp

A row of ``T`` clip tokens is cut into ``n`` contiguous pieces of ``L = ceil(T / n)`` rows; the
last piece is padded with rows that form an attention document of their own (no real token sees
them). Rank ``r`` runs rows ``[r·L, (r+1)·L)`` through every block; the per-clip conditioning
(time embedding, modulation tables, text projection) is computed on every rank, and each rank's
3-D RoPE angles and per-token modulation rows are its slice of the whole row's.

- Self-attention is bidirectional within each clip (no causal balance to keep, so contiguous
  pieces, not zigzag chunks):
    ``ulysses``  one all-to-all turns the sequence shard into a head shard (``H/n`` heads of the
                 whole row: the pieces are contiguous, so rank order is row order), the local
                 varlen kernel runs over the clips, and one all-to-all turns it back (as Wan's own
                 code does; needs ``H % n == 0``);
    ``ring``     K/V blocks travel around the ring (ring.py's forward / backward, its lse merge);
                 each block's kernel call pairs this rank's queries only with the keys of the same
                 clip, non-causally. Memory linear in L; any head count.
- Cross-attention needs nothing: the text states are replicated, each local query attends its
  clip's text (a clip with no rows here is an empty query segment).

The loss (models/diffusion.py) sums each rank's own rows; FSDP over dp x cp sums the gradients.
The model learns of none of this: ``WanDiT.sequence_split`` is an attribute set from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from omniweave.models.components.attention import attn, autocast_inputs, resolve
from omniweave.parallel.context.ring import _RingAttention
from omniweave.parallel.context.ulysses import heads_to_seq, seq_to_heads
from omniweave.parallel.context.zigzag import BlockCall

MODES = ("ring", "ulysses")


@dataclass
class SequenceSplit:
    group: ProcessGroup
    mode: str = "ring"
    backend: str = "auto"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"sequence parallelism over video tokens runs {' or '.join(MODES)} attention, "
                             f"not {self.mode!r} (parallel.cp_attention)")
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)

    def piece(self, total: int) -> int:
        """L: rows per rank (the last rank's piece padded)."""
        return -(-total // self.size)

    def local_slice(self, total: int) -> slice:
        """This rank's real rows of a row of ``total`` tokens (empty when the padding covers it)."""
        n = self.piece(total)
        start = min(self.rank * n, total)
        return slice(start, min(start + n, total))

    def padded_bounds(self, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
        """The whole row's document boundaries with the padding as a last document."""
        padded = self.piece(total) * self.size
        if padded == total:
            return cu_seqlens
        return torch.cat([cu_seqlens, cu_seqlens.new_tensor([padded])])

    def local_rows(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``x [T, ...]`` of the whole row -> this rank's ``[L, ...]`` (pad rows = ``fill``)."""
        n, part = self.piece(x.shape[0]), self.local_slice(x.shape[0])
        mine = x[part]
        if mine.shape[0] == n:
            return mine
        return torch.cat([mine, mine.new_full((n - mine.shape[0], *x.shape[1:]), fill)])

    def local_segments(self, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
        """The clips' boundaries within this rank's piece (cross-attention's query segments); the
        pad rows join the last clip's segment (their outputs are never used)."""
        n, start = self.piece(total), self.rank * self.piece(total)
        cu = (cu_seqlens.to(torch.long) - start).clamp(0, n)
        cu[-1] = n
        return cu.to(torch.int32)

    def attention_fn(self, cu_seqlens: torch.Tensor, total: int):
        """The self-attention of this rank's queries over the whole row's clips: ``fn(q, k, v)``
        with q, k, v ``[L, H, D]`` local rows -> ``[L, H, D]``; plans made once per row."""
        bounds = self.padded_bounds(cu_seqlens.to(torch.int32), total)
        if self.mode == "ulysses":
            return lambda q, k, v: self._ulysses(q, k, v, bounds)
        n = self.piece(total)
        plans = [dense_block_calls(bounds, self.rank * n, ((self.rank - i) % self.size) * n, n)
                 for i in range(self.size)]
        return lambda q, k, v: self._ring(q, k, v, plans)

    def _ulysses(self, q, k, v, bounds):
        if q.shape[1] % self.size or k.shape[1] % self.size:
            raise ValueError(f"Ulysses sequence parallelism splits the {q.shape[1]} attention heads over "
                             f"parallel.cp={self.size} ranks: they must divide evenly (or use cp_attention=ring)")
        q, k, v = seq_to_heads(list(autocast_inputs(q, k, v)), self.group)
        out, _ = attn(q, k, v, bounds, bounds, causal=False, backend=self.backend, need_lse=False)
        return heads_to_seq(out, self.group)

    def _ring(self, q, k, v, plans):
        q, k, v = autocast_inputs(q, k, v)
        kernel = resolve(self.backend, q, k, block=True).block
        return _RingAttention.apply(q, k, v, plans, self.group, q.shape[-1] ** -0.5, kernel)


def dense_block_calls(bounds: torch.Tensor, q_start: int, k_start: int, rows: int) -> list[BlockCall]:
    """The kernel call of local queries (whole-row rows ``[q_start, q_start + rows)``) against a K/V
    block (rows ``[k_start, k_start + rows)``): one non-causal segment per document both overlap;
    [] when they share none. Rows are local indices into the queries / the block."""
    cu = [int(b) for b in bounds.tolist()]
    q_idx, k_idx, cu_q, cu_k = [], [], [0], [0]
    for s, e in zip(cu[:-1], cu[1:]):
        q0, q1 = max(s, q_start), min(e, q_start + rows)
        k0, k1 = max(s, k_start), min(e, k_start + rows)
        if q0 < q1 and k0 < k1:
            q_idx.append(torch.arange(q0 - q_start, q1 - q_start))
            k_idx.append(torch.arange(k0 - k_start, k1 - k_start))
            cu_q.append(cu_q[-1] + q1 - q0)
            cu_k.append(cu_k[-1] + k1 - k0)
    if len(cu_q) == 1:
        return []
    device = bounds.device
    q_rows, k_rows = torch.cat(q_idx).to(device), torch.cat(k_idx).to(device)
    whole = torch.arange(rows, device=device)

    def rows_or_all(idx):  # None: every row in order, no gather
        return None if idx.numel() == rows and bool((idx == whole).all()) else idx

    lens_q, lens_k = torch.tensor(cu_q).diff(), torch.tensor(cu_k).diff()
    return [BlockCall(rows_or_all(q_rows), rows_or_all(k_rows), torch.tensor(cu_q, dtype=torch.int32, device=device),
                      torch.tensor(cu_k, dtype=torch.int32, device=device), int(lens_q.max()), int(lens_k.max()),
                      False)]


def apply_sequence_split(generator, group: ProcessGroup, mode: str, backend: str) -> None:
    """Split the generator's rows over ``group`` (see the module docstring)."""
    if not hasattr(generator, "sequence_split"):
        raise ValueError(f"{type(generator).__name__} has no sequence_split hook: parallel.cp > 1 needs a "
                         "generator that supports sequence parallelism (wan_dit)")
    generator.sequence_split = SequenceSplit(group, mode, backend)
