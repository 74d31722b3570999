"""Audio projectors: audio encoder rows -> the foundation's embedding space.

    projector(hidden [N, d], audio_lengths [A]) -> features [N, D_text]     (one row in, one row out)
    projector.num_tokens(audio_lengths) -> int64 [A]                        (rows per item)

``linear``    Qwen2-Audio's ``multi_modal_projector.linear`` (with bias).
``identity``  Qwen2.5-Omni: its tower already ends in ``proj`` to the text width.

The row count per item is the encoder's (``data/audio.encoder_tokens``: conv stride 2, AvgPool 2),
so the projector answers ``num_tokens`` for the model's span checks without asking the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from omniweave.data.media.audio import encoder_tokens
from omniweave.models.registry import register


@dataclass
class LinearAudioProjectorConfig:
    in_dim: int = 1280  # audio encoder hidden size
    out_dim: int = 4096  # foundation hidden size


@dataclass
class IdentityAudioProjectorConfig:
    dim: int = 3584  # the encoder's output_dim = the foundation's hidden size


class AudioProjector(nn.Module):
    """Base: rows per item and the shared init hook."""

    def num_tokens(self, audio_lengths: torch.Tensor) -> torch.Tensor:
        """int64 [A]: output rows per audio item."""
        return encoder_tokens(audio_lengths.to(torch.long))

    def init_weights(self, std: float = 0.02) -> None:
        from omniweave.models.components.vit import _init

        _init(self, std)


class LinearAudioProjector(AudioProjector):
    def __init__(self, cfg: LinearAudioProjectorConfig):
        super().__init__()
        self.cfg = cfg
        self.out_dim = cfg.out_dim
        self.linear = nn.Linear(cfg.in_dim, cfg.out_dim, bias=True)

    def forward(self, hidden: torch.Tensor, audio_lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(hidden)


class IdentityAudioProjector(AudioProjector):
    def __init__(self, cfg: IdentityAudioProjectorConfig):
        super().__init__()
        self.cfg = cfg
        self.out_dim = cfg.dim

    def forward(self, hidden: torch.Tensor, audio_lengths: torch.Tensor | None = None) -> torch.Tensor:
        if hidden.shape[-1] != self.out_dim:
            raise ValueError(f"identity audio projector: rows of width {hidden.shape[-1]}, configured dim {self.out_dim}")
        return hidden


register("audio_projector", "linear", LinearAudioProjectorConfig)(LinearAudioProjector)
register("audio_projector", "identity", IdentityAudioProjectorConfig)(IdentityAudioProjector)
