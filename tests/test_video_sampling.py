"""Video sampling per family equals the released video processors (issue 32, item 7): transformers
5.24's ``Qwen2VLVideoProcessor`` (Qwen2-VL, and Qwen2.5-VL, whose model type transformers maps to
it) and ``Qwen3VLVideoProcessor`` (Qwen3-VL).

Each family's processor is loaded by transformers from the ``video_preprocessor_config.json`` our
``hf export`` writes (its class picked by transformers from the model type in ``config.json``);
ours reads the same file (``video_settings_from_hf``). Two settings per family: the released one
(Qwen2-VL's defaults; Qwen3-VL's checkpoints: size 4096..25165824) and a tight one where the pixel
budgets bind and ``min_frames`` is odd.

- header level, on clips of 4, 13, 50 and 301 frames at 2, 6, 24 and 29.97 fps and 97×213,
  480×270, 1280×720 (W×H): transformers' own ``sample_frames`` on a ``VideoMetadata``, its own
  ``resize`` on a meta tensor of the sampled frames (no pixel is made: the target size is all it
  computes there), and its timestamps (``Qwen3VLProcessor._calculate_timestamps``; Qwen2.5-VL's
  ``second_per_grid_ts`` = temporal patch / ``VideoMetadata.sampled_fps``) against our
  header-only plan. Indices, grids, resize targets exact; timestamps exact.
- pixel level, on real MPEG-4 clips decoded by transformers' PyAV reader: the processor run end
  to end (it samples the frames itself) against ``process_video``; frames, grids exact, pixels
  within 1e-5 (float32).

transformers' video processors import torchvision (tests/torchvision_shim.py makes it importable
beside the dev venv's CPU torch); where it is not installed these tests skip.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from omniweave.data.media import vision as M
from omniweave.models.hf.processor_files import video_processor_config
from tests.data_factory import video_bytes

pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")

PIXEL_ATOL = 1e-5  # float32 normalised pixels (measured: 0.0)
QWEN3 = dict(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), frame_sampling="qwen3_vl")
# model type: (processor class our export names, the video processor transformers gives it, vision settings)
FAMILIES = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor", dict(frame_sampling="transformers")),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", dict(frame_sampling="transformers")),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor",
                 dict(QWEN3, video_min_pixels=4096, video_max_pixels=25165824)),  # the released checkpoints'
}  # fmt: skip
TIGHT = {"qwen2": dict(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 12, video_total_pixels=28 * 28 * 61,
                       min_frames=5, max_frames=16),
         "qwen3": dict(video_min_pixels=32 * 32 * 8, video_max_pixels=32 * 32 * 96, min_frames=5, max_frames=16)}  # fmt: skip
SETTINGS = ("released", "tight")
LENGTHS, RATES = (4, 13, 50, 301), (2.0, 6.0, 24.0, 29.97)
SIZES = ((213, 97), (270, 480), (720, 1280))  # (height, width): 97×213 portrait, 480×270, 1280×720
# (frames, fps, height, width) beyond the grid: tight Qwen2-VL samples 12 frames, and transformers'
# integer share of the whole-video budget (47824 · 2 // 12, not 47824 / 12 · 2) decides the size;
# a side under Qwen3-VL's factor 32, which its smart_resize scales up before rounding
EDGES = ((50, 8.0, 305, 270), (13, 6.0, 20, 300), (7, 3.0, 300, 31))


def vision_settings(family: str, setting: str, **extra) -> M.VisionConfig:
    base = FAMILIES[family][2]
    tight = TIGHT["qwen3" if family == "qwen3_vl" else "qwen2"] if setting == "tight" else {}
    return M.VisionConfig(**{**base, **tight, **extra})


@lru_cache(maxsize=None)
def _processor_dir(family: str, setting: str, extra: tuple = ()) -> Path:
    import tempfile

    cfg = vision_settings(family, setting, **dict(extra))
    path = Path(tempfile.mkdtemp(prefix=f"video_{family}_{setting}_"))
    exported = video_processor_config(cfg, FAMILIES[family][0])
    (path / "video_preprocessor_config.json").write_text(json.dumps(exported))
    hf_dir = path / "hf"  # the same file without the class name: transformers picks it from the model type
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": family}))
    (hf_dir / "video_preprocessor_config.json").write_text(
        json.dumps({k: v for k, v in exported.items() if k != "video_processor_type"}))
    return path


def processors(family: str, setting: str, **extra):
    """(transformers' video processor, our VisionConfig read from the same exported file)."""
    from transformers import AutoVideoProcessor

    path = _processor_dir(family, setting, tuple(sorted(extra.items())))
    hf = AutoVideoProcessor.from_pretrained(path / "hf")
    assert type(hf).__name__ == FAMILIES[family][1]
    common = {k: v for k, v in FAMILIES[family][2].items() if k in ("patch_size", "image_mean", "image_std")}
    ours = M.VisionConfig(**{**common, **M.video_settings_from_hf(path)})
    assert ours == vision_settings(family, setting, **extra)  # the file carries every video setting
    return hf, ours


def hf_plan(hf, num_frames: int, fps: float, height: int, width: int):
    """transformers' own choices for a clip's header: (sampled indices, resized (h, w), grid)."""
    from transformers.video_utils import VideoMetadata

    indices = [int(i) for i in hf.sample_frames(VideoMetadata(total_num_frames=num_frames, fps=fps))]
    tp = hf.temporal_patch_size
    frames = torch.empty((1, len(indices), 3, height, width), dtype=torch.uint8, device="meta")
    resized = hf.resize(frames, size=hf.size, resample=hf.resample, factor=hf.patch_size * hf.merge_size,
                        temporal_factor=tp, cap_pixels_per_frame=hf.cap_pixels_per_frame)  # fmt: skip
    h, w = resized.shape[-2:]
    return indices, (h, w), (math.ceil(len(indices) / tp), h // hf.patch_size, w // hf.patch_size)


def padded(indices: list[int], tp: int) -> list[int]:  # the last frame repeated, as transformers' patchify does
    return indices + indices[-1:] * (-len(indices) % tp)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_header_plan_equals_the_released_video_processor(family, setting):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    hf, cfg = processors(family, setting)
    tp = cfg.temporal_patch_size
    wrong = []
    for n, fps, h, w in [(n, fps, h, w) for n in LENGTHS for fps in RATES for h, w in SIZES] + list(EDGES):
        indices, resized, grid = hf_plan(hf, n, fps, h, w)
        plan = M.plan_video(M.VideoInfo(num_frames=n, fps=fps, height=h, width=w), cfg)
        got = (list(plan.frame_indices), plan.resized_hw, plan.grid_thw)
        want = (padded(indices, tp), resized, grid)
        if family == "qwen3_vl":  # <t seconds> of each temporal patch
            got += (M.video_timestamps(plan.frame_indices, fps, tp),)
            want += (Qwen3VLProcessor._calculate_timestamps(None, indices, fps, tp),)
        else:  # Qwen2.5-VL's second_per_grid_ts: temporal patch / the sampled frames' rate
            got += (plan.second_per_grid,)
            want += (tp / VideoMetadata(total_num_frames=n, fps=fps, frames_indices=indices).sampled_fps,)
        if got != want:
            wrong.append(f"{n} frames at {fps} fps, {w}x{h}: ours {got}, transformers {want}")
    assert not wrong, "\n".join(wrong)


def _decoded(tmp_path, data: bytes):
    """All frames of the file and its metadata, decoded by transformers' PyAV reader."""
    from transformers.video_utils import load_video

    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    return load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))


def _end_to_end(tmp_path, family: str, setting: str, clip: tuple, **extra):
    """(transformers' output and the frames it sampled, padded; our pixels and plan) for one real clip."""
    n, fps, h, w = clip
    data = video_bytes(n, fps=fps, height=h, width=w, seed=n)
    hf, cfg = processors(family, setting, **extra)
    assert hf.do_sample_frames  # it picks the frames itself
    frames, metadata = _decoded(tmp_path, data)
    want = hf(videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt")
    plan = M.plan_video(M.probe_video(data), cfg)
    got, _ = M.process_video(data, cfg, plan)
    picked = [int(i) for i in want["video_metadata"][0].frames_indices]
    return want, padded(picked, cfg.temporal_patch_size), got, plan


# (frames, fps, height, width): portrait and landscape, odd sides; 301 frames at NTSC's 29.97 fps
CLIPS = [(13, 6.0, 213, 97), (4, 2.0, 270, 480), (50, 24.0, 213, 97), (301, 29.97, 72, 128), (30, 10.0, 77, 131)]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_decoded_pixels_equal_the_released_video_processor(tmp_path, family, setting, clip):
    """Qwen2-VL's processor is the same class as Qwen2.5-VL's (tests/test_video_parity.py runs it too)."""
    want, picked, got, plan = _end_to_end(tmp_path, family, setting, clip)
    assert list(plan.frame_indices) == picked
    assert want["video_grid_thw"][0].tolist() == list(plan.grid_thw)
    assert want["pixel_values_videos"].shape == got.shape
    assert (want["pixel_values_videos"] - torch.from_numpy(got)).abs().max().item() <= PIXEL_ATOL


@pytest.mark.parametrize("extra", [dict(fps=3.0), dict(min_frames=6)], ids=["fps3", "min_frames6"])
def test_the_issue_clip_13_frames_at_6_fps(tmp_path, extra):
    """The clip of the issue: 13 frames at 6 fps, sampled to 6 frames. transformers' Qwen3-VL video
    processor takes 0 2 5 7 10 12 (a rounded linspace), which Qwen3-VL now does; Qwen2-VL's takes
    0 2 4 6 8 10 (a truncated arange), the placement Qwen3-VL videos used to get."""
    clip = (13, 6.0, 213, 97)
    want, picked, got, plan = _end_to_end(tmp_path, "qwen3_vl", "released", clip, **extra)
    assert picked == [0, 2, 5, 7, 10, 12] == list(plan.frame_indices)
    assert want["video_grid_thw"][0].tolist() == list(plan.grid_thw)
    assert (want["pixel_values_videos"] - torch.from_numpy(got)).abs().max().item() <= PIXEL_ATOL
    qwen2, qwen2_cfg = processors("qwen2_vl", "released", **extra)
    assert hf_plan(qwen2, 13, 6.0, 213, 97)[0] == [0, 2, 4, 6, 8, 10]
    assert list(M.plan_video(M.VideoInfo(13, 6.0, 213, 97), qwen2_cfg).frame_indices) == [0, 2, 4, 6, 8, 10]


def test_qwen3_vl_refuses_clips_shorter_than_a_temporal_patch():
    """A 1-frame clip: transformers' Qwen3-VL smart_resize raises (t < temporal_factor); ours
    rejects it by name. Qwen2-VL's rule keeps it (one frame, padded)."""
    hf, cfg = processors("qwen3_vl", "released")
    with pytest.raises(ValueError, match="temporal_factor"):
        hf_plan(hf, 1, 2.0, 64, 64)
    with pytest.raises(M.MediaError) as err:
        M.plan_video(M.VideoInfo(num_frames=1, fps=2.0, height=64, width=64), cfg)
    assert err.value.reason == "video_too_short"
    assert M.plan_video(M.VideoInfo(1, 2.0, 64, 64), M.VisionConfig()).frame_indices == (0, 0)


def test_settings_no_rule_reproduces_are_refused(tmp_path):
    """Sampling a fixed number of frames, and Qwen3-VL's per-frame cap, are not implemented: reading
    such a file fails, naming the key, instead of planning other frames than transformers."""
    file = tmp_path / "video_preprocessor_config.json"
    for cfg, key in (({"video_processor_type": "Qwen3VLVideoProcessor", "num_frames": 8, "fps": None}, "num_frames"),
                     ({"video_processor_type": "Qwen3VLVideoProcessor", "cap_pixels_per_frame": True}, "cap_pixels"),
                     ({"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": None}, "fps")):  # fmt: skip
        file.write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=key):
            M.video_settings_from_hf(file)


def test_export_refuses_a_sampling_rule_its_video_processor_does_not_follow():
    with pytest.raises(ValueError, match="Qwen3VLVideoProcessor samples videos as qwen3_vl"):
        video_processor_config(M.VisionConfig(patch_size=16), "Qwen3VLProcessor")
    with pytest.raises(ValueError, match="qwen_vl_utils or transformers"):
        video_processor_config(M.VisionConfig(frame_sampling="qwen3_vl"), "Qwen2_5_VLProcessor")
