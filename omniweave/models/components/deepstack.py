"""DeepStack (Qwen3-VL): features of intermediate vision layers added to the decoder's hidden
states at the media rows, level ``k`` right after decoder layer ``k``.

How it travels without the model knowing the family or the parallel layout: the encoder and
projector return ONE tensor per media feature, ``[N, D·(1+K)]`` = the features the embeddings take
(``[:, :D]``) followed by K DeepStack levels. Every hook that moves media features (the
context-parallel vision split, the tensor-parallel hand-off) therefore moves the levels with them
unchanged. ``OmniModel`` splits the tensor and hands the foundation a :class:`DeepStack` whose
``rows [L]`` say, for each row of (this rank's part of) the sequence, which feature it holds
(-1: text) — the same index the embedding scatter uses, so a context-parallel shard adds exactly
its own rows' levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def split_levels(features: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, D·(1+K)]`` -> (embedding features [N, D], DeepStack levels [K, N, D])."""
    n, width = features.shape
    if width % (1 + levels):
        raise ValueError(f"media features of width {width} cannot hold 1 + {levels} DeepStack levels")
    d = width // (1 + levels)
    return features[:, :d], features[:, d:].reshape(n, levels, d).transpose(0, 1)


@dataclass
class DeepStack:
    rows: torch.Tensor  # int64 [L]: feature index of each row, -1 for text
    levels: torch.Tensor  # [K, N, D]

    @property
    def num_levels(self) -> int:
        return self.levels.shape[0]

    def add(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """x [L, D] + level ``level``'s feature at every media row (out of place)."""
        if self.rows.shape[0] != x.shape[0]:
            raise ValueError(f"DeepStack rows ({self.rows.shape[0]}) do not match the decoder's {x.shape[0]} rows: "
                             "the feature rows must describe the rows this rank's decoder holds")  # fmt: skip
        feats = self.levels[level].to(x.dtype)[self.rows.clamp_min(0)]
        return x + torch.where((self.rows >= 0)[:, None], feats, torch.zeros_like(feats))
