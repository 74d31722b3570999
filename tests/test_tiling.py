"""InternVL dynamic tiling (media/tiling.py) against transformers' GotOcr2ImageProcessorPil with
crop_to_patches=True, as InternVLProcessor uses it: the grid rule, tile counts from headers, pixel
values bit-equal, header plan == full decode, the patch layout a Conv2d patch embedding reads, and
clear rejects."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from data_factory import png_bytes, video_bytes
from PIL import Image

from omniweave.data.media import tiling as T
from omniweave.data.media import vision as M
from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected

P = 14


def internvl(tile: int = 448, **kw) -> M.VisionConfig:
    return M.VisionConfig(tiling="internvl", tile_size=tile, patch_size=P, merge_size=2, temporal_patch_size=1, **kw)


def hf_processor(tile: int, **kw):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(crop_to_patches=True, size={"height": tile, "width": tile}, **kw)


def random_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    """(height, width): fixed corner cases, then log-uniform sides (tall, wide, tiny, huge)."""
    fixed = [(1, 500), (500, 1), (3, 3), (1, 1), (5000, 300), (300, 5000), (448, 448), (896, 1344), (447, 449),
             (200, 300), (2000, 3000), (300, 200), (3000, 2000), (100, 400), (400, 100)]
    rng = np.random.default_rng(seed)
    sides = np.exp(rng.uniform(0, np.log(6000), size=(n - len(fixed), 2))).astype(int) + 1
    return fixed + [(int(h), int(w)) for h, w in sides]


def to_tiles(pixel_values: np.ndarray, plan: M.MediaPlan) -> np.ndarray:
    """Our [tiles·g², 3·p·p] rows back to [tiles, 3, tile, tile] (raster patches, rows (C, p, p))."""
    n, g, _ = plan.grid_thw
    return pixel_values.reshape(n, g, g, 3, P, P).transpose(0, 3, 1, 4, 2, 5).reshape(n, 3, g * P, g * P)


# ---------------------------------------------------------------------------- the grid rule, header only


def test_supported_grids_and_optimal_grid_equal_transformers_functions():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        get_all_supported_aspect_ratios,
        get_optimal_tiled_canvas,
    )

    for lo, hi in [(1, 12), (2, 6), (1, 1), (1, 2), (3, 40)]:
        assert list(T.supported_grids(lo, hi)) == get_all_supported_aspect_ratios(lo, hi)
    for tile, lo, hi in [(448, 1, 12), (448, 2, 6), (56, 1, 12), (84, 1, 2)]:
        for h, w in random_sizes(150, seed=tile + hi):
            assert T.optimal_grid(h, w, tile, lo, hi) == get_optimal_tiled_canvas((h, w), (tile, tile), lo, hi), (h, w)


def test_tie_break_prefers_more_tiles_only_while_the_image_fills_them():
    # aspect 1.5 with at most 2 tiles: 1x1 and 2x1 are equally far (0.5); 2x1 wins once area > 0.5·448²·2
    assert T.optimal_grid(200, 300, 448, 1, 2) == (1, 1)
    assert T.optimal_grid(2000, 3000, 448, 1, 2) == (2, 1)
    # tall: the distance is on width / height, so 1x1 and 1x2 tie at aspect 0.75 (not at 1 / 1.5)
    assert T.optimal_grid(300, 200, 448, 1, 2) == (1, 2)  # 0.667: nearer 0.5 than 1, no tie
    assert T.optimal_grid(400, 300, 448, 1, 2) == (1, 1)
    assert T.optimal_grid(4000, 3000, 448, 1, 2) == (1, 2)
    hf = hf_processor(448)
    for h, w, tiles in [(200, 300, 1), (2000, 3000, 3), (300, 200, 3), (400, 300, 1), (4000, 3000, 3)]:
        assert hf.get_number_of_image_patches(h, w, {"max_patches": 2}) == tiles
        assert M.plan_image(M.ImageInfo(h, w), internvl(max_tiles=2)).grid_thw[0] == tiles


@pytest.mark.parametrize("tile,lo,hi,n", [(448, 1, 12, 200), (448, 2, 6, 100), (56, 1, 12, 100), (84, 2, 6, 100)])
def test_tile_counts_from_headers_equal_transformers(tile, lo, hi, n):
    hf = hf_processor(tile)
    kwargs = {"min_patches": lo, "max_patches": hi, "patch_size": {"height": tile, "width": tile}}
    cfg = internvl(tile, min_tiles=lo, max_tiles=hi)
    g = tile // P
    for h, w in random_sizes(n, seed=n + tile):
        plan = M.plan_image(M.ImageInfo(h, w), cfg)
        tiles = hf.get_number_of_image_patches(h, w, kwargs)
        assert plan.grid_thw == (tiles, g, g), (h, w)
        assert plan.num_tokens(cfg.merge_size) == tiles * g * g // 4
        cols, rows = T.optimal_grid(h, w, tile, lo, hi)
        assert plan.resized_hw == (rows * tile, cols * tile)


def test_a_448_tile_is_256_tokens_and_max_tiles_1_is_one_resized_tile():
    plan = M.plan_image(M.ImageInfo(300, 500), internvl())  # 3x2 grid + thumbnail
    assert plan.grid_thw == (7, 32, 32) and plan.resized_hw == (896, 1344) and plan.num_tokens(2) == 7 * 256
    assert M.plan_image(M.ImageInfo(300, 5000), internvl(max_tiles=1)).grid_thw == (1, 32, 32)
    assert M.plan_image(M.ImageInfo(300, 500), internvl(use_thumbnail=False)).grid_thw == (6, 32, 32)


# ---------------------------------------------------------------------------- pixels: full decode


PIXEL_CASES = [  # (tile, height, width, mode, seed, processor kwargs, expected tiles)
    (448, 300, 500, "RGB", 0, {}, 7),  # 3x2 grid + thumbnail
    (448, 448, 448, "RGB", 1, {}, 1),  # 1x1 grid: no thumbnail
    (448, 120, 90, "RGBA", 2, {}, 13),  # 3x4 grid (12 tiles) + thumbnail; transparency on white
    (56, 30, 500, "RGB", 3, {}, 13),  # 12x1: the tile limit
    (56, 700, 90, "P", 4, {}, 9),  # 1x8 + thumbnail, palette image
    (84, 61, 61, "L", 5, {}, 1),  # non-round tile (6x6 patches), grayscale, 1x1 grid (2x2 ties, image too small)
    (84, 3, 3, "RGB", 6, {}, 1),  # tiny
    (84, 91, 260, "RGB", 7, {"min_patches": 2, "max_patches": 6}, 4),  # 3x1 + thumbnail
    (56, 40, 200, "RGBA", 8, {"max_patches": 1}, 1),  # max_tiles 1: the image resized to one tile
]


@pytest.mark.parametrize("tile,height,width,mode,seed,kwargs,tiles", PIXEL_CASES)
def test_pixel_values_equal_transformers_got_ocr2_crop_to_patches(tile, height, width, mode, seed, kwargs, tiles):
    cfg = internvl(tile, min_tiles=kwargs.get("min_patches", 1), max_tiles=kwargs.get("max_patches", 12))
    data = png_bytes(height, width, mode, seed=seed)
    pixel_values, plan = M.process_image(data, cfg)
    expected = hf_processor(tile, **kwargs)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert expected["num_patches"].tolist() == [tiles] and plan.grid_thw == (tiles, tile // P, tile // P)
    assert pixel_values.dtype == np.float32 and pixel_values.shape == (tiles * (tile // P) ** 2, 3 * P * P)
    ours = to_tiles(pixel_values, plan)
    assert ours.shape == expected["pixel_values"].shape
    assert np.abs(ours - expected["pixel_values"]).max() == 0.0  # same PIL resize, same float32 arithmetic
    assert M.plan_image(M.probe_image(data), cfg) == plan  # header-only == full decode


def test_without_thumbnail_the_grid_tiles_are_transformers_first_tiles():
    data = png_bytes(300, 500, seed=9)
    pixel_values, plan = M.process_image(data, internvl(56, use_thumbnail=False))
    expected = hf_processor(56)(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
    assert plan.grid_thw == (6, 4, 4) and len(expected) == 7
    np.testing.assert_array_equal(to_tiles(pixel_values, plan), expected[:6])


def test_rows_are_raster_patches_as_a_conv2d_patch_embedding_reads_them():
    data = png_bytes(100, 150, seed=10)
    pixel_values, plan = M.process_image(data, internvl(56))
    hf = torch.from_numpy(hf_processor(56)(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"])
    conv = torch.nn.Conv2d(3, 8, P, stride=P).double()
    want = conv(hf.double()).flatten(2).transpose(1, 2).reshape(-1, 8)  # [tiles·g², D], row-major patches
    got = torch.from_numpy(pixel_values).double() @ conv.weight.reshape(8, -1).T + conv.bias
    assert plan.grid_thw == (7, 4, 4)  # 3x2 grid + thumbnail
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # same products, other summation order


def test_sample_processor_counts_tiles_and_decodes_them_to_the_planned_grid():
    proc = SampleProcessor({"tokenizer": "demo", "template": "chatml", "rope": "rope1d",
                            "special_tokens_in_text": "keep",  # whether or not "<image>" is a special token
                            "vision": {"tiling": "internvl", "tile_size": 56, "temporal_patch_size": 1}})
    data = png_bytes(60, 130, seed=11)  # 2x1 grid + thumbnail: 3 tiles of 2x2 merged patches
    conv = Conversation(id="s", messages=[Message("user", "<image>What?"), Message("assistant", "Noise.")],
                        images=["a.png"])
    sample = proc.tokenize(RawSample(key="s", conversation=conv, media={"a.png": data}))
    (span,) = sample.media
    assert tuple(span.grid_thw) == (3, 4, 4) and span.length == 12
    assert proc.process_media(span, data).shape == (48, 3 * P * P)
    video = Conversation(id="v", messages=[Message("user", "<video>?"), Message("assistant", "x")], videos=["v.mp4"])
    with pytest.raises(SampleRejected) as err:
        proc.tokenize(RawSample(key="v", conversation=video, media={"v.mp4": video_bytes(4)}))
    assert err.value.reason == "unsupported_media"


# ---------------------------------------------------------------------------- bad input


def test_bad_tiling_settings_are_value_errors_naming_the_key():
    with pytest.raises(ValueError, match="max_tiles"):
        internvl(max_tiles=0)
    with pytest.raises(ValueError, match="max_tiles"):
        M.VisionConfig.from_mapping({"tiling": "internvl", "temporal_patch_size": 1, "max_tiles": -3})
    with pytest.raises(ValueError, match="max_tiles"):
        internvl(min_tiles=4, max_tiles=3)
    with pytest.raises(ValueError, match="min_tiles"):
        internvl(min_tiles=0)
    with pytest.raises(ValueError, match="tile_size"):
        internvl(100)  # not a multiple of 28
    with pytest.raises(ValueError, match="temporal_patch_size"):
        M.VisionConfig(tiling="internvl")
    with pytest.raises(ValueError, match="tiling"):
        M.VisionConfig(tiling="llava")
    M.VisionConfig(max_tiles=0)  # untiled: the tile keys are not read


def test_untiled_fingerprint_has_no_tile_keys_and_a_tiled_one_has_them():
    assert not set(M.TILE_KEYS) & set(M.VisionConfig().spec())  # packs built before tiling still match
    spec = internvl(max_tiles=6).spec()
    assert (spec["tiling"], spec["tile_size"], spec["max_tiles"], spec["use_thumbnail"]) == ("internvl", 448, 6, True)


def test_an_image_with_an_empty_side_is_a_media_error():
    for h, w in [(0, 10), (10, 0)]:
        with pytest.raises(M.MediaError) as err:
            M.plan_image(M.ImageInfo(h, w), internvl())
        assert err.value.reason == "empty_media"


def test_videos_under_internvl_tiling_are_unsupported_media():
    with pytest.raises(M.MediaError) as err:
        M.plan_video(M.VideoInfo(num_frames=8, fps=4.0, height=64, width=96), internvl())
    assert err.value.reason == "unsupported_media" and "not supported yet" in str(err.value)
    with pytest.raises(M.MediaError) as err:
        M.process_video(video_bytes(4), internvl())
    assert err.value.reason == "unsupported_media"
