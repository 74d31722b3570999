"""LLaVA-OneVision anyres (data/media/anyres.py) against transformers 5.24's llava_onevision: the best
resolution and grid, the image feature count the model produces (``pack_image_features`` run on
every size, its kept feature positions too) and the count the processor writes, the pixels of
``LlavaOnevisionImageProcessorPil`` bit-equal, the video count, and the patch rows a valid Conv2d reads."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from omniweave.data.media import anyres as A

# sizes (height, width) where LlavaOnevisionProcessor's token count differs from the features
# LlavaOnevisionModel produces: none in transformers 5.24 (see the module doc of anyres.py)
PROCESSOR_DISAGREES: list[tuple[int, int]] = []

EXTREMES = [(1, 2000), (2000, 1), (10, 10), (1, 1), (1, 8000), (8000, 1), (384, 384), (383, 385),
            (2304, 2304), (5000, 5000), (4000, 4100), (3000, 400), (400, 3000), (2304, 384), (768, 2304),
            # unpad rounding: the scaled side is k - 1e-15 in floats; round(·, 7) makes it k
            (55, 99), (99, 99), (211, 211), (214, 428), (369, 820), (369, 1681), (375, 1625), (410, 1107)]
SMALL = A.AnyresConfig(tile=56, patch=14, vision_aspect_ratio="anyres_max_4",
                       pinpoints=tuple((h, w) for h in (56, 112, 168) for w in (56, 112, 168, 224)))
ODD = A.AnyresConfig(tile=45, patch=9, vision_aspect_ratio="anyres_max_2",  # side 5: odd, pooled to 3
                     pinpoints=((45, 45), (45, 90), (90, 45), (90, 90), (45, 135), (135, 90)))


def random_sizes(n: int, seed: int, top: float = 6000) -> list[tuple[int, int]]:
    """The extremes, then log-uniform sides (tall, wide, tiny, huge)."""
    rng = np.random.default_rng(seed)
    sides = np.exp(rng.uniform(0, np.log(top), size=(n, 2))).astype(int) + 1
    return EXTREMES + [(int(h), int(w)) for h, w in sides]


def hf_processor(cfg: A.AnyresConfig):
    """LlavaOnevisionProcessor without a tokenizer: only what _get_number_of_features reads."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    proc = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    proc.image_processor = types.SimpleNamespace(image_grid_pinpoints=[list(p) for p in cfg.pinpoints])
    proc.num_image_tokens, proc.vision_aspect_ratio = cfg.side**2, cfg.vision_aspect_ratio
    return proc


def hf_model(cfg: A.AnyresConfig):
    """What LlavaOnevisionModel.pack_image_features / apply_pooling read of ``self``."""
    vision = types.SimpleNamespace(image_size=cfg.tile, patch_size=cfg.patch)
    return types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=vision, image_grid_pinpoints=[list(p) for p in cfg.pinpoints]))


def model_features(cfg: A.AnyresConfig, height: int, width: int) -> torch.Tensor:
    """The model's packed features of one image whose tower rows carry (1, feature row, feature
    column) of the grid's feature map (the base tile 0s, the newline -1s)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
    )

    rows, cols = A.anyres_grid(height, width, cfg.tile, cfg.pinpoints)
    s = cfg.side
    y, x = torch.meshgrid(torch.arange(rows * s), torch.arange(cols * s), indexing="ij")
    grid = torch.stack([torch.ones_like(y), y, x], -1).float()  # [rows·s, cols·s, 3]
    tiles = grid.reshape(rows, s, cols, s, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, s * s, 3)
    feats = torch.cat([torch.zeros(1, s * s, 3), tiles])
    out, lens = LlavaOnevisionModel.pack_image_features(
        hf_model(cfg), [feats], torch.tensor([[height, width]]), image_newline=torch.full((3,), -1.0),
        vision_aspect_ratio=cfg.vision_aspect_ratio)
    assert int(lens[0]) == out[0].shape[0]
    return out[0]


# ---------------------------------------------------------------------------- header-only rules


def test_best_resolution_and_grid_equal_transformers():
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        get_anyres_image_grid_shape,
        image_size_to_num_patches,
    )

    for cfg in (A.DEFAULT, SMALL, ODD):
        pins = [list(p) for p in cfg.pinpoints]
        for h, w in random_sizes(300, seed=cfg.tile):
            assert A.select_best_resolution(h, w, cfg.pinpoints) == select_best_resolution((h, w), pins), (h, w)
            rows, cols = A.anyres_grid(h, w, cfg.tile, cfg.pinpoints)
            assert (rows, cols) == get_anyres_image_grid_shape((h, w), pins, cfg.tile)
            assert A.anyres_grid_thw(h, w, cfg) == (image_size_to_num_patches((h, w), pins, cfg.tile), cfg.side, cfg.side)
    # the released grid: 6 x 6 tiles at most; a 1-pixel-high image fits no pinpoint: the first one wins
    assert A.anyres_grid(5000, 5000, 384, A.DEFAULT_PINPOINTS) == (6, 6)
    assert A.select_best_resolution(1, 8000, A.DEFAULT_PINPOINTS) == (384, 384)


@pytest.mark.parametrize("cfg,n", [(A.DEFAULT, 500), (SMALL, 200), (ODD, 200)], ids=["released", "small", "odd"])
def test_image_tokens_equal_the_models_features_and_the_processors_count(cfg, n):
    proc = hf_processor(cfg)
    disagree, interpolated, cropped = [], 0, 0
    for h, w in random_sizes(n, seed=n + cfg.tile):
        out = model_features(cfg, h, w)
        grid = A.model_feature_grid(h, w, cfg)
        ours = A.image_feature_tokens(h, w, cfg)
        assert ours == out.shape[0] == grid.tokens(cfg.side), (h, w)
        assert A.processor_feature_tokens(h, w, cfg) == proc._get_number_of_features(h, w, cfg.tile, cfg.tile)
        if proc._get_number_of_features(h, w, cfg.tile, cfg.tile) != out.shape[0]:
            disagree.append((h, w))
        # the newline closes each of new_h rows; the base tile comes first
        body = out[cfg.side**2:].reshape(grid.new_h, grid.new_w + 1, 3)
        assert (body[:, -1] == -1).all() and (out[:cfg.side**2] == 0).all()
        interpolated += grid.interpolated
        top, bottom, left, right = grid.crop
        cropped += (bottom - top, right - left) != (grid.rows * cfg.side, grid.cols * cfg.side)
        if not grid.interpolated:  # the kept feature positions are exactly the crop, raster order
            y, x = torch.meshgrid(torch.arange(top, bottom), torch.arange(left, right), indexing="ij")
            assert torch.equal(body[:, :-1, 1:], torch.stack([y, x], -1).float()), (h, w)
        else:
            assert (grid.new_h, grid.new_w) == (body.shape[0], body.shape[1] - 1)
    assert disagree == PROCESSOR_DISAGREES
    print(f"{cfg.tile}px: {len(disagree)} disagree, {interpolated} interpolated, {cropped} cropped")
    assert interpolated >= 10 and cropped >= 50, (interpolated, cropped)  # both branches exercised


def test_released_counts_by_hand():
    # 384 x 384: a 1 x 1 grid, nothing cut, 27 rows of 27 + newline; 729 + 756
    assert A.image_feature_tokens(384, 384) == 729 + 27 * 28
    # 1 x 2000: grid (1, 6), one feature row survives unpadding: 162 + 1
    assert A.model_feature_grid(1, 2000) == A.FeatureGrid(1, 6, (13, 14, 0, 162), 1, 162, False)
    assert A.image_feature_tokens(1, 2000) == 729 + 163
    # the max grid: 162 x 162 features > 1.1² · 9 · 27² = 1.1² · 81², shrunk by ratio 2 to 81 x 81
    g = A.model_feature_grid(2304, 2304)
    assert (g.rows, g.cols, g.interpolated, g.new_h, g.new_w) == (6, 6, True, 81, 81)
    assert A.image_feature_tokens(2304, 2304) == 729 + 81 * 82
    assert A.square_image_tokens() == 730
    assert A.video_feature_tokens(8) == 8 * 196 + 1


@pytest.mark.parametrize("cfg", [A.DEFAULT, ODD], ids=["released", "odd"])
def test_video_tokens_equal_transformers(cfg):
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
    )

    proc = hf_processor(cfg)
    frames = [1, 4, 7, 32]
    counted = proc._get_num_multimodal_tokens(video_sizes=[(f, cfg.tile, cfg.tile) for f in frames])
    assert [A.video_feature_tokens(f, cfg) for f in frames] == counted["num_video_tokens"]
    for f in frames:  # the model: pooled frames + one newline per video
        pooled = LlavaOnevisionModel.apply_pooling(hf_model(cfg), torch.zeros(f, cfg.side**2, 2))
        assert A.video_feature_tokens(f, cfg) == pooled.shape[0] * pooled.shape[1] + 1
    assert math.ceil(cfg.side / 2) ** 2 * 4 + 1 == A.video_feature_tokens(4, cfg)


def test_bad_configs_are_clear_errors():
    with pytest.raises(ValueError, match="anyres_max_N"):
        A.AnyresConfig(vision_aspect_ratio="anyres")
    with pytest.raises(ValueError, match="multiple of tile"):
        A.AnyresConfig(pinpoints=((384, 500),))
    with pytest.raises(ValueError, match="RGB uint8"):
        A.process_anyres_image(np.zeros((4, 4, 3), dtype=np.float32))


# ---------------------------------------------------------------------------- pixels


def _image(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: resampling filters see structure, not only noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 127 + 0 * x], -1)
    return np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("h,w", [(300, 500), (1000, 333), (37, 2000), (800, 800), (2500, 1700), (5, 7), (1, 40)])
def test_pixels_equal_transformers_bit_for_bit(h, w):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    hf = LlavaOnevisionImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3)  # the released config's
    rgb = _image(h, w, seed=h * w)
    ref = hf(Image.fromarray(rgb), return_tensors="np")["pixel_values"][0]
    ours = A.process_anyres_image(rgb)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert ours.shape[0] == A.anyres_grid_thw(h, w)[0]
    assert np.abs(ours - ref).max() == 0
    # an image of a multi-image sample: padded square with the mean colour, one tile
    pair = hf([[Image.fromarray(rgb), Image.fromarray(rgb[::-1].copy())]], return_tensors="np")["pixel_values"][0]
    assert np.abs(A.process_square_image(rgb) - pair[:1]).max() == 0


def test_other_mean_and_tile_pixels_equal_transformers():
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    cfg = A.AnyresConfig(tile=SMALL.tile, patch=14, pinpoints=SMALL.pinpoints, image_mean=mean, image_std=std)
    hf = LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56}, image_mean=list(mean), image_std=list(std),
                                         image_grid_pinpoints=[list(p) for p in cfg.pinpoints])
    for h, w in [(90, 31), (13, 200), (170, 170)]:
        rgb = _image(h, w, seed=h + w)
        ref = hf(Image.fromarray(rgb), return_tensors="np")["pixel_values"][0]
        assert np.abs(A.process_anyres_image(rgb, cfg) - ref).max() == 0


def test_patch_rows_are_what_a_valid_conv2d_reads():
    """384 px tiles with 14 px patches: 27 x 27 patches, the last 6 pixel rows / columns unread."""
    g = torch.Generator().manual_seed(0)
    tiles = torch.randn(2, 3, 384, 384, generator=g)
    weight = torch.randn(8, 3, 14, 14, generator=g)
    rows = torch.from_numpy(A.tiles_to_patches(tiles.numpy(), 14))
    assert rows.shape == (2 * 27 * 27, 3 * 14 * 14)
    conv = F.conv2d(tiles, weight, stride=14)  # [2, 8, 27, 27], padding "valid"
    assert torch.allclose(rows @ weight.flatten(1).T, conv.flatten(2).transpose(1, 2).reshape(-1, 8), atol=1e-4)
    tiles[..., 378:, :] = 1e6  # the dropped pixels change nothing
    tiles[..., :, 378:] = 1e6
    assert torch.equal(torch.from_numpy(A.tiles_to_patches(tiles.numpy(), 14)), rows)
