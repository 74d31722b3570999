"""The packing's frame reader (data/packing/video_frames.FrameReader: one forward-moving decoder per
video file) returns, for every query order, the bytes a fresh seek returns (``decode_frame_png``,
lerobot's nearest-frame-within-tolerance rule), and rejects a timestamp with no frame near it."""

from __future__ import annotations

import numpy as np
import pytest

from omniweave.data.packing.video_frames import FORWARD_S, FrameReader, decode_frame_png
from omniweave.data.sources.lerobot_write import write_video
from omniweave.data.text.tokenize import SampleRejected

FPS = 10


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    """60 frames (6 s at 10 fps), each a different flat grey, keyframes every 7 frames."""
    frames = np.repeat(np.arange(0, 240, 4, dtype=np.uint8)[:, None, None, None], 16, 1).repeat(16, 2).repeat(3, 3)
    path = tmp_path_factory.mktemp("frames") / "cam.mp4"
    write_video(path, frames, fps=FPS, gop=7)
    return path


@pytest.mark.parametrize("order", ["forward", "backward", "jumps", "repeats"])
def test_every_query_order_gives_a_fresh_seeks_frame(video, order):
    times = [i / FPS for i in range(60)]
    queries = {"forward": times, "backward": times[::-1],
               "jumps": [0.0, 0.1, 5.0, 0.3, 2.5, 2.6, 5.9, 1.0],  # past FORWARD_S ahead, and back
               "repeats": [1.2, 1.2, 1.3, 1.3, 0.0, 0.0]}[order]
    assert max(queries) > FORWARD_S or order == "repeats"
    reader = FrameReader()
    got = [reader.png(video, t) for t in queries]
    reader.close()
    assert got == [decode_frame_png(video, t) for t in queries]
    assert len(set(got)) == len(set(queries))  # distinct frames for distinct times


def test_a_time_between_frames_is_a_counted_reject(video):
    reader = FrameReader()
    reader.png(video, 1.0)
    with pytest.raises(SampleRejected) as err:
        reader.png(video, 1.05)  # half a frame from both neighbours; lerobot's tolerance is 1e-4 s
    assert err.value.reason == "frame_timestamp_mismatch"
    assert reader.png(video, 1.1) == decode_frame_png(video, 1.1)
    reader.close()
