"""Split the audio encoder's work over the ranks of a context-parallel group.

As for vision (``vision.py``), every rank of the group holds the same audio items
(``audio_features [A, n_mels, W]``, ``audio_lengths [A]``) but only a shard of the tokens; each
rank encodes a share of the items and the features are all-gathered. An item is one encoder call
unit (a <= 30 s Qwen2-Audio window, a whole Qwen2.5-Omni clip): nothing in an audio tower crosses
items, so encoding a subset of the items gives exactly those items' features.

Plan (pure, identical on every rank):
    cost      n² + 6·D·n per item, n = its frames after the conv stem ((L-1)//2+1): attention is
              quadratic in them, the linear layers ~6·D·n (D = the tower's width)
    assign    longest-processing-time first: items by cost descending (ties: item order), each to
              the least loaded rank (ties: lowest rank); a rank encodes its items in item order

Forward on rank r (``AudioSplit``, an ``OmniModel.media_splits["audio"]`` hook):
    local    = encode(audio_features[mine], audio_lengths[mine])     [n_r, D_out]
               (no items: the dummy item, local = [0, D_out] + 0·Σ dummy, so every rank runs the
                encoder once and FSDP collectives stay matched)
    features = all_gather_rows(local) put back in item order          [N, D_out]
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from omniweave.parallel.context.vision import all_gather_rows, gather_counts


def item_cost(frames: int, hidden_size: int) -> int:
    """Relative cost of encoding one audio item of ``frames`` valid mel frames."""
    n = (frames - 1) // 2 + 1
    return n * n + 6 * hidden_size * n


def plan_audio_split(lengths: list[int], cp: int, hidden_size: int = 1280) -> list[list[int]]:
    """Per rank, the items (indices, ascending) it encodes; every item exactly once."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be an integer >= 1, got {cp!r}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"audio_lengths {lengths}: every item needs >= 1 frame")
    loads, own = [0] * cp, [[] for _ in range(cp)]
    for item in sorted(range(len(lengths)), key=lambda i: (-item_cost(lengths[i], hidden_size), i)):
        rank = min(range(cp), key=lambda r: (loads[r], r))
        loads[rank] += item_cost(lengths[item], hidden_size)
        own[rank].append(item)
    return [sorted(items) for items in own]


class AudioSplit:
    """``media_splits["audio"]`` hook: each rank of ``group`` encodes its items
    (``plan_audio_split``); features are all-gathered and returned in item order.

    ``dummy_input(device) -> (audio_features, audio_lengths)`` is the encoder's smallest item,
    ``num_tokens(audio_lengths) -> [A]`` the features per item (the projector's), ``hidden_size``
    the tower width used in the cost model."""

    def __init__(self, group, dummy_input: Callable, num_tokens: Callable, hidden_size: int):
        self.group, self.dummy_input, self.num_tokens, self.hidden_size = group, dummy_input, num_tokens, hidden_size

    def __call__(self, encode: Callable, audio_features: torch.Tensor, audio_lengths: torch.Tensor) -> torch.Tensor:
        lengths = audio_lengths.reshape(-1).tolist()
        if not lengths:
            raise ValueError("AudioSplit needs at least one audio item (audio_lengths is empty)")
        if audio_features.shape[0] != len(lengths):
            raise ValueError(f"audio_features holds {audio_features.shape[0]} items, audio_lengths {len(lengths)}")
        plan = plan_audio_split(lengths, dist.get_world_size(self.group), self.hidden_size)
        mine = plan[dist.get_rank(self.group)]
        if mine:
            index = torch.tensor(mine, device=audio_lengths.device)
            local = encode(audio_features.index_select(0, index.to(audio_features.device)), audio_lengths.index_select(0, index))
        else:
            dummy = encode(*self.dummy_input(audio_features.device))
            local = dummy.new_zeros(0, dummy.shape[-1]) + 0.0 * dummy.sum()
        counts = gather_counts(local.shape[0], self.group, local.device)
        per_item = self.num_tokens(audio_lengths).reshape(-1).tolist()
        expected = [sum(per_item[i] for i in own) for own in plan]
        if expected != counts:
            raise ValueError(f"audio features per rank {counts} != the items' token counts {expected} "
                             f"(audio_lengths {lengths}, items per rank {plan})")  # fmt: skip
        first = torch.tensor([0, *per_item]).cumsum(0).tolist()
        source, row = torch.empty(sum(per_item), dtype=torch.int64), 0
        for own in plan:
            for i in own:
                source[first[i]:first[i] + per_item[i]] = torch.arange(row, row + per_item[i])
                row += per_item[i]
        return all_gather_rows(local, self.group, counts).index_select(0, source.to(local.device))
