"""Qwen2-VL media processing: parity with transformers' image processor, header-only counting
equals full processing for images and videos, frame sampling rules, clear rejects."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from data_factory import png_bytes, video_bytes
from PIL import Image

from omniweave.data.media import vision as M

# Small video limits keep the tests fast; the sampling rules are the real ones.
SMALL_VIDEO = M.VisionConfig(video_min_pixels=28 * 28 * 2, video_max_pixels=28 * 28 * 12, video_total_pixels=28 * 28 * 40)


@pytest.fixture(scope="module")
def hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


IMAGE_CASES = [  # (height, width, mode)
    (100, 200, "RGB"),
    (28, 28, "RGB"),
    (5, 7, "RGB"),  # upscaled to min_pixels
    (13, 2500, "RGB"),  # aspect 192: extreme but allowed
    (2600, 14, "RGBA"),  # tall, transparency composited on white
    (57, 57, "L"),
    (333, 517, "P"),
    (1080, 1920, "RGB"),  # above max_pixels: shrunk
    (1500, 1001, "RGB"),
]


@pytest.mark.parametrize("height,width,mode", IMAGE_CASES)
def test_image_matches_transformers_qwen2vl_image_processor(height, width, mode, hf_image_processor):
    data = png_bytes(height, width, mode)
    pixel_values, plan = M.process_image(data, M.VisionConfig())
    expected = hf_image_processor()(images=[Image.open(io.BytesIO(data))])
    assert list(plan.grid_thw) == expected["image_grid_thw"].tolist()[0]
    np.testing.assert_array_equal(pixel_values, np.asarray(expected["pixel_values"]))
    assert M.plan_image(M.probe_image(data), M.VisionConfig()) == plan  # header-only == full


def test_image_custom_limits_match_transformers(hf_image_processor):
    cfg = M.VisionConfig(min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 64, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    hf = hf_image_processor(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for h, w in [(20, 30), (900, 700), (64, 1000)]:
        data = png_bytes(h, w, seed=h)
        pixel_values, plan = M.process_image(data, cfg)
        expected = hf(images=[Image.open(io.BytesIO(data))])
        assert list(plan.grid_thw) == expected["image_grid_thw"].tolist()[0]
        np.testing.assert_array_equal(pixel_values, np.asarray(expected["pixel_values"]))


def test_smart_resize_matches_transformers_on_a_size_grid():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sizes = [1, 2, 13, 27, 28, 29, 55, 56, 57, 100, 223, 640, 1023, 1920, 4000]
    for min_px, max_px in [(56 * 56, 28 * 28 * 1280), (28 * 28 * 4, 28 * 28 * 16)]:
        for h in sizes:
            for w in sizes:
                if max(h, w) / min(h, w) > M.MAX_ASPECT_RATIO:
                    continue
                assert M.smart_resize(h, w, 28, min_px, max_px) == smart_resize(h, w, 28, min_px, max_px), (h, w)


def test_aspect_ratio_over_200_is_rejected_like_transformers(hf_image_processor):
    data = png_bytes(2, 500)
    with pytest.raises(M.MediaError) as err:
        M.plan_image(M.probe_image(data), M.VisionConfig())
    assert err.value.reason == "aspect_ratio_too_extreme"
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        hf_image_processor()(images=[Image.open(io.BytesIO(data))])


def test_undecodable_media_gets_a_reason():
    with pytest.raises(M.MediaError) as err:
        M.probe_image(b"not an image")
    assert err.value.reason == "bad_image"
    with pytest.raises(M.MediaError) as err:
        M.probe_video(b"\x00" * 64)
    assert err.value.reason == "bad_video"


# ---------------------------------------------------------------------------- videos


def test_frame_count_rules():
    cfg = M.VisionConfig()  # fps 2, min 4, max 768 frames, temporal patch 2
    assert M.video_frame_count(num_frames=300, fps=30.0, cfg=cfg) == 20  # 10 s at 2 fps
    assert M.video_frame_count(num_frames=30, fps=30.0, cfg=cfg) == 4  # 1 s -> min_frames
    assert M.video_frame_count(num_frames=3, fps=30.0, cfg=cfg) == 2  # capped by the frames there are
    assert M.video_frame_count(num_frames=1, fps=30.0, cfg=cfg) == 1  # padded to 2 later
    assert M.video_frame_count(num_frames=30 * 3600, fps=30.0, cfg=cfg) == 768  # 1 h -> max_frames
    assert M.video_frame_count(num_frames=41, fps=4.0, cfg=cfg) == 20  # 10.25 s -> 20.5 -> floor to 20
    assert M.video_frame_indices(num_frames=10, n=4, temporal_patch_size=2) == (0, 3, 6, 9)
    assert M.video_frame_indices(num_frames=1, n=1, temporal_patch_size=2) == (0, 0)


def test_long_video_gets_smaller_frames_within_the_total_pixel_budget():
    cfg = M.VisionConfig()
    short = M.plan_video(M.VideoInfo(num_frames=300, fps=30.0, height=720, width=1280), cfg)
    long = M.plan_video(M.VideoInfo(num_frames=30 * 3600, fps=30.0, height=720, width=1280), cfg)
    assert short.grid_thw[0] == 10 and long.grid_thw[0] == 384
    assert long.resized_hw[0] * long.resized_hw[1] < short.resized_hw[0] * short.resized_hw[1]
    # qwen-vl-utils' budget counts one frame per temporal patch (the pair merges into one grid step)
    assert long.resized_hw[0] * long.resized_hw[1] * long.grid_thw[0] <= cfg.video_total_pixels
    assert long.second_per_grid == pytest.approx(2 / (768 / 3600))


# every frame-count edge case around the temporal patch, min_frames, and fps rounding
VIDEO_CASES = [(n, 4.0, "mp4") for n in (1, 2, 3, 4, 5, 7, 8, 9, 17)] + [
    (6, 2.5, "mp4"),
    (25, 29.97, "mp4"),
    (11, 1.0, "mp4"),
    (1, 4.0, "matroska"),  # no frame count in the header: packets are counted
    (9, 25.0, "matroska"),
]


@pytest.mark.parametrize("num_frames,fps,container", VIDEO_CASES)
def test_video_counting_from_header_equals_full_processing(num_frames, fps, container):
    data = video_bytes(num_frames, fps=fps, height=50, width=76, container=container, seed=num_frames)
    info = M.probe_video(data)
    assert (info.num_frames, info.height, info.width) == (num_frames, 50, 76)
    assert info.fps == pytest.approx(fps, rel=1e-3)
    plan = M.plan_video(info, SMALL_VIDEO)
    pixel_values, processed = M.process_video(data, SMALL_VIDEO)
    t, h, w = plan.grid_thw
    assert processed == plan
    assert pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14) and pixel_values.dtype == np.float32
    assert len(plan.frame_indices) == 2 * t and max(plan.frame_indices) < num_frames
    n = M.video_frame_count(num_frames, info.fps, SMALL_VIDEO)
    assert plan.second_per_grid == pytest.approx(2 / (n / num_frames * info.fps))


# Qwen3-VL's rule (frame_sampling: qwen3_vl): the limits bound frames x height x width
SMALL_QWEN3 = M.VisionConfig(patch_size=16, frame_sampling="qwen3_vl", video_min_pixels=32 * 32 * 4,
                             video_max_pixels=32 * 32 * 24)  # fmt: skip


@pytest.mark.parametrize("num_frames,fps,container", VIDEO_CASES)
def test_qwen3_vl_video_counting_from_header_equals_full_processing(num_frames, fps, container):
    """Its plan (tests/test_video_sampling.py: equal to Qwen3VLVideoProcessor's) is what decoding
    makes; a clip of fewer frames than the temporal patch is a named reject, as transformers raises."""
    data = video_bytes(num_frames, fps=fps, height=50, width=76, container=container, seed=num_frames)
    if num_frames < 2:
        with pytest.raises(M.MediaError) as err:
            M.process_video(data, SMALL_QWEN3)
        assert err.value.reason == "video_too_short"
        return
    plan = M.plan_video(M.probe_video(data), SMALL_QWEN3)
    pixel_values, processed = M.process_video(data, SMALL_QWEN3)
    t, h, w = plan.grid_thw
    assert processed == plan
    assert pixel_values.shape == (t * h * w, 3 * 2 * 16 * 16) and pixel_values.dtype == np.float32
    assert len(plan.frame_indices) == 2 * t and max(plan.frame_indices) < num_frames


def test_video_patches_follow_the_image_processors_temporal_patch_layout(hf_image_processor):
    """Each temporal slot of a video patch holds the image processor's patch of that frame (up to
    float32 rounding: frames are normalised as the video processor does, ``(x - 255·mean) /
    (255·std)``, images rescale in float64 first; measured 1.3e-7)."""
    data = video_bytes(4, fps=1.0, height=56, width=84)  # already multiples of 28: no resize
    cfg = M.VisionConfig(video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 12)
    pixel_values, plan = M.process_video(data, cfg)
    assert plan.frame_indices == (0, 1, 2, 3) and plan.grid_thw == (2, 4, 6)
    frames = M.decode_video_frames(data, plan.frame_indices)
    hf = hf_image_processor(min_pixels=28 * 28, max_pixels=28 * 28 * 12)
    ours = pixel_values.reshape(2, 24, 3, 2, 14, 14)  # (t, patches, C, tp, p, p)
    for k, frame in enumerate(frames):
        expected = np.asarray(hf(images=[frame])["pixel_values"]).reshape(24, 3, 2, 14, 14)[:, :, 0]
        np.testing.assert_allclose(ours[k // 2, :, :, k % 2], expected, rtol=0, atol=3e-7)
    assert not np.array_equal(ours[0, :, :, 0], ours[0, :, :, 1])  # frames really differ


def test_decoding_stops_at_missing_frames_with_a_reason():
    data = video_bytes(3)
    with pytest.raises(M.MediaError) as err:
        M.decode_video_frames(data, (0, 5))
    assert err.value.reason == "video_truncated"


def test_vision_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown vision keys"):
        M.VisionConfig.from_mapping({"patch": 14})
    assert M.VisionConfig.from_mapping({"image_mean": [0.5, 0.5, 0.5]}).image_mean == (0.5, 0.5, 0.5)
    assert math.isclose(M.VisionConfig().factor, 28)


def test_vision_settings_come_from_a_models_preprocessor_config(tmp_path, hf_image_processor):
    hf = hf_image_processor(min_pixels=28 * 28 * 3, max_pixels=28 * 28 * 30, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.2, 0.2])
    hf.save_pretrained(tmp_path)
    cfg = M.VisionConfig.from_mapping({"preprocessor_config": str(tmp_path), "max_frames": 64})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.max_frames) == (28 * 28 * 3, 28 * 28 * 30, 64)
    assert cfg.image_mean == (0.5, 0.4, 0.3) and cfg.image_std == (0.2, 0.2, 0.2)
    data = png_bytes(300, 500, seed=9)
    pixel_values, _ = M.process_image(data, cfg)
    np.testing.assert_array_equal(pixel_values, np.asarray(hf(images=[Image.open(io.BytesIO(data))])["pixel_values"]))
    legacy = tmp_path / "legacy.json"  # the Qwen2-VL hub file spells the limits min_pixels / max_pixels
    legacy.write_text('{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}')
    assert M.VisionConfig.from_mapping({"preprocessor_config": str(legacy)}).max_pixels == 12845056


def test_video_counting_equals_processing_with_default_qwen2vl_limits():
    data = video_bytes(9, fps=30.0, height=64, width=96)  # tiny source, upscaled to video_min_pixels
    cfg = M.VisionConfig()
    plan = M.plan_video(M.probe_video(data), cfg)
    pixel_values, processed = M.process_video(data, cfg)
    assert processed == plan and plan.grid_thw == (2, 20, 28) and plan.frame_indices == (0, 3, 5, 8)
    assert pixel_values.shape == (2 * 20 * 28, 1176)
    assert plan.resized_hw[0] * plan.resized_hw[1] >= cfg.video_min_pixels


def test_recipes_choose_the_frame_placement():
    """``data.vision.frame_sampling`` is a recipe key (a string in the schema), checked on use."""
    from omniweave.config import load_recipe

    cfg = load_recipe("demo", ["data.vision.frame_sampling=transformers"])
    assert M.VisionConfig.from_mapping(cfg.data.vision).frame_sampling == "transformers"
    assert M.VisionConfig.from_mapping(load_recipe("demo").data.vision).frame_sampling == "qwen_vl_utils"
    with pytest.raises(ValueError, match="frame_sampling must be one of"):
        M.VisionConfig.from_mapping(load_recipe("demo", ["data.vision.frame_sampling=middle"]).data.vision)
