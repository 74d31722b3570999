"""``tiling: pad``: each image resized to fit one ``tile_size`` square, aspect ratio kept, and
centred on black -- openpi's / lerobot's ``resize_with_pad_torch`` as Pi0.5 preprocesses camera
frames (224 px for PaliGemma's SigLIP, whose position table is fixed):

    x      = uint8 pixels / 255                               float32 [0, 1]
    ratio  = max(W / tile, H / tile);  h, w = int(H / ratio), int(W / ratio)
    x      = bilinear interpolate to (h, w) (align_corners=False, no antialias), clamped to [0, 1]
    x      = zero-padded to tile x tile, the odd pixel at the bottom / right
    pixels = (x - image_mean) / image_std                     (Pi0.5: mean = std = 0.5 -> [-1, 1])

so a grid of (1, tile / patch, tile / patch) for every image, whatever its size. Videos are not
served (a camera frame reaches training as an image: data/packing/vla.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from omniweave.data.media.vision import ImageInfo, MediaError, MediaPlan, VisionConfig, decode_image, patchify


def plan_padded_image(info: ImageInfo, cfg: VisionConfig) -> MediaPlan:
    side = cfg.tile_size // cfg.patch_size
    return MediaPlan("image", (1, side, side), (cfg.tile_size, cfg.tile_size))


def resize_with_pad(rgb: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, size, size] in [0, 1] (the module doc's first four lines)."""
    x = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)[None].to(torch.float32) / 255.0
    height, width = rgb.shape[:2]
    ratio = max(width / size, height / size)
    h, w = int(height / ratio), int(width / ratio)
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, left = (size - h) // 2, (size - w) // 2
    x = F.pad(x, (left, size - w - left, top, size - h - top), value=0.0)
    return x[0].numpy()


def process_padded_image(data: bytes, cfg: VisionConfig) -> tuple[np.ndarray, MediaPlan]:
    """Full decode: pixel_values float32 [(tile / p)², 3·p·p] and the plan it matches."""
    rgb = decode_image(data)
    plan = plan_padded_image(ImageInfo(height=rgb.shape[0], width=rgb.shape[1]), cfg)
    x = resize_with_pad(rgb, cfg.tile_size)
    x = (x - np.asarray(cfg.image_mean, np.float32)[:, None, None]) / np.asarray(cfg.image_std, np.float32)[:, None, None]
    return patchify(x[None], cfg), plan


def refuse_video() -> None:
    raise MediaError("video_not_served", "vision tiling 'pad' serves images (camera frames); this item is a video")
