"""Synthetic test data: tiny images (PNG via Pillow), videos (MPEG-4 via PyAV), and
conversations in the content-list form Hugging Face chat templates expect."""

from __future__ import annotations

import io
import re
from fractions import Fraction

import numpy as np
from PIL import Image


def png_bytes(height: int, width: int, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    img = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8))
    if mode not in ("RGB", "RGBA"):
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def video_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [N, H, W, 3]: smooth moving gradients (compress well, frames clearly differ)."""
    yy, xx = np.mgrid[0:height, 0:width]
    frames = [
        np.stack([(xx * 3 + i * 20 + seed) % 256, (yy * 2 + i * 35) % 256, ((xx + yy) + i * 50) % 256], -1)
        for i in range(num_frames)
    ]
    return np.asarray(frames, dtype=np.uint8)


def video_bytes(
    num_frames: int, fps: float = 4.0, height: int = 64, width: int = 96, container: str = "mp4", seed: int = 0
) -> bytes:
    """An MPEG-4 Part 2 video (the encoder every PyAV wheel ships) in an mp4 or mkv container."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 4  # keyframes + P-frames, like real videos
        for frame in video_frames(num_frames, height, width, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def to_hf_messages(messages) -> list[dict]:
    """Our Messages (with <image>/<video> placeholders) -> the content-list form of Qwen2-VL's template."""
    out = []
    for m in messages:
        parts = []
        for piece in re.split(r"(<image>|<video>)", m.content):
            if piece in ("<image>", "<video>"):
                parts.append({"type": piece[1:-1]})
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m.role, "content": parts})
    return out
