"""InternVL's dynamic tiling ("crop to patches"), header-only at pack time and reproduced at decode.

``VisionConfig(tiling="internvl")`` replaces the Qwen smart resize of an image by transformers'
``GotOcr2ImageProcessorPil`` with ``crop_to_patches=True`` as ``InternVLProcessor`` uses it:

- the grid: among the (cols, rows) with ``min_tiles <= cols·rows <= max_tiles`` (sorted by tile
  count, stable), the one whose ``cols / rows`` is closest to the image's ``width / height``; on an
  exact (float) tie the later, larger grid wins while the image's area exceeds half the grid's
  (``area > 0.5 · tile² · cols · rows``) — ``optimal_grid``;
- the image resized (PIL bicubic on uint8) to the canvas ``rows·tile`` x ``cols·tile`` and cut into
  tiles row-major, then, when the grid has more than one tile, a thumbnail: the original image
  resized to ``tile`` x ``tile``; each tile rescaled (/255 in float64, to float32) and normalised;
- ``max_tiles == 1`` (transformers skips cropping): one tile, the image resized to ``tile`` x ``tile``,
  which the rule above gives too (the only grid is 1x1, and one tile has no thumbnail).

The plan is ``MediaPlan("image", grid_thw=(tiles, tile/p, tile/p), resized_hw=(rows·tile, cols·tile))``
and the pixel values are float32 ``[tiles · (tile/p)², 3·p·p]``: tiles in transformers' order, each
tile's patches in raster order (row-major over its patch grid), each row laid out (C, p, p) as a
``Conv2d(3, D, p, stride=p)`` patch embedding flattens its weight. ``use_thumbnail=False`` drops the
thumbnail (InternVL's own ``dynamic_preprocess`` option; transformers always adds it).

Videos follow ``InternVLVideoProcessor`` (with ``do_sample_frames``) and ``InternVLProcessor``: every
sampled frame is one tile, the whole frame resized to ``tile`` x ``tile`` (no cropping, no thumbnail):

- how many frames: ``int(N / fps_src · fps)`` (its ``sample_frames`` with ``fps``), clamped to
  [``min_frames``, ``max_frames``] and to the stream's ``N`` frames (and at least 1). transformers has
  no clamp (it raises past ``N`` and divides by zero at 0), so the two agree wherever its count is
  within the limits; ``min_frames = max_frames = K`` is its ``num_frames=K`` (with ``K <= N``);
- which: ``arange(N / n / 2, N, N / n)`` in float32, truncated (``initial_shift=True``: each frame
  from the middle of its segment), as torch computes it there;
- pixels: torchvision's uint8 bicubic antialiased resize and the fused float32 normalisation
  (``vision.resize_normalize_frames``, the Qwen video processors' path too), patches raster per frame.

The plan is ``MediaPlan("video", grid_thw=(frames, tile/p, tile/p), resized_hw=(tile, tile),
frame_indices=...)``; tokenize.py writes each frame as ``Frame{i}: <img>`` + pads + ``</img>``,
the frames joined by newlines (``InternVLProcessor.replace_video_token``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from omniweave.data.media.vision import (ImageInfo, MediaError, MediaPlan, VideoInfo, VisionConfig, decode_image,
                                        decode_video_frames, probe_video, resize_normalize, resize_normalize_frames)


def check_tiling_config(cfg: VisionConfig) -> None:
    """``ValueError`` naming the key when a ``tiling: internvl`` config cannot tile."""
    for key in ("tile_size", "min_tiles", "max_tiles", "patch_size", "merge_size"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"vision {key} must be >= 1 with tiling {cfg.tiling!r}, got {getattr(cfg, key)}")
    if cfg.max_tiles < cfg.min_tiles:
        raise ValueError(f"vision max_tiles ({cfg.max_tiles}) must be >= min_tiles ({cfg.min_tiles})")
    if cfg.tile_size % cfg.factor:
        raise ValueError(f"vision tile_size ({cfg.tile_size}) must be a multiple of patch_size x merge_size "
                         f"({cfg.patch_size} x {cfg.merge_size} = {cfg.factor})")
    if cfg.temporal_patch_size != 1:
        raise ValueError(f"vision temporal_patch_size must be 1 with tiling {cfg.tiling!r} (a tile is one "
                         f"frame), got {cfg.temporal_patch_size}")


@lru_cache(maxsize=32)
def supported_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (cols, rows) with ``min_tiles <= cols·rows <= max_tiles``, by tile count (a stable sort
    of cols-major order): transformers' ``get_all_supported_aspect_ratios``."""
    sides = range(1, max_tiles + 1)
    grids = [(c, r) for c in sides for r in sides if min_tiles <= c * r <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def optimal_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(cols, rows) of the tile grid closest in aspect to a ``height`` x ``width`` image:
    transformers' ``get_optimal_tiled_canvas`` (its float comparisons and tie-break included)."""
    if min(height, width) <= 0:
        raise MediaError("empty_media", f"size {height}x{width}")
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in supported_grids(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:  # tie: more tiles while the image fills them
            best = (cols, rows)
    return best


def plan_tiled_image(info: ImageInfo, cfg: VisionConfig) -> MediaPlan:
    """Header-only plan: ``grid_thw = (tiles, tile/p, tile/p)``, ``resized_hw`` = the canvas."""
    tile = cfg.tile_size
    cols, rows = optimal_grid(info.height, info.width, tile, cfg.min_tiles, cfg.max_tiles)
    tiles = cols * rows + int(cols * rows > 1 and bool(cfg.use_thumbnail))
    side = tile // cfg.patch_size
    return MediaPlan("image", (tiles, side, side), (rows * tile, cols * tile))


def tile_patches(tiles: np.ndarray, patch_size: int) -> np.ndarray:
    """float32 [N, C, T, T] -> [N·(T/p)², C·p·p]: each tile's patches row-major, rows (C, p, p)."""
    n, c, t, _ = tiles.shape
    g = t // patch_size
    x = tiles.reshape(n, c, g, patch_size, g, patch_size).transpose(0, 2, 4, 1, 3, 5)  # (n, gy, gx, c, p, p)
    return np.ascontiguousarray(x).reshape(n * g * g, c * patch_size * patch_size)


def process_tiled_image(data: bytes, cfg: VisionConfig) -> tuple[np.ndarray, MediaPlan]:
    """Full decode: pixel_values float32 [tiles·(tile/p)², 3·p·p] and the plan (grid) it matches."""
    rgb = decode_image(data)
    plan = plan_tiled_image(ImageInfo(height=rgb.shape[0], width=rgb.shape[1]), cfg)
    tile, (height, width) = cfg.tile_size, plan.resized_hw
    rows, cols = height // tile, width // tile
    canvas = resize_normalize(rgb, plan.resized_hw, cfg)  # [3, rows·tile, cols·tile]; normalising is per pixel
    tiles = canvas.reshape(3, rows, tile, cols, tile).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
    if plan.grid_thw[0] > rows * cols:  # the thumbnail: the original image, not the canvas, resized
        tiles = np.concatenate([tiles, resize_normalize(rgb, (tile, tile), cfg)[None]])
    return tile_patches(tiles, cfg.patch_size), plan


# ---------------------------------------------------------------------------- videos: one tile per frame


def tiled_video_frame_count(num_frames: int, fps: float, cfg: VisionConfig) -> int:
    """Frames to sample: ``InternVLVideoProcessor.sample_frames``' ``int(N / fps_src · fps)``, clamped
    to [min_frames, max_frames], to the stream's frames and to at least one (see the module doc)."""
    wanted = int(num_frames / fps * cfg.fps)
    return max(1, min(max(wanted, cfg.min_frames), cfg.max_frames, num_frames))


def tiled_video_frame_indices(num_frames: int, n: int) -> tuple[int, ...]:
    """``InternVLVideoProcessor.sample_frames`` with ``initial_shift=True``: ``n`` frames, each from the
    middle of its ``N / n`` segment (torch's float32 ``arange``, truncated, as transformers computes it)."""
    import torch

    return tuple(torch.arange(num_frames / n / 2, num_frames, num_frames / n).int().tolist())


def plan_tiled_video(info: VideoInfo, cfg: VisionConfig) -> MediaPlan:
    """Header-only plan of a video: ``grid_thw = (frames, tile/p, tile/p)``, every frame one tile."""
    if info.num_frames < 1:
        raise MediaError("video_no_frames", "the stream has no frames")
    n = tiled_video_frame_count(info.num_frames, info.fps, cfg)
    indices = tiled_video_frame_indices(info.num_frames, n)
    side = cfg.tile_size // cfg.patch_size
    seconds_per_frame = info.num_frames / (len(indices) * info.fps)  # one frame per temporal grid step
    return MediaPlan("video", (len(indices), side, side), (cfg.tile_size, cfg.tile_size), indices, seconds_per_frame,
                     info.fps)  # fmt: skip


def process_tiled_video(data: bytes, cfg: VisionConfig, plan: MediaPlan | None = None) -> tuple[np.ndarray, MediaPlan]:
    """The planned frames decoded, each resized to one tile: float32 [frames·(tile/p)², 3·p·p] and the plan."""
    plan = plan or plan_tiled_video(probe_video(data), cfg)
    unique = tuple(sorted(set(plan.frame_indices)))
    frames = resize_normalize_frames(np.stack(decode_video_frames(data, unique)), plan.resized_hw, cfg)
    at = {j: k for k, j in enumerate(unique)}
    frames = frames[[at[i] for i in plan.frame_indices]]  # [frames, 3, tile, tile]
    return tile_patches(np.ascontiguousarray(frames), cfg.patch_size), plan
