"""The Qwen3-VL vision tower (``qwen3_vit``) and its merger with DeepStack (``qwen3_merger``).

    encoder(pixel_values [P, C·t·p·p], grid_thw [M, 3]) -> [P, D_vis·(1+K)]
    projector(that, grid_thw)                           -> [N, D·(1+K)]      N = P / merge²

The tower is the Qwen2-VL one (``vit.py``: LayerNorm blocks, fused qkv, per-frame attention,
2-D rotary) with a gelu-tanh MLP, patch 16 with a biased patch embedding, and a learned absolute
position table ``pos_embed`` [S², D_vis] (S = 48 for the real tower) resampled bilinearly
(align_corners) to each item's patch grid, in the merge-block patch order (:func:`pos_embed_taps`,
transformers' ``get_vision_interpolation_indices_and_weights``). It also returns the hidden
states after each block of ``deepstack_visual_indexes`` (K of them), concatenated after the
final ones along the feature dim.

The projector merges the final states with ``merger`` (LayerNorm over D_vis, then the 2×2
shuffle, fc1 → GELU → fc2) and level k with ``deepstack_merger_list[k]`` (the shuffle first,
LayerNorm over 4·D_vis: transformers' ``use_postshuffle_norm``). How the levels reach the
decoder: components/deepstack.py. Parameter names equal transformers' ``visual.*`` ones except
the MLP (``mlp.fc1/fc2`` here, ``mlp.linear_fc1/2`` there) and the mergers living under
``projector.`` (adapter: models/hf/qwen3_vl.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from omniweave.models.components.rope import vision_position_ids
from omniweave.models.components.vit import (Qwen2ViTConfig, VisionTransformer, _init, check_patch_count,
                                             vision_cu_seqlens)  # fmt: skip
from omniweave.models.registry import register


@dataclass
class Qwen3ViTConfig(Qwen2ViTConfig):
    """Qwen3-VL vision tower (defaults: the real tower of Qwen3-VL 8B / 30B-A3B)."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    patch_size: int = 16
    mlp: str = "gelu_tanh"
    patch_bias: bool = True
    num_position_embeddings: int = 2304  # a square table: 48 x 48
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])

    def __post_init__(self):
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings={self.num_position_embeddings} is not a square")
        idx = list(self.deepstack_visual_indexes)
        if idx != sorted(set(idx)) or any(not 0 <= i < self.depth for i in idx):
            raise ValueError(f"deepstack_visual_indexes {idx}: increasing block indexes in 0..depth-1={self.depth - 1}")
        if self.window_size or self.norm != "layernorm":
            raise ValueError("qwen3_vit: LayerNorm blocks without window attention (window_size: null)")


@dataclass
class Qwen3MergerConfig:
    in_dim: int = 1152  # vision hidden size
    out_dim: int = 4096  # foundation hidden size
    merge_size: int = 2
    deepstack_levels: int = 3  # = len(image_encoder.deepstack_visual_indexes)
    norm_eps: float = 1e-6


# ----------------------------------------------------------------------------- index helpers (pure)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps [n, 2] into a ``side``-long axis and their weights, for
    positions ``index`` on axes of length ``size`` (per element)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def pos_embed_taps(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 [P, 4], weights fp32 [P, 4]) into the flattened ``side × side`` position
    table: each patch's bilinear resample of the table to its item's (h, w) grid, patches in the
    merge-block order of ``media.patchify``, repeated for each frame."""
    rc = vision_position_ids(grid_thw, merge)  # [P, 2] (row, col)
    counts = grid_thw.prod(-1)
    heights = torch.repeat_interleave(grid_thw[:, 1], counts)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts)
    h_taps, h_w = _axis_taps(rc[:, 0], heights, side)
    w_taps, w_w = _axis_taps(rc[:, 1], widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return indices, weights


def qwen3_vl_model_type(foundation_cfg) -> str:
    """The HF family a model with this tower exports as: Qwen3.5 over its hybrid decoder, else
    Qwen3-VL; the MoE one when the decoder has experts."""
    base = "qwen3_5" if getattr(foundation_cfg, "family", None) == "qwen3_5" else "qwen3_vl"
    return f"{base}_moe" if getattr(foundation_cfg, "num_experts", 0) else base


# ----------------------------------------------------------------------------- modules


class Qwen3VisionTransformer(VisionTransformer):
    def __init__(self, cfg: Qwen3ViTConfig):
        super().__init__(cfg)
        self.hf_model_type = qwen3_vl_model_type  # OmniModel.hf_model_type asks it with the foundation config
        self.deepstack_levels = len(cfg.deepstack_visual_indexes)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = round(cfg.num_position_embeddings**0.5)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, C·t·p·p], grid_thw int [M, 3] -> [P, D·(1+K)]: final hidden states,
        then those after each DeepStack block."""
        grid_thw = check_patch_count(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # [P, D]
        grid = grid_thw.to(x.device)
        index, weight = pos_embed_taps(grid, self.side, self.merge_size)
        x = x + (self.pos_embed(index) * weight[:, :, None]).sum(1).to(x.dtype)
        cos, sin = self.rotary(grid, self.merge_size)
        cu_seqlens = vision_cu_seqlens(grid_thw).to(x.device)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, cos, sin)
            if i in self.cfg.deepstack_visual_indexes:
                levels.append(x)
        return torch.cat([x, *levels], dim=-1)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        _init(self, std)
        nn.init.normal_(self.pos_embed.weight, std=std)


class Merger(nn.Module):
    """[P, D_vis] -> [P/merge², out]: LayerNorm (before the shuffle, or after it with
    ``postshuffle``), merge² neighbours concatenated, fc1 → GELU → fc2."""

    def __init__(self, cfg: Qwen3MergerConfig, postshuffle: bool):
        super().__init__()
        self.merged = cfg.in_dim * cfg.merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else cfg.in_dim, eps=cfg.norm_eps)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3Projector(nn.Module):
    def __init__(self, cfg: Qwen3MergerConfig):
        super().__init__()
        self.cfg = cfg
        self.merge_size = cfg.merge_size
        self.out_dim = cfg.out_dim
        self.deepstack_levels = cfg.deepstack_levels
        self.merger = Merger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, postshuffle=True) for _ in range(cfg.deepstack_levels))

    def init_weights(self, std: float = 0.02) -> None:
        _init(self, std)

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """int64 [M]: output tokens per media item."""
        return grid_thw.to(torch.long).prod(-1) // self.merge_size**2

    def forward(self, hidden: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """[P, D_vis·(1+K)] -> [N, out·(1+K)] (merged features, then the K DeepStack levels)."""
        unit, width = self.merge_size**2, self.cfg.in_dim * (1 + self.deepstack_levels)
        if hidden.shape[0] % unit or hidden.shape[-1] != width:
            raise ValueError(f"qwen3_merger: input [{hidden.shape[0]}, {hidden.shape[-1]}] needs a multiple of "
                             f"merge_size² = {unit} patches of width in_dim·(1+deepstack_levels) = {width}")  # fmt: skip
        parts = hidden.split(self.cfg.in_dim, dim=-1)
        outs = [self.merger(parts[0])] + [m(p) for m, p in zip(self.deepstack_merger_list, parts[1:])]
        return torch.cat(outs, dim=-1)


register("image_encoder", "qwen3_vit", Qwen3ViTConfig)(Qwen3VisionTransformer)
register("projector", "qwen3_merger", Qwen3MergerConfig)(Qwen3Projector)
