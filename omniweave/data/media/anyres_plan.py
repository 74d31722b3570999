"""LLaVA-OneVision's media under ``data.vision.tiling: anyres``: plans from headers, pixels at decode.

The rules themselves are media/anyres.py (transformers 5.24's ``llava_onevision``, tested there);
this module maps a ``VisionConfig`` onto them and returns the ``MediaPlan`` the packer writes:

- pinpoints: every ``(i, j) · tile_size`` for ``1 <= i, j <= anyres_grid``, height-major (the
  released ``image_grid_pinpoints``, 384..2304, is ``anyres_grid: 6``); ``vision_aspect_ratio`` is
  ``anyres_max_{anyres_max}``. The projector's ``anyres_grid`` / ``anyres_max`` / ``image_size`` must be
  the same (recipes interpolate them from ``data.vision``).
- an image of a conversation with ONE image (transformers' single-image path, ``batch_num_images ==
  [1]``): the base tile + the best pinpoint's grid, ``grid_thw = (1 + rows·cols, s, s)`` with ``s =
  tile // patch``, ``image_feature_tokens`` pad tokens (the base tile's s², the unpadded, maybe
  shrunk grid map with a newline per row);
- an image of a conversation with SEVERAL images (``batch_num_images > 1``, what
  ``apply_chat_template`` passes for such a conversation): padded to a square with the mean colour
  and resized to one tile, ``grid_thw = (1, s, s)``, ``s² + 1`` tokens;
- both keep the image's own (height, width) as ``resized_hw``: the loader hands it to the model as
  ``image_sizes`` (the projector lays the grid out by it; t == 1 tells it the one-tile path);
- a video: ``LlavaOnevisionVideoProcessor`` (``BaseVideoProcessor.sample_frames``, with
  ``do_sample_frames`` and ``fps``): ``n = int(N / fps_src · fps)`` frames clamped to [min_frames,
  max_frames], to the stream's N and to at least 1 (transformers has no clamp: it raises past N; so
  equal wherever its count is within the limits, and ``min_frames = max_frames = K`` is its
  ``num_frames=K``), at ``arange(n) · N // n`` (integers, no shift); each frame resized to ``tile`` x
  ``tile`` with torchvision's uint8 bicubic antialiased resize and the fused float32 normalisation
  (``vision.resize_normalize_frames``, what its CPU path runs); ``grid_thw = (n, s, s)``,
  ``n · ceil(s/2)² + 1`` tokens (2x2 pooled frames, one newline), ``resized_hw = (tile, tile)``.

A multi-image square of a very long image would be ``max(h, w)²`` pixels before its resize (transformers
allocates it); past ``IMAGE_PIXELS_CEILING`` such an image is rejected at plan time, ``image_too_large``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from omniweave.data.media.anyres import (AnyresConfig, anyres_grid_thw, image_feature_tokens, process_anyres_image,
                                         process_square_image, square_image_tokens, square_pinpoints,
                                         tiles_to_patches, video_feature_tokens)
from omniweave.data.media.tiling import tiled_video_frame_count
from omniweave.data.media.vision import (IMAGE_PIXELS_CEILING, ImageInfo, MediaError, MediaPlan, VideoInfo,
                                        VisionConfig, decode_image, decode_video_frames, probe_video,
                                        resize_normalize_frames)


def check_anyres_config(cfg: VisionConfig) -> None:
    """``ValueError`` naming the key when a ``tiling: anyres`` config cannot be LLaVA-OneVision's."""
    for key in ("tile_size", "patch_size", "anyres_grid", "anyres_max"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"vision {key} must be >= 1 with tiling 'anyres', got {getattr(cfg, key)}")
    if cfg.tile_size < cfg.patch_size:
        raise ValueError(f"vision tile_size ({cfg.tile_size}) must be >= patch_size ({cfg.patch_size}) with tiling 'anyres'")
    for key in ("merge_size", "temporal_patch_size"):
        if getattr(cfg, key) != 1:
            raise ValueError(f"vision {key} must be 1 with tiling 'anyres' (a tile's patches are features one to "
                             f"one; a frame is one tile), got {getattr(cfg, key)}")


@lru_cache(maxsize=16)
def anyres_config(cfg: VisionConfig) -> AnyresConfig:
    """The anyres rules' settings of a ``tiling: anyres`` vision config (module doc)."""
    return AnyresConfig(tile=cfg.tile_size, patch=cfg.patch_size, pinpoints=square_pinpoints(cfg.tile_size, cfg.anyres_grid),
                        vision_aspect_ratio=f"anyres_max_{cfg.anyres_max}", image_mean=cfg.image_mean,
                        image_std=cfg.image_std)  # fmt: skip


def plan_anyres_image(info: ImageInfo, cfg: VisionConfig, images: int = 1) -> MediaPlan:
    """Header-only plan of an image whose conversation has ``images`` images (module doc)."""
    height, width = info.height, info.width
    if min(height, width) <= 0:
        raise MediaError("empty_media", f"size {height}x{width}")
    a = anyres_config(cfg)
    if images > 1:
        if max(height, width) ** 2 > IMAGE_PIXELS_CEILING:
            raise MediaError("image_too_large", f"an image of {width}x{height} in a multi-image sample is padded to a "
                             f"square of {max(height, width) ** 2} pixels, over {IMAGE_PIXELS_CEILING}")  # fmt: skip
        return MediaPlan("image", (1, a.side, a.side), (height, width), tokens=square_image_tokens(a))
    return MediaPlan("image", anyres_grid_thw(height, width, a), (height, width),
                     tokens=image_feature_tokens(height, width, a))


def process_anyres_item(data: bytes, cfg: VisionConfig, plan: MediaPlan | None = None) -> tuple[np.ndarray, MediaPlan]:
    """Full decode of an image: float32 [tiles·s², 3·p·p] and the plan it matches. The packed ``plan``
    chooses the path: one tile (t == 1) is the multi-image square, else the anyres tiles (None: a
    single image). ``MediaError("media_changed")`` when the image's size is not the planned one."""
    rgb = decode_image(data)
    height, width = rgb.shape[:2]
    if plan is not None and tuple(plan.resized_hw) != (height, width):
        raise MediaError("media_changed", f"the image is {height}x{width}, planned {tuple(plan.resized_hw)}")
    single = plan is None or plan.grid_thw[0] > 1
    got = plan_anyres_image(ImageInfo(height=height, width=width), cfg, 1 if single else 2)
    a = anyres_config(cfg)
    tiles = process_anyres_image(rgb, a) if single else process_square_image(rgb, a)
    return tiles_to_patches(tiles, a.patch), got


def anyres_video_frame_indices(num_frames: int, n: int) -> tuple[int, ...]:
    """``default_sample_indices_fn``: ``arange(n) · N // n`` in integers."""
    return tuple(i * num_frames // n for i in range(n))


def plan_anyres_video(info: VideoInfo, cfg: VisionConfig) -> MediaPlan:
    """Header-only plan of a video: a tile per sampled frame (module doc)."""
    if info.num_frames < 1:
        raise MediaError("video_no_frames", "the stream has no frames")
    n = tiled_video_frame_count(info.num_frames, info.fps, cfg)
    a = anyres_config(cfg)
    seconds_per_frame = info.num_frames / (n * info.fps)
    return MediaPlan("video", (n, a.side, a.side), (cfg.tile_size, cfg.tile_size),
                     anyres_video_frame_indices(info.num_frames, n), seconds_per_frame, info.fps,
                     tokens=video_feature_tokens(n, a))  # fmt: skip


def process_anyres_video(data: bytes, cfg: VisionConfig, plan: MediaPlan | None = None) -> tuple[np.ndarray, MediaPlan]:
    """The planned frames decoded, each resized to one tile: float32 [frames·s², 3·p·p] and the plan."""
    plan = plan or plan_anyres_video(probe_video(data), cfg)
    unique = tuple(sorted(set(plan.frame_indices)))
    frames = resize_normalize_frames(np.stack(decode_video_frames(data, unique)), (cfg.tile_size, cfg.tile_size), cfg)
    at = {j: k for k, j in enumerate(unique)}
    frames = np.ascontiguousarray(frames[[at[i] for i in plan.frame_indices]])
    return tiles_to_patches(frames, cfg.patch_size), plan
