"""InternVL dynamic tiling (media/tiling.py) against transformers' GotOcr2ImageProcessorPil with
crop_to_patches=True, as InternVLProcessor uses it: the grid rule, tile counts from headers, pixel
values bit-equal, header plan == full decode, the patch layout a Conv2d patch embedding reads, and
clear rejects. Videos (one tile per frame) against InternVLVideoProcessor and InternVLProcessor:
the frames sampled, their pixels, the frames' text."""

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
from omniweave.data.text.tokenize import SampleProcessor

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
    raw = RawSample(key="v", conversation=video, media={"v.mp4": video_bytes(4)})  # 4 frames at 4 fps: 2 at 2 fps
    (span,) = proc.tokenize(raw).media  # the min_frames default (4) keeps all 4
    assert tuple(span.grid_thw) == (4, 4, 4) and span.pieces == [(s, 4) for s, _ in span.pieces]
    assert proc.process_media(span, raw.media["v.mp4"]).shape == (64, 3 * P * P)


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


# ---------------------------------------------------------------------------- videos: one tile per frame


def hf_video_processor(tile: int):
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    return InternVLVideoProcessor(size={"height": tile, "width": tile}, **IMAGENET)


IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def video_cases(n: int, seed: int) -> list[tuple[int, float, float]]:
    """(frames, stream fps, sampling fps): short and long clips, common and odd frame rates."""
    rng = np.random.default_rng(seed)
    rates = [1.0, 2.5, 7.0, 10.0, 23.976023976023978, 24.0, 25.0, 29.97002997002997, 30.0, 60.0]
    fixed = [(1, 30.0, 2.0), (2, 1.0, 1.0), (30, 10.0, 2.0), (8, 4.0, 2.0), (300, 29.97002997002997, 1.0),
             (17, 7.0, 3.0), (1000, 60.0, 0.5), (61, 30.0, 30.0), (10, 25.0, 60.0), (3, 24.0, 2.0)]
    out = list(fixed)
    while len(out) < n:
        out.append((int(np.exp(rng.uniform(0, np.log(2000)))), float(rng.choice(rates)), float(rng.choice([0.5, 1.0, 2.0, 3.0, 4.5]))))
    return out


def test_frame_indices_equal_internvl_video_processor_sample_frames():
    """Our header plan's frames == InternVLVideoProcessor.sample_frames(fps=...) wherever its count
    is within our limits (min_frames 1: every case where it samples at all); elsewhere == its
    sample_frames(num_frames=our clamped count)."""
    from transformers.video_utils import VideoMetadata

    hf = hf_video_processor(448)
    within = 0
    for frames, rate, fps in video_cases(60, seed=0):
        meta = VideoMetadata(total_num_frames=frames, fps=rate)
        info = M.VideoInfo(num_frames=frames, fps=rate, height=90, width=160)
        for lo, hi in [(1, 10_000), (4, 32)]:
            plan = M.plan_video(info, internvl(fps=fps, min_frames=lo, max_frames=hi))
            wanted = int(frames / rate * fps)
            if lo <= wanted <= min(hi, frames):
                within += 1
                assert list(plan.frame_indices) == hf.sample_frames(meta, fps=fps).tolist(), (frames, rate, fps, lo, hi)
            n = len(plan.frame_indices)
            assert n == max(1, min(max(wanted, lo), hi, frames))
            assert list(plan.frame_indices) == hf.sample_frames(meta, num_frames=n).tolist(), (frames, rate, fps, lo, hi)
            assert plan.grid_thw == (n, 32, 32) and plan.resized_hw == (448, 448) and plan.num_tokens(2) == n * 256
    assert within >= 60  # of 120 (64): the fps rule itself, not only the clamp, is compared


def test_min_equal_max_frames_is_transformers_num_frames():
    from transformers.video_utils import VideoMetadata

    hf = hf_video_processor(448)
    for frames, rate, _ in video_cases(30, seed=1):
        for k in (1, 3, 8, 16):
            if k <= frames:
                plan = M.plan_video(M.VideoInfo(frames, rate, 64, 64), internvl(min_frames=k, max_frames=k))
                assert list(plan.frame_indices) == hf.sample_frames(VideoMetadata(total_num_frames=frames, fps=rate),
                                                                    num_frames=k).tolist()  # fmt: skip


VIDEO_CLIPS = [  # (frames, fps, height, width, container, tile, sampling fps)
    (9, 4.0, 64, 96, "mp4", 56, 2.0),
    (30, 10.0, 77, 131, "mp4", 84, 2.0),  # not round, landscape
    (48, 24.0, 150, 90, "mp4", 56, 3.0),  # portrait
    (5, 2.0, 50, 50, "mp4", 84, 1.0),  # frames upscaled to the tile
    (61, 30.0, 60, 100, "mp4", 56, 4.0),
]


@pytest.mark.parametrize("clip", VIDEO_CLIPS, ids=lambda c: "x".join(map(str, c)))
def test_video_pixels_equal_internvl_video_processor(tmp_path, clip):
    """The file decoded by transformers' PyAV reader and sampled by InternVLVideoProcessor itself
    (do_sample_frames, fps) vs our header plan + decode: same frames, pixel values bit-equal (the
    same torchvision uint8 bicubic antialiased resize and float32 normalisation)."""
    from transformers.video_utils import load_video

    frames, rate, h, w, container, tile, fps = clip
    data = video_bytes(frames, fps=rate, height=h, width=w, container=container, seed=frames)
    cfg = internvl(tile, fps=fps, min_frames=1, image_mean=tuple(IMAGENET["image_mean"]),
                   image_std=tuple(IMAGENET["image_std"]))  # fmt: skip
    path = tmp_path / f"clip.{container}"
    path.write_bytes(data)
    decoded, meta = load_video(str(path), backend="pyav",
                               sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))  # fmt: skip
    want = hf_video_processor(tile)(videos=[decoded], video_metadata=[meta], do_sample_frames=True, fps=fps,
                                    return_metadata=True, return_tensors="pt")  # fmt: skip
    plan = M.plan_video(M.probe_video(data), cfg)
    assert list(plan.frame_indices) == want["video_metadata"][0].frames_indices.tolist()
    pixel_values, got_plan = M.process_video(data, cfg)
    assert got_plan == plan and plan.grid_thw == (len(plan.frame_indices), tile // P, tile // P)
    assert pixel_values.dtype == np.float32 and pixel_values.shape == (plan.grid_thw[0] * (tile // P) ** 2, 3 * P * P)
    expected = want["pixel_values_videos"][0].numpy()  # [frames, 3, tile, tile]
    assert np.abs(to_tiles(pixel_values, plan) - expected).max() == 0.0


@pytest.mark.parametrize("num_frames", [1, 2, 5])
def test_frames_text_equals_internvl_processor_replace_video_token(num_frames):
    """The released chat template's text with "<video>" replaced by InternVLProcessor's own
    replace_video_token for the same frames == our ids (decoded, and as the whole text tokenized
    at once); one run of pads per frame, the pads the image pad (<IMG_CONTEXT>)."""
    from pathlib import Path
    from types import SimpleNamespace

    from data_factory import to_hf_messages
    from transformers.models.internvl.processing_internvl import InternVLProcessor
    from transformers.utils.chat_template_utils import render_jinja_template

    proc = SampleProcessor({"tokenizer": "demo", "template": "internvl", "rope": "rope1d",
                            "vision": {"tiling": "internvl", "tile_size": 56, "temporal_patch_size": 1,
                                       "min_frames": num_frames, "max_frames": num_frames}})  # fmt: skip
    for content in ("<video>What moves?", "<image><video>\nAnd here?", "<video><video>Two."):
        parts = content.count("<video>")
        msgs = [Message("user", content), Message("assistant", "Noise.")]
        conv = Conversation(id="v", messages=msgs, images=["a.png"] * ("<image>" in content),
                            videos=[f"v{i}.mp4" for i in range(parts)])  # fmt: skip
        media = {"a.png": png_bytes(40, 90, seed=1)} | {f"v{i}.mp4": video_bytes(6 + i, seed=i) for i in range(parts)}
        sample = proc.tokenize(RawSample(key="v", conversation=conv, media=media))
        jinja = (Path(__file__).parent / "assets" / "chat_templates" / "internvl_hf.jinja").read_text()
        (text,), _ = render_jinja_template([to_hf_messages(msgs)], chat_template=jinja)
        hf = SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<IMG_CONTEXT>",
                             image_seq_length=4)  # fmt: skip
        frames = InternVLProcessor.replace_video_token(hf, {"pixel_values_videos": [np.zeros((num_frames, 3, 56, 56))]}, 0)
        assert frames.count("Frame") == num_frames and frames.startswith("Frame1: <img><IMG_CONTEXT>")
        image = "".join("<img>" + "<IMG_CONTEXT>" * m.length + "</img>" for m in sample.media if m.kind == "image")
        want = text.replace("<IMG_CONTEXT>\n", image + "\n").replace("<video>", frames)  # InternVLProcessor's framing
        assert proc.tokenizer.decode(sample.input_ids) == want
        assert sample.input_ids.tolist() == proc.tokenizer.encode(want)
        for span in (m for m in sample.media if m.kind == "video"):
            assert tuple(span.grid_thw) == (num_frames, 4, 4) and len(span.ranges()) == num_frames
            assert all(n == 4 and set(sample.input_ids[s:s + n]) == {proc.image_pad_id} for s, n in span.ranges())
            assert proc.tokenizer.decode(sample.input_ids[span.ranges()[0][0] - 5:span.ranges()[0][0]]).endswith("Frame1: <img>")


def test_video_plan_from_the_header_equals_the_decode_and_an_empty_stream_is_a_media_error():
    cfg = internvl(56)
    data = video_bytes(13, fps=5.0, height=40, width=70, seed=2)
    plan = M.plan_video(M.probe_video(data), cfg)
    assert plan.frame_indices == (1, 3, 6, 9, 11) and plan.grid_thw == (5, 4, 4)  # int(13 / 5 s * 2) = 5, from 1.3 by 2.6
    _, decoded = M.process_video(data, cfg)
    assert decoded == plan
    with pytest.raises(M.MediaError) as err:
        M.plan_video(M.VideoInfo(num_frames=0, fps=4.0, height=64, width=96), cfg)
    assert err.value.reason == "video_no_frames"
