"""The zigzag context-parallel layout built from full tensors (tests only).

Document ``d`` of length ``n_d`` is padded at its end to a multiple of ``2·cp`` (chunk length
``c_d``); rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of every document, laid out per document as
``[chunk r | chunk 2cp-1-r]``.
"""

from __future__ import annotations

import torch


def padded_lengths(doc_lens: list[int], cp: int) -> list[int]:
    return [-(-n // (2 * cp)) * 2 * cp for n in doc_lens]


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def zigzag_shard(x_full: torch.Tensor, padded: list[int], cp: int, rank: int) -> torch.Tensor:
    """Rows of rank ``rank`` from ``x_full`` (the padded documents back to back, natural order)."""
    parts, start = [], 0
    for n in padded:
        c = n // (2 * cp)
        parts += [x_full[start + j * c:start + (j + 1) * c] for j in (rank, 2 * cp - 1 - rank)]
        start += n
    return torch.cat(parts)


def local_cu_seqlens(padded: list[int], cp: int) -> torch.Tensor:
    return cu_of([n // cp for n in padded])
