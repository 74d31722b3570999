"""InternVL's vision tower (``intern_vit``) and its pixel-shuffle projector (``pixel_shuffle_mlp``).

    encoder(pixel_values [P, C·p·p], grid_thw [M, 3]) -> [P, D_vis]      (CLS rows dropped)
    projector(that, grid_thw)                         -> [P / s², D]     s = 1 / downsample_ratio

An item's ``t`` counts tiles (InternVL's dynamic tiling: data/media/tiling.py; a video's frames,
one tile each), ``h × w`` the patches of one tile, in raster order (row-major; the Conv2d patch
embedding's order). Each tile is one attention segment of ``1 + h·w`` rows: a learned CLS row in
front, absolute position embeddings added (the table ``[1 + S², D]`` resampled bicubically to
``h × w`` when the tile is not the S × S the table was trained for, as transformers'
``interpolate_pos_encoding`` does), then pre-norm blocks with layer scale (``lambda_1``,
``lambda_2``) and, where the config has it, RMS QK-norm over all heads (InternViT-6B). The CLS
rows are dropped at the end (``vision_feature_select_strategy: default``).

The projector is transformers' ``pixel_shuffle`` (each s × s block of a tile's feature map into
one row of s²·D_vis channels, in its exact channel order) → LayerNorm → Linear → GELU → Linear.
Tiles are independent, so encoding tiles [t0, t1) of an item alone gives exactly its feature rows
[t0·h·w/s², t1·h·w/s²): the context-parallel vision split cuts items at tiles unchanged.

Parameter names: the blocks are ``blocks.*`` (FSDP / activation checkpointing from outside) with a
fused ``attn.qkv`` (the Qwen ViT's TP plan applies); models/hf/internvl.py maps transformers'
``vision_tower.*`` / ``multi_modal_projector.*`` names both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from omniweave.models.components.attention import attn
from omniweave.models.components.mlp import MLP, activation
from omniweave.models.components.norm import RMSNorm
from omniweave.models.components.vit import _init, _norm, check_patch_count
from omniweave.models.registry import register


@dataclass
class InternViTConfig:
    """InternViT (defaults: InternViT-300M-448px-V2.5, the tower of InternVL3 / 3.5 up to 38B)."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    in_channels: int = 3
    patch_size: int = 14
    image_size: int = 448  # the tile side the position table was trained for
    norm: str = "layernorm"  # layernorm | rmsnorm (InternViT-6B)
    norm_eps: float = 1e-6
    qk_norm: bool = False  # RMSNorm over q and k, all heads at once (InternViT-6B)
    qkv_bias: bool = True  # HF: attention_bias
    mlp: str = "gelu"
    layer_scale_init: float = 0.1
    final_norm: bool = False  # HF: not use_mean_pooling (a LayerNorm after the last block)
    merge_size: int = 2  # the projector's pixel-shuffle factor (the smallest dummy tile)
    attn_backend: str = "auto"

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"intern_vit image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def in_dim(self) -> int:
        return self.in_channels * self.patch_size**2

    @property
    def side(self) -> int:  # the position table is side × side patches (+ CLS)
        return self.image_size // self.patch_size


@dataclass
class PixelShuffleMLPConfig:
    in_dim: int = 1024  # vision hidden size
    out_dim: int = 4096  # foundation hidden size
    merge_size: int = 2  # 1 / downsample_ratio
    norm_eps: float = 1e-5  # nn.LayerNorm's default, as transformers builds it
    act: str = "gelu"


# ----------------------------------------------------------------------------- index helpers (pure)


def tile_layout(grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens int32 [T+1] over the tiles' ``1 + h·w`` rows, is_cls bool [P + T]) for the
    sequence with one CLS row in front of each tile's patches (T tiles in all)."""
    sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]) + 1
    cu = F.pad(sizes.cumsum(0, dtype=torch.int32), (1, 0))
    is_cls = torch.zeros(int(cu[-1]), dtype=torch.bool, device=grid_thw.device)
    is_cls[cu[:-1].long()] = True
    return cu, is_cls


class InternAttention(nn.Module):
    def __init__(self, cfg: InternViTConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} not divisible by num_heads {cfg.num_heads}")
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.hidden_size, eps=1e-6) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.hidden_size, eps=1e-6) if cfg.qk_norm else None
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.backend = cfg.attn_backend

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:  # x [R, D]
        R = x.shape[0]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.q_norm is not None:  # over all heads' channels together, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(R, -1, self.head_dim) for t in (q, k, v))
        out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, causal=False, backend=self.backend, need_lse=False)
        return self.proj(out.reshape(R, -1))


class InternBlock(nn.Module):
    def __init__(self, cfg: InternViTConfig):
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg, cfg.hidden_size), _norm(cfg, cfg.hidden_size)
        self.attn = InternAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.mlp, bias=True)
        self.lambda_1 = nn.Parameter(torch.full((cfg.hidden_size,), cfg.layer_scale_init))
        self.lambda_2 = nn.Parameter(torch.full((cfg.hidden_size,), cfg.layer_scale_init))
        self.layer_scale_init = cfg.layer_scale_init

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attn(self.norm1(x), cu_seqlens)
        return x + self.lambda_2 * self.mlp(self.norm2(x))


class InternVisionTransformer(nn.Module):
    def __init__(self, cfg: InternViTConfig):
        super().__init__()
        self.cfg = cfg
        self.hf_model_type = "internvl"
        self.out_dim = cfg.hidden_size
        self.merge_size = cfg.merge_size
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, 1 + cfg.side**2, cfg.hidden_size))
        self.blocks = nn.ModuleList(InternBlock(cfg) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.final_norm else None

    def _patch_positions(self, h: int, w: int) -> torch.Tensor:
        """[h·w, D]: the table's patch rows for an h × w tile (bicubic resample unless it is the table's own)."""
        table = self.position_embeddings[0, 1:]
        if (h, w) == (self.cfg.side, self.cfg.side):
            return table
        grid = table.reshape(1, self.cfg.side, self.cfg.side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(h * w, -1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, C·p·p] (tiles' patches, raster order), grid_thw int [M, 3] -> [P, D]."""
        grid_thw = check_patch_count(pixel_values, grid_thw)
        w = self.patch_embed.weight
        x = F.linear(pixel_values.to(w.dtype), w.flatten(1), self.patch_embed.bias)  # [P, D]
        positions = torch.cat([self._patch_positions(h, wd).repeat(t, 1) for t, h, wd in grid_thw.tolist()])
        x = x + positions.to(x.dtype)
        cu_seqlens, is_cls = tile_layout(grid_thw.to(x.device))
        cls = (self.cls_token[0] + self.position_embeddings[0, :1]).to(x.dtype)  # [1, D]
        slot = torch.cumsum(~is_cls, 0) - 1  # each patch row's index in x
        x = torch.where(is_cls[:, None], cls, x[slot.clamp_min(0)])  # [P + T, D]
        for block in self.blocks:
            x = block(x, cu_seqlens)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x[~is_cls]

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights (after ``to_empty`` from the meta device)."""
        _init(self, std)
        nn.init.normal_(self.patch_embed.weight, std=std)
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.zeros_(self.cls_token)
        nn.init.normal_(self.position_embeddings, std=std)
        for block in self.blocks:
            nn.init.constant_(block.lambda_1, block.layer_scale_init)
            nn.init.constant_(block.lambda_2, block.layer_scale_init)
            for norm in (block.attn.q_norm, block.attn.k_norm):
                if norm is not None:
                    norm.reset_parameters()
        if self.final_norm is not None:
            self.final_norm.reset_parameters()

    def dummy_input(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid item (one tile of merge × merge zero patches), for rows without media."""
        m = self.merge_size
        return torch.zeros(m * m, self.cfg.in_dim, device=device), torch.tensor([[1, m, m]], device=device)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[T, h, w, C] -> [T, h/s, w/s, C·s²]: transformers' ``InternVLModel.pixel_shuffle`` with
    ``scale_factor = 1/s`` step by step (its channel order is what the projector was trained on)."""
    T, h, w, C = x.shape
    x = x.reshape(T, h, w // scale, C * scale).permute(0, 2, 1, 3)
    x = x.reshape(T, w // scale, h // scale, C * scale * scale).permute(0, 2, 1, 3)
    return x


class PixelShuffleMLP(nn.Module):
    def __init__(self, cfg: PixelShuffleMLPConfig):
        super().__init__()
        self.cfg = cfg
        self.merge_size = cfg.merge_size
        self.out_dim = cfg.out_dim
        merged = cfg.in_dim * cfg.merge_size**2
        self.layer_norm = nn.LayerNorm(merged, eps=cfg.norm_eps)
        self.linear_1 = nn.Linear(merged, cfg.out_dim)
        self.act = activation(cfg.act)
        self.linear_2 = nn.Linear(cfg.out_dim, cfg.out_dim)

    def init_weights(self, std: float = 0.02) -> None:
        _init(self, std)

    def num_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """int64 [M]: output tokens per media item (per tile h·w / s²)."""
        return grid_thw.to(torch.long).prod(-1) // self.merge_size**2

    def forward(self, hidden: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[P, D_vis] (tiles' patches in raster order) -> [P / s², out]."""
        s, parts = self.merge_size, []
        grid = grid_thw.to(torch.long).tolist()
        if any(h % s or w % s for _, h, w in grid):
            raise ValueError(f"pixel_shuffle_mlp: tile grids {grid} must have sides divisible by merge_size {s}")
        start = 0
        for t, h, w in grid:  # items of one tile size at a time; tiles are independent
            n = t * h * w
            parts.append(pixel_shuffle(hidden[start:start + n].reshape(t, h, w, -1), s).reshape(n // (s * s), -1))
            start += n
        x = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


register("image_encoder", "intern_vit", InternViTConfig)(InternVisionTransformer)
register("projector", "pixel_shuffle_mlp", PixelShuffleMLPConfig)(PixelShuffleMLP)
