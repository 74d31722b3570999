"""Zigzag chunk bookkeeping for context-parallel attention (pure functions, no process group).

Layout contract (built by the sharding module): document ``d`` is padded at its end to
``2·cp·c_d`` rows and cut into ``2·cp`` chunks of ``c_d`` rows; CP rank ``r`` holds chunks ``r`` and
``2cp-1-r``, laid out per document as ``[chunk r | chunk 2cp-1-r]``. Every rank therefore has the
same local ``cu_seqlens = [0, 2c_0, 2c_0+2c_1, ...]`` and ``c_d`` is half a local document.

Causality at chunk level: query chunk ``a`` sees key chunk ``b`` fully iff ``b < a``, causally (the
diagonal block) iff ``b == a``, and not at all iff ``b > a``. Everything below turns this rule into
row indices of packed ``[rows, heads, dim]`` tensors:

- :func:`chunk_rows` assembles, per document, a list of chunk ids out of the concatenated local rows
  of several ranks (all-gathered K/V prefixes, Ulysses' natural order, a hybrid group's block).
- :func:`plan_block` lists the varlen kernel calls that compute exactly the visible (query, key)
  pairs between local queries holding chunk ids ``Q`` and a K/V block holding chunk ids ``K`` (per
  document, in memory order) — at most one causal and one full call (:class:`BlockCall`).
  A query chunk's keys are gathered in chunk-id order with its own chunk last, so one bottom-right
  aligned causal mask is exact; consecutive query chunks with the same (or the next diagonal) keys
  share one segment. Ring step 0 of the zigzag layout is thus one causal call over the local rows
  as they are (no gather), a step from a lower rank one full call (both local chunks against the
  source's first chunk), a step from a higher rank one full call (the second local chunk against
  the whole source block): ``2·c_d²`` (query, key) pairs per document at every step but the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def no_memo(key, build):
    """The ``memo(key, build)`` the attention modes take when nobody caches their plans."""
    return build()


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """Chunk ids CP rank ``rank`` holds of every document, in local memory order."""
    return rank, 2 * cp - 1 - rank


def chunk_holder(chunk: int, cp: int) -> tuple[int, int]:
    """(CP rank, half) holding chunk id ``chunk``; half 0 is the first half of a local document."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def chunk_lengths(cu_seqlens: torch.Tensor, chunks_per_doc: int, rows: int) -> list[int]:
    """Chunk length ``c_d`` of every document of local rows holding ``chunks_per_doc`` chunks each."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != rows:
        raise ValueError(f"cu_seqlens must run from 0 to the {rows} local rows, got {cu}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = [n for n in lens if n < 0 or n % chunks_per_doc]
    if bad:
        raise ValueError(f"local document lengths {bad} are not multiples of {chunks_per_doc} chunks "
                         f"(cu_seqlens {cu}); is the row zigzag-sharded?")
    return [n // chunks_per_doc for n in lens]


def rows_index(starts: list[int], lengths: list[int], device=None) -> torch.Tensor:
    """int64 rows ``[s, s+n)`` of every (start, length) range, concatenated."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - offsets, lengths_t)
    return (shift + torch.arange(shift.numel())).to(device)


def _rows_or_all(starts: list[int], lengths: list[int], total: int, device) -> torch.Tensor | None:
    """:func:`rows_index`, or None when the ranges are simply all ``total`` rows in order."""
    end = 0
    for s, n in zip(starts, lengths):
        if s != end:
            return rows_index(starts, lengths, device)
        end += n
    return None if end == total else rows_index(starts, lengths, device)


def chunk_rows(chunk_lens: list[int], rows_per_rank: int, ranks: list[int], cp: int,
               doc_chunks: list[list[int]], device=None) -> torch.Tensor:
    """Row index into the local rows of CP ranks ``ranks`` concatenated (rank ``ranks[p]`` at rows
    ``[p·rows_per_rank, (p+1)·rows_per_rank)``) that lays out, document after document, the chunk
    ids ``doc_chunks[d]`` in that order (ids may repeat: overlapping key prefixes)."""
    position = {rank: p for p, rank in enumerate(ranks)}
    starts, lengths, doc_start = [], [], 0
    for c, chunks in zip(chunk_lens, doc_chunks):
        for j in chunks:
            rank, half = chunk_holder(j, cp)
            starts.append(position[rank] * rows_per_rank + doc_start + half * c)
            lengths.append(c)
        doc_start += 2 * c
    return rows_index(starts, lengths, device)


def chunk_segments(q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...]) -> list[tuple[list[int], list[int], bool]]:
    """One document in chunk units: ``(query chunk positions, key chunk positions, causal)`` per
    kernel segment; query positions are consecutive, key positions ordered by chunk id."""
    kv_position = {b: p for p, b in enumerate(kv_chunks)}
    segments: list[tuple[list[int], list[int], bool]] = []
    last_keys: list[int] = []  # chunk ids of the last segment's keys
    for qp, a in enumerate(q_chunks):
        causal = a in kv_position
        keys = sorted(b for b in kv_chunks if b < a) + ([a] if causal else [])
        if not keys:
            continue
        if segments and segments[-1][0][-1] == qp - 1 and segments[-1][2] == causal and (
            keys == last_keys + [a] if causal else keys == last_keys
        ):
            segments[-1][0].append(qp)
            segments[-1][1][:] = [kv_position[b] for b in keys]
        else:
            segments.append(([qp], [kv_position[b] for b in keys], causal))
        last_keys = keys
    return segments


@dataclass(frozen=True)
class BlockCall:
    """One varlen kernel call of a (queries, K/V block) pair.

    Segment ``i`` is query rows ``q_rows[cu_q[i]:cu_q[i+1]]`` of the local queries against key rows
    ``k_rows[cu_k[i]:cu_k[i+1]]`` of the block, bottom-right causal or full; ``None`` rows mean all
    rows in order (no gather). Query rows are disjoint within a call and across a block's calls."""

    q_rows: torch.Tensor | None
    k_rows: torch.Tensor | None
    cu_q: torch.Tensor  # int32 [S+1]
    cu_k: torch.Tensor  # int32 [S+1]
    max_q: int
    max_k: int
    causal: bool


def plan_block(chunk_lens: list[int], q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...],
               device=None) -> list[BlockCall]:
    """Kernel calls for local queries holding chunk ids ``q_chunks`` of every document against a K/V
    block holding ``kv_chunks`` (both in memory order, ``c_d`` rows per chunk)."""
    segments = chunk_segments(q_chunks, kv_chunks)
    rows_q, rows_k = len(q_chunks) * sum(chunk_lens), len(kv_chunks) * sum(chunk_lens)
    calls = []
    for causal in (True, False):
        mine = [s for s in segments if s[2] == causal]
        q_starts, q_lens, k_starts, k_lens, seg_q, seg_k = [], [], [], [], [0], [0]
        q_doc = k_doc = 0
        for c in (c for c in chunk_lens if c):  # empty documents add no rows
            for q_pos, k_pos, _ in mine:
                q_starts.append(q_doc + q_pos[0] * c)
                q_lens.append(len(q_pos) * c)
                k_starts += [k_doc + p * c for p in k_pos]
                k_lens += [c] * len(k_pos)
                seg_q.append(seg_q[-1] + len(q_pos) * c)
                seg_k.append(seg_k[-1] + len(k_pos) * c)
            q_doc, k_doc = q_doc + len(q_chunks) * c, k_doc + len(kv_chunks) * c
        if len(seg_q) == 1:
            continue
        cu_q, cu_k = (torch.tensor(s, dtype=torch.int32, device=device) for s in (seg_q, seg_k))
        calls.append(BlockCall(
            q_rows=_rows_or_all(q_starts, q_lens, rows_q, device),
            k_rows=_rows_or_all(k_starts, k_lens, rows_k, device),
            cu_q=cu_q, cu_k=cu_k, causal=causal,
            max_q=max(b - a for a, b in zip(seg_q[:-1], seg_q[1:])),
            max_k=max(b - a for a, b in zip(seg_k[:-1], seg_k[1:])),
        ))  # fmt: skip
    return calls


def whole_row_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu int32 [D+1] of the whole zigzag-padded row, int64 [local rows]: where each of rank
    ``rank``'s local rows lies in it). Document ``d`` there has ``2·cp·c_d`` rows (pads at its end)."""
    rows = int(cu_seqlens[-1])
    chunk_lens = chunk_lengths(cu_seqlens, 2, rows)
    whole = torch.tensor([0] + [2 * cp * c for c in chunk_lens], dtype=torch.int64).cumsum(0)
    first, second = zigzag_chunks(cp, rank)
    starts = [int(s) + j * c for s, c in zip(whole[:-1].tolist(), chunk_lens) for j in (first, second)]
    lengths = [c for c in chunk_lens for _ in (first, second)]
    return whole.to(torch.int32), rows_index(starts, lengths)
