"""Load-balanced ("zigzag") context-parallel sharding of one packed row.

A packed row of length L holds D documents, delimited by ``cu_seqlens`` int32 [D+1]
(``cu_seqlens[-1] == L``). Under causal attention the cost of a token grows with its position in
its document, so cutting each document into ``cp`` contiguous pieces would give the last rank most
of the work. Instead, with ``cp`` ranks:

    document d (n_d tokens) is padded at its END to 2·cp·c_d tokens, c_d = ceil(n_d / 2cp),
    and cut into 2·cp chunks of c_d tokens:   [ 0 | 1 | … | cp-1 | cp | … | 2cp-1 ]
    rank r holds chunks r and 2cp-1-r          (work (r+1) + (2cp-r) = 2cp+1 chunks on every rank)

Pads sit after a document's last token, so under causal attention no real token ever sees one;
pads get labels -100 and never count in the loss.

Local layout (a contract the CP attention and the trainer rely on): for each document in order,
``[chunk r of d | chunk 2cp-1-r of d]``. Every rank therefore has the same local length
``local_len = Σ_d 2·c_d`` and the same local ``cu_seqlens = [0, 2c_0, 2c_0+2c_1, …]``.

    plan = plan_cp_shard(cu_seqlens, cp)
    plan.local_index(r)            int64 [local_len]: original row held by each local row, -1 = pad
    shard_rows(x, plan, r)         x [..., L, ...] -> [..., local_len, ...] (differentiable gather)
    unshard_rows([x_0, …], plan)   the inverse (pads dropped)
    shard_batch(batch, plan, r)    the rank-r micro-batch (see its docstring)

With ``cp == 1`` nothing is padded (chunk 1 is just the rest of the document) and every function
is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniweave.models.omni import feature_rows_from_spans  # noqa: F401 (the one implementation; tp.py imports it here)
from omniweave.models.registry import MODALITIES

# keys of a micro-batch (loader.collate_pack) that shard_batch rewrites / passes through
_REWRITTEN_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "token_data", "token_valid",
                   *(k for m in MODALITIES for k in (m.spans, m.rows)))
# a row's keys that are not per token, passed through unchanged (by CP shards and by chunks: seq_chunks.py)
WHOLE_ROW_KEYS = ("num_loss_tokens", "num_pairs", "num_seqs", "num_kto", "pack_id", "num_action_values",
                  *(k for m in MODALITIES for k in (m.inputs, m.grid, m.sizes) if k))
PER_DOCUMENT_KEYS = ("prefix_lens",)  # [D]: CP pads each document at its end, a pad document gets 0
# items that attend to the row without being rows of it (a VLA frame's action chunks, models/vla.py),
# dim 0 = the item: each CP rank takes its share of them (item_share)
ITEM_KEYS = ("action_docs", "actions", "action_is_pad", "action_dims", "action_samples", "action_noise", "action_time")


@dataclass(frozen=True)
class CPShardPlan:
    """Which original rows each CP rank holds (see the module docstring for the layout)."""

    cp: int
    doc_lens: tuple[int, ...]  # n_d, original document lengths
    chunk_lens: tuple[int, ...]  # c_d = ceil(n_d / 2cp)

    @property
    def row_len(self) -> int:
        """L, the original row length."""
        return sum(self.doc_lens)

    @property
    def local_doc_lens(self) -> tuple[int, ...]:
        """Rows of each document on every rank: 2·c_d (pads included); n_d when cp == 1."""
        return self.doc_lens if self.cp == 1 else tuple(2 * c for c in self.chunk_lens)

    @property
    def local_len(self) -> int:
        """Rows per rank, Σ_d 2·c_d (pads included), the same on every rank."""
        return sum(self.local_doc_lens)

    def local_cu_seqlens(self) -> torch.Tensor:
        """int32 [D+1]: document boundaries of the local row, identical on every rank."""
        return torch.tensor([0, *self.local_doc_lens], dtype=torch.int64).cumsum(0).to(torch.int32)

    def doc_starts(self) -> torch.Tensor:
        """int64 [D]: first row of each document in the original row."""
        return torch.tensor([0, *self.doc_lens[:-1]], dtype=torch.int64).cumsum(0)

    def local_offsets(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc int64 [local_len], offset int64 [local_len]): each local row's document and its
        offset in that document padded to 2·cp·c_d rows (offset >= n_d means a pad)."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} is outside the CP group of size {self.cp}")
        docs, offsets = [], []
        for d, (c, local_n) in enumerate(zip(self.chunk_lens, self.local_doc_lens)):
            within = torch.arange(c)
            second = (2 * self.cp - 1 - rank) * c + within
            offsets += [rank * c + within, second[: local_n - c]]  # cp == 1: the unpadded rest
            docs.append(torch.full((local_n,), d, dtype=torch.int64))
        return torch.cat(docs), torch.cat(offsets)

    def local_index(self, rank: int) -> torch.Tensor:
        """int64 [local_len]: the row of the ORIGINAL row each local row holds, -1 for a pad."""
        doc, offset = self.local_offsets(rank)
        lens = torch.tensor(self.doc_lens, dtype=torch.int64)[doc]
        return torch.where(offset < lens, self.doc_starts()[doc] + offset, -1)


def plan_cp_shard(cu_seqlens, cp: int) -> CPShardPlan:
    """The sharding plan of one row with document boundaries ``cu_seqlens`` over ``cp`` ranks."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be an integer >= 1, got {cp!r}")
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer sequence [0, …, L] with at least one document, "
                         f"got shape {tuple(cu.shape)} dtype {cu.dtype}")
    bounds = cu.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[:4]}…")
    doc_lens = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if min(doc_lens) < 1:
        bad = next(i for i, n in enumerate(doc_lens) if n < 1)
        raise ValueError(f"cu_seqlens must be strictly increasing; document {bad} spans "
                         f"[{bounds[bad]}, {bounds[bad + 1]})")
    chunk_lens = tuple(-(-n // (2 * cp)) for n in doc_lens)
    return CPShardPlan(cp=cp, doc_lens=doc_lens, chunk_lens=chunk_lens)


def shard_rows(x: torch.Tensor, plan: CPShardPlan, rank: int, fill=0, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s rows of ``x`` along ``dim`` (size L -> local_len), pads = ``fill``.
    A gather: gradients flow back to the rows taken."""
    if x.shape[dim] != plan.row_len:
        raise ValueError(f"tensor of shape {tuple(x.shape)} has {x.shape[dim]} rows along dim {dim}, "
                         f"the plan's row has {plan.row_len}")
    index = plan.local_index(rank).to(x.device)
    taken = x.index_select(dim, index.clamp_min(0))
    is_real = (index >= 0).view([-1 if i == dim % x.dim() else 1 for i in range(x.dim())])
    return torch.where(is_real, taken, torch.tensor(fill, dtype=x.dtype, device=x.device))


def unshard_rows(shards: list[torch.Tensor], plan: CPShardPlan, dim: int = 0) -> torch.Tensor:
    """The original row from every rank's shard (rank order), pads dropped; differentiable."""
    if len(shards) != plan.cp:
        raise ValueError(f"got {len(shards)} shards for a CP group of size {plan.cp}")
    source = torch.empty(plan.row_len, dtype=torch.int64)  # original row -> row of cat(shards)
    for rank in range(plan.cp):
        index = plan.local_index(rank)
        held = index >= 0
        source[index[held]] = rank * plan.local_len + torch.nonzero(held).squeeze(1)
    stacked = torch.cat(shards, dim)
    return stacked.index_select(dim, source.to(stacked.device))


def _shard_positions(position_ids: torch.Tensor, plan: CPShardPlan, rank: int) -> torch.Tensor:
    """position_ids [..., L] -> [..., local_len]; a pad k rows past its document's end gets the
    document's last position + k on every axis."""
    doc, offset = plan.local_offsets(rank)
    lens = torch.tensor(plan.doc_lens, dtype=torch.int64)[doc]
    source = plan.doc_starts()[doc] + offset.clamp(max=lens - 1)  # the row itself, or its document's last row
    past_end = (offset - lens + 1).clamp_min(0)
    device = position_ids.device
    return position_ids.index_select(-1, source.to(device)) + past_end.to(device, position_ids.dtype)


def shard_batch(batch: dict, plan: CPShardPlan, rank: int, pad_id: int = 0) -> dict:
    """Rank ``rank``'s micro-batch of a packed row (``loader.collate_pack`` keys).

    input_ids [local_len] (``pad_id`` at pads), labels [local_len] (-100 at pads), position_ids
    with the same leading axes (computed on the whole row: arange(L) if the batch has none),
    cu_seqlens = the local boundaries, per modality (registry.MODALITIES) its feature rows int64
    [local_len] (``feature_rows``, ``audio_feature_rows``: index into the span-order features of
    that modality, -1 for text and pads) in place of its spans (or sharded from the batch's own
    ``feature_rows``: rows that share media, as RL's G samples of a prompt do); each tensor of
    ``token_data`` (per-token values [L], e.g. RL's advantages) sharded like the labels (0 at
    pads); pixel_values, grid_thw and num_loss_tokens (the pack's global count) unchanged, so the
    vision split decides who encodes.
    """
    unknown = sorted(set(batch) - set(_REWRITTEN_KEYS) - set(WHOLE_ROW_KEYS) - set(PER_DOCUMENT_KEYS) - set(ITEM_KEYS))
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard batch key(s) {unknown}")
    ids = batch["input_ids"]
    if ids.dim() != 1 or ids.shape[0] != plan.row_len:
        raise ValueError(f"input_ids of shape {tuple(ids.shape)} do not match the plan's row of {plan.row_len} tokens")
    bounds = [0, *torch.tensor(plan.doc_lens).cumsum(0).tolist()]
    if "cu_seqlens" in batch and batch["cu_seqlens"].tolist() != bounds:
        raise ValueError(f"batch cu_seqlens {batch['cu_seqlens'].tolist()} are not the plan's {bounds}")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(plan.row_len, device=ids.device)
    out = {
        "input_ids": shard_rows(ids, plan, rank, fill=pad_id),
        "labels": shard_rows(batch["labels"], plan, rank, fill=-100),
        "position_ids": _shard_positions(positions, plan, rank),
        "cu_seqlens": plan.local_cu_seqlens().to(ids.device),
    }
    for m in MODALITIES:
        grid, spans, rows = batch.get(m.grid), batch.get(m.spans), batch.get(m.rows)
        if grid is None and spans is None and rows is None:
            continue  # the row has no keys of this modality
        if spans is None and rows is None and grid.shape[0] > 0:
            raise ValueError(f"batch has {m.grid} but no {m.spans} to place the features")
        if rows is None:
            spans = torch.zeros(0, 2, dtype=torch.int64) if spans is None else spans.reshape(-1, 2)
            rows = feature_rows_from_spans(spans, plan.row_len)
        out[m.rows] = shard_rows(rows, plan, rank, fill=-1).to(ids.device)
    if "token_data" in batch:
        out["token_data"] = {k: shard_rows(v, plan, rank, fill=0) for k, v in batch["token_data"].items()}
    valid = batch.get("token_valid")
    valid = torch.ones(plan.row_len, dtype=torch.bool, device=ids.device) if valid is None else valid
    out["token_valid"] = shard_rows(valid, plan, rank, fill=False)  # pads: no router statistics (MoE)
    out.update({k: batch[k] for k in (*WHOLE_ROW_KEYS, *PER_DOCUMENT_KEYS) if k in batch})
    out.update(item_share({k: batch[k] for k in ITEM_KEYS if k in batch}, plan.cp, rank))
    return out


def item_share(items: dict, cp: int, rank: int) -> dict:
    """Rank ``rank``'s contiguous share of a row's items (``ITEM_KEYS``, dim 0). Their losses are sums
    over items, so the shares add up to the row's; a rank left without one gets item 0 with every
    step padded (``action_is_pad``), which runs the same modules and adds exactly nothing."""
    if not items:
        return {}
    n = next(iter(items.values())).shape[0]
    mine = torch.arange(n).tensor_split(cp)[rank]
    if mine.numel() == 0:
        if n == 0 or "action_is_pad" not in items:
            raise ValueError(f"{n} items cannot be shared over {cp} CP ranks so that each runs one")
        out = {k: v[:1] for k, v in items.items()}
        out["action_is_pad"] = torch.ones_like(out["action_is_pad"])
        return out
    return {k: v[mine.to(v.device)] for k, v in items.items()}


def pad_rows_for(cu_seqlens, cp: int, multiple: int) -> int:
    """Length of a pad document to append to a row so that every CP rank's local length is a
    multiple of ``multiple`` (tensor parallelism splits the local row evenly over its ranks)."""
    if multiple <= 1:
        return 0
    local = plan_cp_shard(cu_seqlens, cp).local_len
    if local % multiple == 0:
        return 0
    if cp == 1:
        return -local % multiple
    for c in range(1, multiple + 1):  # the pad document adds 2c local rows (2cp·c tokens)
        if (local + 2 * c) % multiple == 0:
            return 2 * cp * c
    raise ValueError(f"no pad document makes a local row of {local} tokens a multiple of {multiple}")


def append_pad_document(batch: dict, length: int, pad_id: int = 0) -> dict:
    """The micro-batch with one more document of ``length`` pad tokens (label -100) at its end."""
    if length == 0:
        return batch
    ids = batch["input_ids"]
    out = dict(batch)
    out["input_ids"] = torch.cat([ids, ids.new_full((length,), pad_id)])
    out["labels"] = torch.cat([batch["labels"], batch["labels"].new_full((length,), -100)])
    pos = batch.get("position_ids")
    if pos is not None:
        tail = torch.arange(length, dtype=pos.dtype, device=pos.device)
        out["position_ids"] = torch.cat([pos, tail.expand(*pos.shape[:-1], length)], dim=-1)
    cu = batch.get("cu_seqlens")
    cu = torch.tensor([0, ids.shape[0]], dtype=torch.int32) if cu is None else cu
    out["cu_seqlens"] = torch.cat([cu, cu.new_tensor([int(cu[-1]) + length])])
    for m in MODALITIES:
        if batch.get(m.rows) is not None:
            out[m.rows] = torch.cat([batch[m.rows], batch[m.rows].new_full((length,), -1)])
    if "token_data" in batch:
        out["token_data"] = {k: torch.cat([v, v.new_zeros(length)]) for k, v in batch["token_data"].items()}
    valid = batch.get("token_valid")
    valid = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if valid is None else valid
    out["token_valid"] = torch.cat([valid, valid.new_zeros(length)])
    for key in PER_DOCUMENT_KEYS:  # the pad document: no prefix
        if batch.get(key) is not None:
            out[key] = torch.cat([batch[key], batch[key].new_zeros(1)])
    return out
