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


def png_with_garbage_pixels(data: bytes, seed: int = 0) -> bytes:
    """A PNG whose image data (IDAT) is replaced by random bytes of the same length, every chunk CRC
    recomputed: its header reads and Pillow's ``verify`` passes, its pixels do not decode."""
    import struct
    import zlib

    out, pos, rng = bytearray(data[:8]), 8, np.random.default_rng(seed)
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IDAT":
            body = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        out += struct.pack(">I", length) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        pos += 12 + length
    return bytes(out)


def truncated_jpeg(height: int = 64, width: int = 64, keep: float = 0.6) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()[: int(len(buf.getvalue()) * keep)]


def blank_png(side: int) -> bytes:
    """A valid grey ``side`` x ``side`` PNG (12000 px: ~140 KB on disk, 144 MB of pixels), written
    row by row so making it costs no more memory than the file."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z, row, parts = zlib.compressobj(9), b"\0" * (side + 1), []
    for _ in range(side):
        parts.append(z.compress(row))
    parts.append(z.flush())
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


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
