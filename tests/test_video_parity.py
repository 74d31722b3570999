"""Video parity with transformers' Qwen2-VL / Qwen2.5-VL video processor on real clips (issue 19,
item 6): the frames we pick, their resize and normalisation, the grids and so the token counts.

Clips are real MPEG-4 files (PyAV-encoded, non-round sizes, portrait and landscape, several frame
rates). Both sides decode them with PyAV. transformers' side is ``Qwen2VLVideoProcessor`` loaded
from the ``video_preprocessor_config.json`` our ``hf export`` writes (``do_sample_frames``: it picks
the frames itself from the stream metadata); ours reads the same file (``video_settings_from_hf``:
``frame_sampling: transformers``). With our default placement (qwen-vl-utils') transformers is fed
the frames qwen-vl-utils would pick, as Qwen's model cards do.

transformers' video processors need torchvision (importable beside the CPU torch through tests/torchvision_shim.py);
where it is not installed these tests skip.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omniweave.data.media import vision as M
from omniweave.models.hf.processor_files import video_processor_config
from tests.data_factory import video_bytes

pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")

PIXEL_ATOL = 1e-6  # float32 normalised pixels (measured: 0.0)

# (frames, fps, height, width): landscape and portrait, sides that are not multiples of 28
CLIPS = [(9, 4.0, 64, 96), (30, 10.0, 77, 131), (48, 24.0, 150, 90), (5, 2.0, 50, 50), (61, 30.0, 60, 100),
         (90, 10.0, 100, 150)]  # the last: 16 frames (max_frames), each capped by the whole-video budget
# small pixel limits keep the clips tiny; the total budget caps the longer clips' frames
VISION = dict(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 12, video_total_pixels=28 * 28 * 60,
              min_frames=4, max_frames=16)  # fmt: skip


def _hf_processor(tmp_path, vision: M.VisionConfig):
    from transformers import AutoVideoProcessor

    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(vision, "Qwen2VLProcessor")))
    return AutoVideoProcessor.from_pretrained(tmp_path)


def _decoded(tmp_path, data: bytes):
    """All frames of the file and its metadata, decoded by transformers' PyAV reader."""
    from transformers.video_utils import load_video

    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    return load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "x".join(map(str, c)))
def test_transformers_sampling_resize_and_normalise_equal_the_video_processor(tmp_path, clip):
    n, fps, h, w = clip
    data = video_bytes(n, fps=fps, height=h, width=w, seed=n)
    exported = M.VisionConfig(**VISION, frame_sampling="transformers")
    hf = _hf_processor(tmp_path, exported)
    ours_cfg = M.VisionConfig(**{**VISION, **M.video_settings_from_hf(tmp_path)})
    assert ours_cfg.frame_sampling == "transformers"  # read from do_sample_frames

    frames, metadata = _decoded(tmp_path, data)
    want = hf(videos=[frames], video_metadata=[metadata], return_tensors="pt")
    plan = M.plan_video(M.probe_video(data), ours_cfg)
    got, _ = M.process_video(data, ours_cfg, plan)

    wanted_indices = hf.sample_frames(metadata).tolist()
    assert list(plan.frame_indices[: len(wanted_indices)]) == wanted_indices
    assert want["video_grid_thw"][0].tolist() == list(plan.grid_thw)
    assert (want["pixel_values_videos"] - torch.from_numpy(got)).abs().max().item() <= PIXEL_ATOL


@pytest.mark.parametrize("clip", CLIPS[:3], ids=lambda c: "x".join(map(str, c)))
def test_qwen_vl_utils_frames_fed_to_the_video_processor_give_our_pixels(tmp_path, clip):
    """Our default placement (qwen-vl-utils' rounded linspace) given to transformers as the model
    cards do it (``do_sample_frames=False``): same grid, same pixels."""
    n, fps, h, w = clip
    data = video_bytes(n, fps=fps, height=h, width=w, seed=n)
    cfg = M.VisionConfig(**VISION)
    hf = _hf_processor(tmp_path, cfg)
    plan = M.plan_video(M.probe_video(data), cfg)
    frames, _ = _decoded(tmp_path, data)
    unpadded = sorted(set(plan.frame_indices)) if len(set(plan.frame_indices)) < len(plan.frame_indices) else plan.frame_indices
    want = hf(videos=[frames[list(unpadded)]], do_sample_frames=False, return_tensors="pt")
    got, _ = M.process_video(data, cfg, plan)
    assert want["video_grid_thw"][0].tolist() == list(plan.grid_thw)
    assert (want["pixel_values_videos"] - torch.from_numpy(got)).abs().max().item() <= PIXEL_ATOL


def test_frame_placements_differ_where_the_references_do():
    """qwen-vl-utils rounds a linspace over [0, n-1]; transformers truncates an arange over [0, n)."""
    assert M.video_frame_indices(30, 6, 2) == (0, 6, 12, 17, 23, 29)
    assert M.video_frame_indices(30, 6, 2, "transformers") == (0, 5, 10, 15, 20, 25)
    with pytest.raises(ValueError, match="frame_sampling"):
        M.VisionConfig(frame_sampling="middle")
