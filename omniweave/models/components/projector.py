"""Projectors: vision encoder features -> the foundation's embedding space.

    projector(hidden [P, D_vis], grid_thw [M, 3]) -> features [N, D_llm]

``patch_merger``  Qwen2-VL / Qwen2.5-VL: norm each patch, concatenate each merge×merge block
                  (contiguous in the patch order, see ``media.patchify``) into one vector of
                  D_vis·merge², then Linear → GELU → Linear. N = P / merge². LayerNorm for
                  Qwen2-VL, RMSNorm for Qwen2.5-VL. (transformers keeps this inside the vision
                  tower as ``visual.merger``; our parameter names are the same, ``ln_q`` / ``mlp.0`` / ``mlp.2``.)
``mlp_adapter``   a plain Linear → GELU → Linear per patch, no merging (N = P), e.g. for
                  encoders whose tokens are already few.
``linear``        one Linear with bias per patch, no merging (N = P): PaliGemma's
                  ``multi_modal_projector.linear`` (hf/paligemma.py). Its output goes into the
                  embeddings unscaled (transformers 5 scales only looked-up token embeddings).

``out_dim`` is the foundation's hidden size and ``in_dim`` the encoder's; recipes set both with
interpolation (``${model.foundation.hidden_size}``) so one projector YAML serves every size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from omniweave.models.components.norm import RMSNorm
from omniweave.models.registry import register


@dataclass
class PatchMergerConfig:
    in_dim: int = 1280  # vision hidden size
    out_dim: int = 3584  # foundation hidden size
    merge_size: int = 2
    norm: str = "layernorm"  # layernorm (Qwen2-VL) | rmsnorm (Qwen2.5-VL)
    norm_eps: float = 1e-6


@dataclass
class MLPAdapterConfig:
    in_dim: int = 1280
    out_dim: int = 3584
    hidden_dim: int | None = None  # default: out_dim


@dataclass
class LinearProjectorConfig:
    in_dim: int = 1152  # vision hidden size
    out_dim: int = 2048  # foundation hidden size


class PatchMerger(nn.Module):
    def __init__(self, cfg: PatchMergerConfig):
        super().__init__()
        self.cfg = cfg
        self.merge_size = cfg.merge_size
        self.out_dim = cfg.out_dim
        merged = cfg.in_dim * cfg.merge_size**2
        if cfg.norm == "layernorm":
            self.ln_q = nn.LayerNorm(cfg.in_dim, eps=cfg.norm_eps)
        elif cfg.norm == "rmsnorm":
            self.ln_q = RMSNorm(cfg.in_dim, eps=cfg.norm_eps)
        else:
            raise ValueError(f"patch_merger norm {cfg.norm!r}: choose layernorm or rmsnorm")
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.out_dim))

    def init_weights(self, std: float = 0.02) -> None:
        from omniweave.models.components.vit import _init

        _init(self, std)

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """int64 [M]: output tokens per media item."""
        return grid_thw.to(torch.long).prod(-1) // self.merge_size**2

    def forward(self, hidden: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        unit = self.merge_size**2
        if hidden.shape[0] % unit:
            raise ValueError(f"{hidden.shape[0]} patches is not a multiple of merge_size² = {unit}")
        x = self.ln_q(hidden).reshape(-1, hidden.shape[-1] * unit)  # [P/m², D·m²]
        return self.mlp(x)


class MLPAdapter(nn.Module):
    def __init__(self, cfg: MLPAdapterConfig):
        super().__init__()
        self.cfg = cfg
        self.out_dim = cfg.out_dim
        hidden = cfg.hidden_dim or cfg.out_dim
        self.mlp = nn.Sequential(nn.Linear(cfg.in_dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.out_dim))

    def init_weights(self, std: float = 0.02) -> None:
        from omniweave.models.components.vit import _init

        _init(self, std)

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw.to(torch.long).prod(-1)

    def forward(self, hidden: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp(hidden)


class LinearProjector(nn.Module):
    def __init__(self, cfg: LinearProjectorConfig):
        super().__init__()
        self.cfg = cfg
        self.out_dim = cfg.out_dim
        self.linear = nn.Linear(cfg.in_dim, cfg.out_dim, bias=True)

    def init_weights(self, std: float = 0.02) -> None:
        from omniweave.models.components.vit import _init

        _init(self, std)

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw.to(torch.long).prod(-1)

    def forward(self, hidden: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(hidden)


register("projector", "patch_merger", PatchMergerConfig)(PatchMerger)
register("projector", "mlp_adapter", MLPAdapterConfig)(MLPAdapter)
register("projector", "linear", LinearProjectorConfig)(LinearProjector)
