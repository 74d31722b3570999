"""LLaVA-OneVision "anyres" images: the tile grid, the feature (token) counts, the pixels.

transformers 5.24's ``llava_onevision`` splits the work three ways, and this module reproduces
each part as pure functions (header-only where no pixel is needed):

- ``LlavaOnevisionImageProcessorPil`` (pixels): the best resolution among ``pinpoints``
  (``select_best_resolution``: most effective pixels, then least waste, first listed on a tie),
  the image resized keeping its aspect to fit it (PIL bicubic on uint8, sides rounded UP:
  ``patch_output_size``), centred on a zero (black) canvas of that size, cut into ``tile`` x ``tile``
  tiles row-major; in front of them the base tile, the whole image resized to ``tile`` x ``tile``.
  Each tile rescaled (/255 in float64, to float32) and normalised ((x - mean) / std, float32).
- ``LlavaOnevisionModel.pack_image_features`` (features): the base tile's ``side²`` rows, then the
  grid's feature map (``rows·side`` x ``cols·side``) with the padding rows / columns cut off
  (``unpad_image``: the image's extent at feature resolution, rounded DOWN after
  ``round(·, 7)``, centred; ``crop``), bilinearly shrunk by ``ratio`` when it holds more than 1.1²
  times ``max_tiles·side²`` features ("anyres_max_9"), and one newline row after each row:
  ``side² + new_h·(new_w + 1)`` features (``model_feature_grid``).
- ``LlavaOnevisionProcessor._get_number_of_features`` (the ``<image>`` tokens it writes): the same
  rule written a second time over integers (``processor_feature_tokens``).

The two counts agree on every size tried (tests/test_anyres.py runs the model's
``pack_image_features`` on ~1000 sizes in three configurations, 1 px to 8000 px sides: tall, wide, tiny, the max grid,
the unpad rounding edges): transformers 5.24's processor formula is the model's rule expression for
expression (the same float divisions, the same ``round(·, 7)`` before truncating, the same
``int(x // ratio)``), so no size yields "Image features and image tokens do not match".
``image_feature_tokens`` counts what the model produces (``model_feature_grid``);
``processor_feature_tokens`` is the processor's formula, kept to test that claim.

A multi-image sample (more than one image in one conversation) is not tiled: the image padded to
a square with the mean colour and resized to one tile, ``side² + 1`` features
(``process_square_image``, ``square_image_tokens``). A video frame is one tile pooled 2x2
(bilinear to ``ceil(side/2)²``), one newline after the whole video: ``video_feature_tokens``.

Tiles reach the encoder as ``tiles_to_patches`` rows: each tile's ``(tile // patch)²`` patches in
raster order, a row laid out (C, p, p) as a ``Conv2d(3, D, p, stride=p)`` reads it. SigLIP's
``padding="valid"`` convolution never reads the last ``tile % patch`` pixel rows and columns
(384 = 27·14 + 6), so they are dropped here. The encoder item of an image is
``grid_thw = (1 + rows·cols, side, side)`` (``anyres_grid_thw``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image

from omniweave.data.media.tiling import tile_patches
from omniweave.data.media.vision import MediaError, resize_normalize



def square_pinpoints(tile: int, grid: int) -> tuple[tuple[int, int], ...]:
    """Every (i·tile, j·tile) for 1 <= i, j <= grid, height-major: the released pinpoints' shape."""
    return tuple((i * tile, j * tile) for i in range(1, grid + 1) for j in range(1, grid + 1))


# llava-onevision-qwen2-{0.5b,7b,72b}-ov-hf preprocessor_config.json: 384..2304 in steps of 384, height-major
DEFAULT_PINPOINTS: tuple[tuple[int, int], ...] = square_pinpoints(384, 6)


@dataclass(frozen=True)
class AnyresConfig:
    """LLaVA-OneVision image processing (defaults: the released ``llava-onevision-qwen2-*-ov-hf``)."""

    tile: int = 384  # the processor's size.height == size.width: one tile's side in pixels
    patch: int = 14  # the vision tower's patch size
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS  # (height, width), in the processor's order
    vision_aspect_ratio: str = "anyres_max_9"
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __post_init__(self):
        if self.tile < self.patch or self.patch < 1:
            raise ValueError(f"anyres tile ({self.tile}) must be >= patch ({self.patch}) >= 1")
        if not self.pinpoints:
            raise ValueError("anyres pinpoints is empty")
        for h, w in self.pinpoints:
            if h < self.tile or w < self.tile or h % self.tile or w % self.tile:
                raise ValueError(f"anyres pinpoint {h}x{w} is not a positive multiple of tile {self.tile} "
                                 f"on both sides (the model's grid is pinpoint // tile)")
        self.max_tiles  # noqa: B018  (parses vision_aspect_ratio)

    @property
    def side(self) -> int:  # features per tile side: the vision tower's patch grid
        return self.tile // self.patch

    @property
    def max_tiles(self) -> int:  # "anyres_max_N" -> N
        head, _, n = self.vision_aspect_ratio.rpartition("_")
        if head != "anyres_max" or not n.isdigit() or int(n) < 1:
            raise ValueError(f"anyres vision_aspect_ratio must be 'anyres_max_N' (N >= 1), "
                             f"got {self.vision_aspect_ratio!r}")
        return int(n)


DEFAULT = AnyresConfig()


# ----------------------------------------------------------------------------- header-only rules


def select_best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(h, w) of the pinpoint an image fits best: transformers' ``select_best_resolution``.

    Per pinpoint the image is scaled to fit (``min`` of the two side ratios, sides truncated by
    ``int``); the most effective pixels (capped at the original's) win, then the least wasted
    pinpoint area; an exact tie keeps the earlier pinpoint."""
    if min(height, width) <= 0:
        raise MediaError("empty_media", f"size {height}x{width}")
    best, best_effective, best_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    if best is None:  # no pinpoints (an image every pinpoint truncates to 0 pixels gets the first one)
        raise ValueError("select_best_resolution: no pinpoints")
    return best


def anyres_grid(height: int, width: int, tile: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(rows, cols) of grid tiles: the best resolution in tiles (``get_anyres_image_grid_shape``)."""
    h, w = select_best_resolution(height, width, pinpoints)
    return h // tile, w // tile


def anyres_grid_thw(height: int, width: int, cfg: AnyresConfig = DEFAULT) -> tuple[int, int, int]:
    """The encoder item of a (single) image: ``(1 + rows·cols, side, side)`` (base tile first)."""
    rows, cols = anyres_grid(height, width, cfg.tile, cfg.pinpoints)
    return 1 + rows * cols, cfg.side, cfg.side


def patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(h, w) an image is resized to inside ``target`` keeping its aspect: transformers'
    ``get_patch_output_size`` (the scaled side rounded UP, capped at the target)."""
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


class FeatureGrid(NamedTuple):
    """What ``LlavaOnevisionModel.pack_image_features`` makes of one image's grid tiles."""

    rows: int  # grid tiles
    cols: int
    crop: tuple[int, int, int, int]  # (top, bottom, left, right): unpad_image keeps map[top:bottom, left:right]
    new_h: int  # after the anyres_max downscaling (== bottom - top when not downscaled)
    new_w: int
    interpolated: bool  # bilinear downscaling to new_h x new_w happened

    def tokens(self, side: int) -> int:  # base tile + the grid's rows, each with its newline
        return side * side + self.new_h * (self.new_w + 1)


def model_feature_grid(height: int, width: int, cfg: AnyresConfig = DEFAULT) -> FeatureGrid:
    """The model's rule (``get_anyres_image_grid_shape`` -> ``unpad_image`` -> anyres_max
    ``interpolate``), operation for operation, for an image of ``height`` x ``width``."""
    rows, cols = anyres_grid(height, width, cfg.tile, cfg.pinpoints)
    cur_h, cur_w = rows * cfg.side, cols * cfg.side
    top, bottom, left, right = 0, cur_h, 0, cur_w
    if width / height > cur_w / cur_h:  # wider than the grid: rows of padding above and below
        new_height = int(round(height * (cur_w / width), 7))
        pad = (cur_h - new_height) // 2
        top, bottom = pad, cur_h - pad
    else:
        new_width = int(round(width * (cur_h / height), 7))
        pad = (cur_w - new_width) // 2
        left, right = pad, cur_w - pad
    h, w = bottom - top, right - left
    ratio = math.sqrt(h * w / (cfg.max_tiles * cfg.side**2))
    if ratio > 1.1:
        return FeatureGrid(rows, cols, (top, bottom, left, right), int(h // ratio), int(w // ratio), True)
    return FeatureGrid(rows, cols, (top, bottom, left, right), h, w, False)


def image_feature_tokens(height: int, width: int, cfg: AnyresConfig = DEFAULT) -> int:
    """Image features (= ``<image>`` tokens) LLaVA-OneVision's model produces for a single image
    of ``height`` x ``width`` (``vision_feature_select_strategy: full``; no CLS)."""
    return model_feature_grid(height, width, cfg).tokens(cfg.side)


def processor_feature_tokens(height: int, width: int, cfg: AnyresConfig = DEFAULT) -> int:
    """``LlavaOnevisionProcessor._get_number_of_features`` as transformers writes it (its own
    integer formula; equal to ``image_feature_tokens`` on every size tested)."""
    bh, bw = select_best_resolution(height, width, cfg.pinpoints)
    side = cfg.side
    cur_h, cur_w = side * (bh // cfg.tile), side * (bw // cfg.tile)
    if width / height > cur_w / cur_h:
        new_height = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_height) // 2 * 2
    else:
        new_width = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_width) // 2 * 2
    unpadded, newlines = cur_h * cur_w, cur_h
    ratio = math.sqrt(cur_h * cur_w / (cfg.max_tiles * side**2))
    if ratio > 1.1:
        unpadded, newlines = int(cur_h // ratio) * int(cur_w // ratio), int(cur_h // ratio)
    return unpadded + newlines + side * side


def square_image_tokens(cfg: AnyresConfig = DEFAULT) -> int:
    """Features of an image of a multi-image sample (one tile, no grid) + its newline."""
    return cfg.side**2 + 1


def video_feature_tokens(num_frames: int, cfg: AnyresConfig = DEFAULT) -> int:
    """A video's features: per frame ``ceil(side/2)²`` (the 2x2 bilinear pooling of
    ``apply_pooling``: 196 for 384 / 14), one newline after the last frame."""
    return num_frames * math.ceil(cfg.side / 2) ** 2 + 1


# ----------------------------------------------------------------------------- pixels


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] -> [height, width, 3]: PIL bicubic on uint8, as transformers' PIL backend."""
    if rgb.shape[:2] == (height, width):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((width, height), resample=Image.BICUBIC))


def _normalize(rgb: np.ndarray, cfg: AnyresConfig) -> np.ndarray:  # uint8 [H, W, 3] -> float32 [3, H, W]
    return resize_normalize(rgb, rgb.shape[:2], cfg)  # no resize at its own size: /255 in float64, then (x-m)/s


def _check_rgb(rgb: np.ndarray) -> None:
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or min(rgb.shape[:2]) < 1:
        raise ValueError(f"anyres expects an RGB uint8 image [H, W, 3], got {rgb.dtype} {list(rgb.shape)}")


def process_anyres_image(rgb: np.ndarray, cfg: AnyresConfig = DEFAULT) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [1 + rows·cols, 3, tile, tile]: the base tile, then the grid tiles
    row-major, as ``LlavaOnevisionImageProcessorPil`` makes them for a single image."""
    _check_rgb(rgb)
    height, width = rgb.shape[:2]
    th, tw = select_best_resolution(height, width, cfg.pinpoints)
    nh, nw = patch_output_size(height, width, (th, tw))
    resized = _resize(rgb, nh, nw)
    top, left = (th - nh) // 2, (tw - nw) // 2  # np.pad's (before, before + remainder)
    canvas = np.zeros((th, tw, 3), dtype=np.uint8)
    canvas[top:top + nh, left:left + nw] = resized
    t, rows, cols = cfg.tile, th // cfg.tile, tw // cfg.tile
    grid = _normalize(canvas, cfg).reshape(3, rows, t, cols, t).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, t, t)
    base = _normalize(_resize(rgb, t, t), cfg)
    return np.concatenate([base[None], grid])


def process_square_image(rgb: np.ndarray, cfg: AnyresConfig = DEFAULT) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [1, 3, tile, tile]: an image of a multi-image sample, padded to a
    square (centred, the rest filled with ``int(255·mean)`` per channel) and resized to one tile."""
    _check_rgb(rgb)
    height, width = rgb.shape[:2]
    if height != width:
        n = max(height, width)
        fill = np.asarray([int(m * 255) for m in cfg.image_mean], dtype=np.uint8)
        square = np.broadcast_to(fill, (n, n, 3)).copy()
        top, left = (n - height) // 2, (n - width) // 2
        square[top:top + height, left:left + width] = rgb
        rgb = square
    return _normalize(_resize(rgb, cfg.tile, cfg.tile), cfg)[None]


def tiles_to_patches(tiles: np.ndarray, patch: int) -> np.ndarray:
    """float32 [T, C, S, S] -> [T·(S//p)², C·p·p]: each tile's patches row-major, rows (C, p, p);
    the last ``S % p`` pixel rows / columns, which a valid-padding Conv2d never reads, dropped."""
    if tiles.ndim != 4 or tiles.shape[2] != tiles.shape[3]:
        raise ValueError(f"tiles must be [T, C, S, S], got {list(tiles.shape)}")
    g = tiles.shape[2] // patch
    if g < 1:
        raise ValueError(f"tile side {tiles.shape[2]} is smaller than patch {patch}")
    return tile_patches(tiles[:, :, :g * patch, :g * patch], patch)
