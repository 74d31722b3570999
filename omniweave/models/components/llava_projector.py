"""LLaVA-OneVision's projector (``llava_onevision_mlp``): a 2-layer MLP per patch, then each item's
features laid out as transformers' ``LlavaOnevisionModel`` lays them out.

    projector(hidden [P, D_vis], grid_thw)           -> [P, D]        linear_1 -> GELU -> linear_2, per row
    projector(that, grid_thw, image_sizes, arrange=True) -> [N, D]    per whole item (after any split)

Items (``grid_thw = (t, s, s)``, s = image_size // patch_size; ``image_sizes`` the item's own
(height, width), (0, 0) for a video — data/loading/loader.py):

- an image tiled "anyres" (t = 1 + rows·cols: the base tile, then the grid's tiles row-major): the
  base tile's s² rows; then the grid's feature map (rows·s × cols·s) with the padding cut off
  (``unpad_image``), bilinearly shrunk when larger than ``anyres_max_N`` allows, one
  ``image_newline`` after each of its rows (``pack_image_features``; the layout and counts are
  data/media/anyres.py's ``model_feature_grid``, tested against transformers on ~6000 sizes);
- an image of one tile (t = 1: an image of a multi-image sample): its s² rows and one newline;
- a video (size (0, 0)): each frame's s × s map bilinearly pooled to ⌈s/2⌉ × ⌈s/2⌉
  (``apply_pooling``), one newline after the last frame.

The MLP is per row, so a split of an item's tiles or frames across ranks (CP's vision split) only
needs the layout to run after the features are gathered, which ``OmniModel.encode_media`` does (through
``forward``, so that an FSDP unit of the projector gathers ``image_newline`` around it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniweave.data.media.anyres import AnyresConfig, model_feature_grid
from omniweave.models.components.mlp import activation
from omniweave.models.components.vit import _init
from omniweave.models.registry import register


@dataclass
class LlavaOnevisionProjectorConfig:
    in_dim: int = 1152  # vision hidden size
    out_dim: int = 3584  # foundation hidden size
    act: str = "gelu"  # HF: projector_hidden_act
    image_size: int = 384  # a tile's side in pixels (the tower's image_size)
    patch_size: int = 14
    anyres_grid: int = 6  # pinpoints: every (i, j) x image_size, 1 <= i, j <= anyres_grid, height-major
    anyres_max: int = 9  # HF vision_aspect_ratio "anyres_max_9": grids past 9 tiles' worth of features shrink

    def pinpoints(self) -> tuple[tuple[int, int], ...]:
        side = range(self.image_size, self.image_size * self.anyres_grid + 1, self.image_size)
        return tuple((h, w) for h in side for w in side)

    def anyres(self) -> AnyresConfig:
        return AnyresConfig(tile=self.image_size, patch=self.patch_size, pinpoints=self.pinpoints(),
                            vision_aspect_ratio=f"anyres_max_{self.anyres_max}")  # fmt: skip


class LlavaOnevisionProjector(nn.Module):
    uses_sizes = True  # num_tokens / the layout read each item's own size (registry.Modality.sizes)
    arranges = True  # OmniModel calls it a second time on whole items: projector(features, grid, sizes, arrange=True)

    def __init__(self, cfg: LlavaOnevisionProjectorConfig):
        super().__init__()
        self.cfg = cfg
        self.anyres = cfg.anyres()
        self.merge_size = 1
        self.out_dim = cfg.out_dim
        self.linear_1 = nn.Linear(cfg.in_dim, cfg.out_dim)
        self.act = activation(cfg.act)
        self.linear_2 = nn.Linear(cfg.out_dim, cfg.out_dim)
        self.image_newline = nn.Parameter(torch.zeros(cfg.out_dim))

    def init_weights(self, std: float = 0.02) -> None:
        _init(self, std)
        with torch.no_grad():
            nn.init.normal_(self.image_newline, std=1 / math.sqrt(self.cfg.out_dim))  # transformers' init

    def forward(self, hidden: torch.Tensor, grid_thw: torch.Tensor | None = None, sizes: torch.Tensor | None = None,
                arrange: bool = False) -> torch.Tensor:
        """The MLP per row; with ``arrange`` the layout of whole items instead (``arrange_items``).
        Both go through forward so that the module's FSDP unit gathers ``image_newline`` for the layout."""
        if arrange:
            return self.arrange_items(hidden, grid_thw, sizes)
        return self.linear_2(self.act(self.linear_1(hidden)))

    # ---- per-item layout ------------------------------------------------------------
    @staticmethod
    def _items(grid_thw: torch.Tensor, sizes: torch.Tensor | None) -> list[tuple[int, int, int, int, int]]:
        grid = grid_thw.to(torch.long).tolist()
        if sizes is None:
            if any(t > 1 for t, _, _ in grid):
                raise ValueError("llava_onevision_mlp: items of several tiles need image_sizes (their own size)")
            sizes_l = [[1, 1]] * len(grid)  # single tiles (the no-media dummy) need no size
        else:
            sizes_l = sizes.to(torch.long).reshape(-1, 2).tolist()
            if len(sizes_l) != len(grid):
                raise ValueError(f"image_sizes has {len(sizes_l)} rows for {len(grid)} items (grid_thw)")
        return [(t, h, w, sh, sw) for (t, h, w), (sh, sw) in zip(grid, sizes_l)]

    def _item_tokens(self, t: int, h: int, w: int, height: int, width: int) -> int:
        if height == 0 and width == 0:  # a video: pooled frames + one newline
            return t * math.ceil(h / 2) * math.ceil(w / 2) + 1
        if t == 1:
            return h * w + 1
        grid = model_feature_grid(height, width, self.anyres)
        if 1 + grid.rows * grid.cols != t or (h, w) != (self.anyres.side,) * 2:
            raise ValueError(f"llava_onevision_mlp: an image of {height}x{width} tiles into 1 + {grid.rows}x{grid.cols} "
                             f"tiles of {self.anyres.side}² patches, its grid_thw is {(t, h, w)}")  # fmt: skip
        return grid.tokens(self.anyres.side)

    def num_tokens(self, grid_thw: torch.Tensor, sizes: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [M]: output tokens per item (module doc)."""
        return torch.tensor([self._item_tokens(*item) for item in self._items(grid_thw, sizes)], dtype=torch.long)

    def arrange_items(self, features: torch.Tensor, grid_thw: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
        """[P, D] per-patch features of whole items (span order) -> [N, D] laid out (module doc)."""
        out, start = [], 0
        newline = self.image_newline.to(features.dtype)
        for t, h, w, height, width in self._items(grid_thw, sizes):
            item = features[start:start + t * h * w]
            start += t * h * w
            if height == 0 and width == 0:  # video
                maps = item.reshape(t, h, w, -1).permute(0, 3, 1, 2)
                pooled = F.interpolate(maps, size=[math.ceil(h / 2), math.ceil(w / 2)], mode="bilinear")
                out += [pooled.permute(0, 2, 3, 1).reshape(-1, item.shape[-1]), newline[None]]
            elif t == 1:
                out += [item, newline[None]]
            else:
                out += [item[:h * w], self._unpadded(item[h * w:], h, height, width, newline)]
        if start != features.shape[0]:
            raise ValueError(f"llava_onevision_mlp: {features.shape[0]} features for items of {start} patches")
        return torch.cat(out)

    def _unpadded(self, tiles: torch.Tensor, side: int, height: int, width: int, newline: torch.Tensor) -> torch.Tensor:
        """The grid tiles' features [rows·cols·s², D] -> the unpadded (and shrunk) map with a
        newline after each row, flattened row-major: transformers' ``pack_image_features``."""
        g = model_feature_grid(height, width, self.anyres)
        dim = tiles.shape[-1]
        fmap = tiles.reshape(g.rows, g.cols, side, side, dim).permute(4, 0, 2, 1, 3).reshape(dim, g.rows * side, g.cols * side)
        top, bottom, left, right = g.crop
        fmap = fmap[:, top:bottom, left:right]
        if g.interpolated:
            fmap = F.interpolate(fmap[None], [g.new_h, g.new_w], mode="bilinear")[0]
        fmap = torch.cat([fmap, newline[:, None, None].expand(dim, fmap.shape[1], 1)], dim=-1)
        return fmap.flatten(1).transpose(0, 1)


register("projector", "llava_onevision_mlp", LlavaOnevisionProjectorConfig)(LlavaOnevisionProjector)
