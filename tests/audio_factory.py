"""Real audio files for the audio tests and bench/audio.py, written with PyAV's encoders."""

from __future__ import annotations

import io

import av
import numpy as np

# name -> (container format, encoder, encoder options); vorbis is FFmpeg's native (experimental) encoder
FORMATS = {
    "wav": ("wav", "pcm_s16le", {}),
    "flac": ("flac", "flac", {}),
    "mp3": ("mp3", "libmp3lame", {}),
    "m4a": ("ipod", "aac", {}),
    "ogg": ("ogg", "vorbis", {"strict": "experimental"}),
    "opus": ("ogg", "libopus", {}),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only rates Opus encodes


def available(fmt: str) -> bool:
    return FORMATS[fmt][1] in av.codecs_available


def signal(seconds: float, sample_rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """[channels, n] float32: a different tone per channel plus a little noise, |x| < 0.5."""
    n = round(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    rng = np.random.default_rng(seed)
    tones = [0.3 * np.sin(2 * np.pi * (220 + 170 * c + 13 * seed) * t) for c in range(channels)]
    return (np.stack(tones) + 0.02 * rng.standard_normal((channels, n))).astype(np.float32)


def encode(x: np.ndarray, sample_rate: int, fmt: str, container_options: dict | None = None,
           metadata: dict | None = None) -> bytes:
    """Encode [channels, n] float samples as ``fmt`` (a FORMATS key); returns the file's bytes."""
    container, codec, options = FORMATS[fmt]
    buf = io.BytesIO()
    layout = "mono" if x.shape[0] == 1 else "stereo"
    with av.open(buf, mode="w", format=container, options=container_options or {}) as out:
        out.metadata.update(metadata or {})
        stream = out.add_stream(codec, rate=sample_rate, layout=layout, options=options)
        _mux_samples(out, stream, x, sample_rate, layout)
    return buf.getvalue()


def _mux_samples(out, stream, x: np.ndarray, sample_rate: int, layout: str) -> None:
    """Encode [channels, n] float samples into the audio ``stream`` of container ``out`` in 4000-sample
    frames and flush it."""
    for i in range(0, x.shape[1], 4000):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, i:i + 4000]), format="fltp", layout=layout)
        frame.sample_rate, frame.pts = sample_rate, i
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)


def video_with_audio_bytes(num_frames: int, fps: float, audio_seconds: float, sample_rate: int = 22050,
                           height: int = 64, width: int = 96, seed: int = 0, audio: bool = True) -> bytes:
    """An mp4 with an MPEG-4 Part 2 video stream (``data_factory.video_frames``) and, when ``audio``,
    an AAC sound track of ``audio_seconds`` (stereo ``signal``): a video with its own audio."""
    from fractions import Fraction

    from data_factory import video_frames

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1000))
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = out.add_stream("aac", rate=sample_rate, layout="stereo") if audio else None
        for frame in video_frames(num_frames, height, width, seed):
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if sound is not None:
            _mux_samples(out, sound, signal(audio_seconds, sample_rate, 2, seed), sample_rate, "stereo")
    return buf.getvalue()
