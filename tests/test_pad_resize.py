"""``data.vision.tiling: pad`` (media/pad_resize.py) against openpi's ``resize_with_pad_torch`` as
lerobot 0.4.4's Pi0.5 runs it (``PI05Policy._preprocess_images``: float [0, 1] frames, resized
with padding to the model's resolution, then ``x * 2 - 1``), transcribed below (lerobot itself
does not install here: it pins torch < 2.11).

Checked: pixel values equal within 1e-6 for wide, tall, odd-sized, smaller-than-tile and
exactly-sized images; the grid is the tile's whatever the image; videos are refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from omniweave.data.media.vision import ImageInfo, MediaError, VisionConfig, patchify, plan_image, plan_video, \
    process_image, VideoInfo

TILE = 42
CFG = VisionConfig(patch_size=14, merge_size=1, temporal_patch_size=1, tiling="pad", tile_size=TILE,
                   image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def openpi_resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """openpi / lerobot ``resize_with_pad_torch`` for float32 [b, c, h, w] in [0, 1], mode bilinear."""
    cur_height, cur_width = images.shape[-2:]
    ratio = max(cur_width / width, cur_height / height)
    resized_height, resized_width = int(cur_height / ratio), int(cur_width / ratio)
    resized = F.interpolate(images, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    resized = resized.clamp(0.0, 1.0)
    pad_h0, remainder_h = divmod(height - resized_height, 2)
    pad_w0, remainder_w = divmod(width - resized_width, 2)
    return F.pad(resized, (pad_w0, pad_w0 + remainder_w, pad_h0, pad_h0 + remainder_h), mode="constant", value=0.0)


def png(height: int, width: int, seed: int = 0) -> tuple[bytes, np.ndarray]:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue(), rgb


@pytest.mark.parametrize("height, width", [(130, 200), (200, 130), (57, 31), (20, 33), (42, 42), (84, 84)])
def test_pixels_equal_pi05_preprocessing(height, width):
    data, rgb = png(height, width)
    pixels, plan = process_image(data, CFG)
    frame = torch.from_numpy(rgb).permute(2, 0, 1)[None].to(torch.float32) / 255.0  # lerobot's frames
    want = openpi_resize_with_pad(frame, TILE, TILE) * 2.0 - 1.0
    assert plan.grid_thw == (1, TILE // 14, TILE // 14) and plan.resized_hw == (TILE, TILE)
    expected = patchify(want.numpy(), CFG)
    assert pixels.shape == expected.shape == ((TILE // 14) ** 2, 3 * 14 * 14)
    assert np.abs(pixels - expected).max() <= 1e-6
    if height != width:  # the padding is black: -1 after SigLIP's normalisation
        assert (want == -1).any()


def test_every_image_gets_the_tile_grid_and_videos_are_refused():
    for hw in ((10, 500), (500, 10), (TILE, TILE)):
        assert plan_image(ImageInfo(*hw), CFG).grid_thw == (1, 3, 3)
    with pytest.raises(MediaError, match="video_not_served"):
        plan_video(VideoInfo(num_frames=8, fps=10.0, height=40, width=40), CFG)
    with pytest.raises(ValueError, match="tile_size"):
        VisionConfig(patch_size=14, merge_size=1, temporal_patch_size=1, tiling="pad", tile_size=40)
