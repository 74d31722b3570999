"""The rows a pipelined run feeds its stages: one static length on every rank.

What crosses a stage boundary has the shape the first micro-batch gave it (parallel/pipeline.py),
so every row of a run reaches the stages at one length, fixed from the recipe before the first
step. Each row gets one loss-free pad document, sized so that what this rank holds has that length:

    length = static_row_length(data.max_len, cp, tp, max_docs)       # once per run
    rows   = static_rows(rows, data.max_len, length, cp, cp_rank, tp)  # every step

- no CP: the row padded to ``data.max_len`` (rounded up to a multiple of the foundation's tp,
  whose sequence parallelism splits it evenly);
- CP: each document of a row is padded to a multiple of 2·cp before the zigzag split
  (parallel/context/sharding.py), so a shard's length depends on the row's documents: up to
  (L + D·(2cp − 1)) / cp for L tokens in D documents. ``length`` is that bound for ``data.max_len``
  tokens in the packs' most documents per pack (stats.json), rounded up to an even multiple of tp;
  the pad document (cp · (length − shard) tokens: length − shard rows on every CP rank) is
  appended before the row is sharded.

The pads sit after the row's last document (causal attention never lets a real token see them)
with labels -100: they change no loss or gradient.
"""

from __future__ import annotations

import math

import torch

from omniweave.parallel.context import shard_micro_batch
from omniweave.parallel.context.sharding import append_pad_document, plan_cp_shard
from omniweave.parallel.pipeline import pad_rows


def static_row_length(max_len: int, cp: int = 1, tp: int = 1, max_docs: int | None = None) -> int:
    """The length every row of a pipelined run has on each rank (before the foundation's tp splits
    it): ``max_len`` (data.max_len) rounded up to a multiple of ``tp``; under CP the longest
    shard a row of ``max_len`` tokens in ``max_docs`` documents can have (each document is padded
    to a multiple of 2·cp, up to 2·cp − 1 more tokens: parallel/context/sharding.py), rounded up
    to an even multiple of ``tp``. ``max_docs`` None: as many documents as tokens."""
    if cp == 1:
        return -(-max_len // tp) * tp
    docs = max_len if max_docs is None else max_docs
    step = math.lcm(2, tp)
    return -(-((max_len + docs * (2 * cp - 1)) // cp) // step) * step


def static_rows(rows: list[dict], max_len: int, length: int, cp: int = 1, cp_rank: int = 0, tp: int = 1) -> list[dict]:
    """Each row as this rank's pipeline takes it, all of ``length`` tokens (``static_row_length``):
    a loss-free pad document appended, sized so that the row's CP shard has ``length`` tokens,
    then sharded (``context.shard_micro_batch``: rank ``cp_rank`` of ``cp``; cp == 1 pads to
    ``length``). ValueError for a row longer than ``max_len`` or one whose shard cannot fit."""
    if cp == 1:
        long = [r["input_ids"].shape[0] for r in rows if r["input_ids"].shape[0] > max_len]
        if long:
            raise ValueError(f"rows of {long} tokens exceed the pipeline capacity of {max_len} (data.max_len)")
        return [shard_micro_batch(r, 1, 0, tp) for r in pad_rows(rows, length)]
    out = []
    for r in rows:
        n = r["input_ids"].shape[0]
        cu = r.get("cu_seqlens")
        cu = torch.tensor([0, n], dtype=torch.int32) if cu is None else cu
        local = plan_cp_shard(cu.cpu(), cp).local_len
        if n > max_len or local > length:
            raise ValueError(f"a row of {n} tokens in {cu.numel() - 1} documents shards to {local} tokens per CP rank; "
                             f"the pipeline's rows have {length} (from data.max_len={max_len} and the packs' most "
                             "documents per pack, stats.json)")
        out.append(shard_micro_batch(append_pad_document(r, cp * (length - local)), cp, cp_rank, tp))
    return out
