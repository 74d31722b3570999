"""``rope: mrope_qwen3vl``: a video written per temporal patch as ``<t seconds>`` + vision_start +
pads + vision_end, from media headers only, against transformers' own Qwen3-VL code.

transformers' Qwen3VLVideoProcessor needs torchvision (not installed here), so ``Qwen3VLProcessor``
cannot run end to end: the expected text comes from its ``replace_video_token`` (and through it
``_calculate_timestamps``) called with our sampled frames and the stream's fps, the expected
positions from ``Qwen3VLModel.get_rope_index`` of a tiny model, and images from
``Qwen2VLImageProcessorPil`` with Qwen3-VL's patch 16 and mean/std 0.5."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from data_factory import png_bytes, video_bytes

from omniweave.data.media import vision as M
from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.template import IGNORE_INDEX, encode_conversation
from omniweave.data.text.tokenize import SampleProcessor

# Qwen3-VL processing (patch 16 -> resize factor 32, mean/std 0.5) with small pixel budgets
VISION = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "min_pixels": 32 * 32 * 2,
          "max_pixels": 32 * 32 * 24, "video_min_pixels": 32 * 32 * 2, "video_max_pixels": 32 * 32 * 12,
          "video_total_pixels": 32 * 32 * 80}  # fmt: skip
IMG = png_bytes(70, 100, seed=1)
VID = video_bytes(11, fps=3.0, height=60, width=90, seed=3)  # 6 sampled frames of 11 at 3 fps: 3 temporal patches


def sample(text: str, images=(), videos=()) -> RawSample:
    media = {f"img{i}.png": b for i, b in enumerate(images)} | {f"vid{i}.mp4": b for i, b in enumerate(videos)}
    conv = Conversation(id="s", messages=[Message("user", text), Message("assistant", "Stripes, then more.")],
                        images=[k for k in media if k.startswith("img")], videos=[k for k in media if k.startswith("vid")])  # fmt: skip
    return RawSample(key="s", conversation=conv, media=media)


@pytest.fixture(scope="module")
def proc():
    return SampleProcessor({"tokenizer": "demo", "template": "chatml", "max_len": 4096, "rope": "mrope_qwen3vl",
                            "vision": VISION})  # fmt: skip


def hf_video_text(proc: SampleProcessor, data: bytes) -> str:
    """transformers' Qwen3VLProcessor.replace_video_token for our plan of ``data``."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    plan = proc.plan_media("video", data)
    stub = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                           vision_end_token="<|vision_end|>")  # fmt: skip
    stub._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(stub, *a)
    meta = SimpleNamespace(fps=M.probe_video(data).fps, frames_indices=list(plan.frame_indices))
    inputs = {"video_grid_thw": torch.tensor([plan.grid_thw]), "video_metadata": [meta]}
    return Qwen3VLProcessor.replace_video_token(stub, inputs, 0)


def test_video_tokens_equal_the_qwen3vl_processor_text(proc):
    """transformers' recipe: render the chat template, replace each pad token by the processor's
    string (the template's own vision_start / vision_end stay around the video), tokenize."""
    raw = sample("<image> and <video>: what moves?", images=[IMG], videos=[VID])
    got = proc.tokenize(raw)
    image, video = got.media
    _, _, rendered, _ = encode_conversation(proc.template, proc.tokenizer, raw.conversation.messages)
    hf_video = hf_video_text(proc, VID)
    # frames 0, 2, …, 10 of 11 at 3 fps, paired: (0 + 2) / 2 / 3 = 0.33 s, 1.67 s, 3.0 s
    assert [p.split(" seconds>")[0] for p in hf_video.split("<")[1:] if " seconds>" in p] == ["0.3", "1.7", "3.0"]
    text = rendered.text.replace("<|image_pad|>", "<|image_pad|>" * image.length).replace("<|video_pad|>", hf_video)
    assert "<|vision_start|><0.3 seconds><|vision_start|>" in text
    assert got.input_ids.tolist() == proc.tokenizer.encode(text)


def test_runs_labels_and_counting_equal_processing(proc):
    raw = sample("<video> then <image>?", images=[IMG], videos=[VID])
    got = proc.tokenize(raw)
    video, image = got.media
    t, h, w = video.grid_thw
    assert len(video.pieces) == t and all(n == h * w // 4 for _, n in video.pieces) and video.length == t * h * w // 4
    assert image.pieces is None and image.ranges() == [(image.start, image.length)]
    pad = proc.video_pad_id
    for start, n in video.pieces:
        assert (got.input_ids[start : start + n] == pad).all() and got.input_ids[start - 1] == proc.vision_start_id
        assert got.input_ids[start + n] == proc.vision_end_id
    assert (got.input_ids == pad).sum() == video.length
    assert (got.labels[video.start : video.end] == IGNORE_INDEX).all()
    for span in got.media:  # header counting == decoding
        pixels = proc.process_media(span, raw.media[span.part])
        assert pixels.shape == (np.prod(span.grid_thw), 3 * 2 * 16 * 16)


def test_positions_equal_transformers_get_rope_index(proc):
    from transformers import Qwen3VLModel

    from qwen3_vl_factory import tiny_hf_config

    got = proc.tokenize(sample("<image> and <video>, <video>?", images=[IMG], videos=[VID, video_bytes(5, 2.0, 40, 70, seed=4)]))
    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen3_vl")
    cfg.text_config.vocab_size = proc.tokenizer.vocab_size
    model = Qwen3VLModel(cfg)
    ids = torch.from_numpy(got.input_ids.astype(np.int64))[None]
    tt = torch.zeros_like(ids)
    tt[ids == proc.image_pad_id], tt[ids == proc.video_pad_id] = 1, 2
    grids = {k: torch.tensor([s.grid_thw for s in got.media if s.kind == k]) for k in ("image", "video")}
    pos, _ = model.get_rope_index(ids, mm_token_type_ids=tt, image_grid_thw=grids["image"],
                                  video_grid_thw=grids["video"], attention_mask=torch.ones_like(ids))  # fmt: skip
    assert torch.equal(pos[:, 0], torch.from_numpy(got.position_ids.astype(np.int64)))
    # the temporal axis restarts per patch: no video token has a temporal id beyond its block start
    video = got.media[1]
    starts = [got.position_ids[0, s] for s, _ in video.pieces]
    assert all(got.position_ids[0, s : s + n].max() == got.position_ids[0, s] for s, n in video.pieces) and len(set(starts)) == 3


def test_timestamps_follow_hf_calculate_timestamps():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices, fps in (([0, 2, 4, 7, 9, 10], 3.0), ([0, 3, 5], 2.5), ([1, 1], 30.0)):
        want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert M.video_timestamps(tuple(indices), fps, 2) == want


def test_images_equal_the_hf_image_processor_with_patch_16():
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = M.VisionConfig.from_mapping(VISION)
    assert cfg.factor == 32
    hf = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, size={"shortest_edge": VISION["min_pixels"],
                                                             "longest_edge": VISION["max_pixels"]})  # fmt: skip
    out = hf(images=[Image.open(io.BytesIO(IMG))], return_tensors="np")
    ours, plan = M.process_image(IMG, cfg)
    assert list(out["image_grid_thw"][0]) == list(plan.grid_thw)
    assert np.abs(np.asarray(out["pixel_values"]) - ours).max() <= 1e-5
