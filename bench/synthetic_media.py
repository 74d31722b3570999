"""Synthetic media of realistic sizes for the benchmarks: gradient+noise JPEGs, moving-pattern MP4s."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
from PIL import Image


def jpeg(height: int, width: int, seed: int, noise: int = 40, quality: int = 85) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx // 3 + seed) % 256, (yy // 2) % 256, (xx + yy) // 4 % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(base + rng.integers(0, noise, base.shape, dtype=np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def mp4(seconds: float, fps: int, height: int, width: int, seed: int, bit_rate: int = 4_000_000) -> bytes:
    import av

    buf = io.BytesIO()
    yy, xx = np.mgrid[0:height, 0:width]
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt, stream.bit_rate = width, height, "yuv420p", bit_rate
        for i in range(int(seconds * fps)):
            frame = np.stack([(xx + 4 * i + seed) % 256, (yy + 2 * i) % 256, (xx + yy + i) % 256], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
