"""The update batch of a GRPO step: prompt + response sequences packed into rows.

Every kept group (G samples of one prompt) becomes G documents ``prompt ‖ response_j``; groups are
packed whole into rows of ``capacity`` tokens (best-fit decreasing over group lengths; a group
longer than a row is cut into runs of its samples). A row carries each of its prompts' media
**once** (per modality: ``pixel_values`` / ``grid_thw``, ``audio_features`` / ``audio_lengths``),
and the modality's feature rows (``feature_rows``, ``audio_feature_rows``) send the same features to
the placeholder rows of all of that prompt's documents: each encoder runs once per prompt per
update, and its gradient sums over the G samples.

Labels are the response tokens (shifted: the row before each response token predicts it) and
``token_data`` holds, on those rows, what the loss needs: ``old_logp`` (the rollout's log-probs),
``advantages`` (the sample's group-normalised advantage), and ``weights`` (the aggregation:
1 for token-mean and seq-mean-token-sum, 1 / response length for seq-mean-token-mean). The
normaliser of a batch is its response-token count (token-mean) or its sequence count (seq-mean
modes: :func:`num_sequences`), summed over every rank and micro-batch by the caller.
"""

from __future__ import annotations

import numpy as np
import torch

from omniweave.data.packing.bins import pack
from omniweave.models.omni import cat_items
from omniweave.models.registry import MODALITIES
from omniweave.generation import Prompt, Rollout

IGNORE = -100


def _units(prompt_len: int, lengths: list[int], capacity: int) -> list[list[int]]:
    """A group's samples cut into runs whose documents fit one row together (in order)."""
    runs, run, used = [], [], 0
    for j, m in enumerate(lengths):
        n = prompt_len + m
        if n > capacity:
            raise ValueError(f"a prompt of {prompt_len} tokens + a response of {m} does not fit rl.update_max_len "
                             f"= {capacity}; raise it (or lower rl.max_new_tokens)")
        if run and used + n > capacity:
            runs.append(run)
            run, used = [], 0
        run.append(j)
        used += n
    return runs + ([run] if run else [])


def update_rows(prompts: list[Prompt], rollouts: list[Rollout], advantages: torch.Tensor, keep: list[int],
                group_size: int, capacity: int, loss_agg: str) -> list[dict]:
    """Rows (micro-batches) for the kept prompts (indices into ``prompts``; ``rollouts`` and
    ``advantages`` are prompt-major, sample j of prompt i at i·G + j)."""
    units = []  # (prompt index, sample indices, tokens)
    for i in keep:
        n = prompts[i].batch["input_ids"].shape[0]
        lengths = [len(rollouts[i * group_size + j].tokens) for j in range(group_size)]
        for run in _units(n, lengths, capacity):
            units.append((i, run, sum(n + lengths[j] for j in run)))
    if not units:
        return []
    plan = pack(np.array([u[2] for u in units], dtype=np.int64), capacity, "bfd")
    return [_row([units[k] for k in items.tolist()], prompts, rollouts, advantages, group_size, loss_agg)
            for items in plan.packs()]


def _row(units, prompts: list[Prompt], rollouts: list[Rollout], advantages, group_size: int, loss_agg: str) -> dict:
    ids, pos, labels, old, adv, weight, slot, lens = [], [], [], [], [], [], [], []
    media = {m: _Items() for m in MODALITIES}
    for i, samples, _ in units:
        b = prompts[i].batch
        n = b["input_ids"].shape[0]
        p_pos = b["position_ids"] if b["position_ids"].dim() == 2 else b["position_ids"][None]
        nxt = int(p_pos.max()) + 1
        prompt_rows = {m: items.prompt_rows(i, b, m) for m, items in media.items()}
        for j in samples:
            r = rollouts[i * group_size + j]
            m = len(r.tokens)
            resp = torch.tensor(r.tokens, dtype=torch.long)
            ids.append(torch.cat([b["input_ids"], resp]))
            pos.append(torch.cat([p_pos, (nxt + torch.arange(m)).expand(p_pos.shape[0], -1)], -1))
            lab = torch.full((n + m,), IGNORE, dtype=torch.long)
            lab[n - 1 : n + m - 1] = resp  # the row before each response token predicts it
            labels.append(lab)
            on = torch.zeros(n + m)
            old.append(torch.cat([on[: n - 1], torch.tensor(r.logprobs, dtype=torch.float32), on[:1]]))
            adv.append(torch.where(lab != IGNORE, float(advantages[i * group_size + j]), 0.0))
            w = 1.0 / m if loss_agg == "seq-mean-token-mean" else 1.0
            weight.append(torch.where(lab != IGNORE, w, 0.0))
            slot.append(torch.where(lab != IGNORE, len(lens) + 1, 0))  # 1 + the sequence's index in the row
            for modality, items in media.items():
                items.rows.append(torch.cat([prompt_rows[modality], torch.full((m,), -1, dtype=torch.long)]))
            lens.append(n + m)
    out = {
        "input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(pos, -1),
        "cu_seqlens": torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32),
        "token_data": {"old_logp": torch.cat(old), "advantages": torch.cat(adv), "weights": torch.cat(weight),
                       "seq_slot": torch.cat(slot)},
        "num_seqs": len(lens),
        "num_loss_tokens": int(sum(len(rollouts[i * group_size + j].tokens) for i, s, _ in units for j in s)),
    }
    for m, items in media.items():
        if items.grids:
            out.update({m.rows: torch.cat(items.rows), m.inputs: cat_items(items.inputs), m.grid: torch.cat(items.grids)})
        if items.sizes:
            out[m.sizes] = torch.cat(items.sizes)
    return out


class _Items:
    """One modality's items in a row: each prompt's once, and every document's feature rows."""

    def __init__(self):
        self.inputs, self.grids, self.sizes, self.rows, self.base, self.count = [], [], [], [], {}, 0

    def prompt_rows(self, i: int, b: dict, m) -> torch.Tensor:
        """Feature rows of prompt ``i`` (its items added to the row on first sight)."""
        if i not in self.base and b.get(m.grid) is not None and b[m.grid].shape[0]:
            self.base[i] = self.count
            self.inputs.append(b[m.inputs])
            self.grids.append(b[m.grid])
            if m.sizes and b.get(m.sizes) is not None:
                self.sizes.append(b[m.sizes])
            self.count += int(b[m.spans][:, 1].sum())
        rows = torch.full((b["input_ids"].shape[0],), -1, dtype=torch.long)
        if i in self.base:
            offset = self.base[i]
            for start, length in b[m.spans].reshape(-1, 2).tolist():
                rows[start : start + length] = torch.arange(offset, offset + length)
                offset += length
        return rows


def num_sequences(row: dict) -> int:
    """Responses in a row: its documents that carry labels (dummy rows have none)."""
    labelled = (row["labels"] != IGNORE).to(torch.int64).cumsum(0)
    ends = row["cu_seqlens"].to(torch.int64)
    per_doc = torch.cat([labelled.new_zeros(1), labelled])[ends]
    return int(((per_doc[1:] - per_doc[:-1]) > 0).sum())


def dummy_row(length: int, axes: int, pad_id: int = 0) -> dict:
    """A row that contributes nothing (no labels, zero weights): ranks with fewer update rows run
    these so that every rank runs the same number of micro-batches (FSDP's collectives)."""
    return {
        "input_ids": torch.full((length,), pad_id, dtype=torch.long),
        "labels": torch.full((length,), IGNORE, dtype=torch.long),
        "position_ids": torch.arange(length).expand(axes, -1).clone(),
        "cu_seqlens": torch.tensor([0, length], dtype=torch.int32),
        "feature_rows": torch.full((length,), -1, dtype=torch.long),
        "token_data": {**{k: torch.zeros(length) for k in ("old_logp", "advantages", "weights")},
                       "seq_slot": torch.zeros(length, dtype=torch.long)},
        "num_seqs": 0,
        "num_loss_tokens": 0,
    }
