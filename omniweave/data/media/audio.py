"""Audio the Qwen2-Audio / Qwen2.5-Omni way: header probing, decoding to 16 kHz mono, token counts.

Two paths that must always agree (as for images and videos in ``vision.py``):

    audio_tokens(probe_audio(data), family)      header only -> token count          (packing time)
    load_audio(data) -> log_mel(...) -> frames   decode + resample + log-mel features (train time)

The bridge is the sample count at 16 kHz: ``probe_audio`` derives it from the header alone
(``AudioInfo.num_samples(16000)``) and ``load_audio`` always returns exactly that many samples, so
every count computed from it (mel frames, encoder tokens, 30 s chunks) is the same on both paths.

How the decoded length relates to the header (measured on PyAV 18 / FFmpeg encoders, see
tests/test_audio.py): wav, flac, mp3 with a Xing/LAME tag and Opus (after subtracting its
pre-skip, which FFmpeg's Ogg demuxer leaves in the duration) decode to exactly the header's sample
count; AAC in mp4/m4a decodes up to one 1024-sample frame of encoder padding past the end that the
edit list cuts off. The resampler's flushed output is within a couple of samples of
``num_samples * 16000 / rate``. ``load_audio`` therefore trims the tail / zero-pads to the header
count, and refuses (``MediaError("audio_truncated")`` / ``"audio_length_mismatch"``) when the
decoded audio ends more than ``MAX_SHORT_S`` before or ``MAX_EXTRA_S`` after the header's end -- a
truncated or lying file, whose token count planned at packing time would be wrong.

Truncation is caught where the header states the length: mp4/m4a (no ``moov``: unreadable), flac
and mp3 with a Xing tag (decoded short of the header), wav (the ``data`` chunk's declared size vs
the bytes present, checked here because FFmpeg silently clamps the duration to the file size). Ogg
and raw streams have no total length in a header: a file cut at a page / frame boundary reads as
shorter audio, consistently on both paths.

Headers without a reliable duration -- raw ADTS AAC and mp3 without a Xing/Info/VBRI tag, where
FFmpeg only *estimates* the duration from the bitrate, or any stream without a duration -- are
demuxed packet by packet (compressed data is read, nothing is decoded) and the packet durations
summed.

Long audio (see docs/audio.md): Qwen2-Audio's encoder takes exactly 30 s (3000 mel frames), so
longer audio is split into ``ceil(n / 30 s)`` consecutive near-equal chunks, each its own encoder
item padded to 30 s, and the token counts are summed (nothing is dropped, no chunk is tiny).
Qwen2.5-Omni's tower runs any length in 2 * n_window = 200-frame chunks and pools over the whole
clip, so one clip is one item: the count is that of ``WhisperFeatureExtractor(truncation=False)``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Mapping

import numpy as np

from omniweave.data.media.vision import MediaError
from omniweave.data.media.mel import CHUNK_SAMPLES, SAMPLE_RATE, mel_frames

WINDOW_SAMPLES = CHUNK_SAMPLES  # 30 s at 16 kHz: Qwen2-Audio's fixed encoder input

MAX_EXTRA_S = 0.25  # decoded past the header's end: codec padding is < 1 frame (1024 AAC samples)
MAX_SHORT_S = 0.001  # decoded short of the header's end: the resampler is off by <= 1 sample
_ESTIMATED_DURATION_FORMATS = {"aac"}  # FFmpeg's raw ADTS demuxer: duration guessed from bitrate
_MP3_EXACT_TAGS = (b"Xing", b"Info", b"VBRI")  # first-frame tags FFmpeg reads an exact duration from

PathOrBytes = str | Path | bytes


@dataclass(frozen=True)
class AudioInfo:
    """What the header says. ``frames`` is the exact sample count per channel at ``sample_rate``."""

    frames: int
    sample_rate: int
    channels: int
    codec: str
    container: str

    @property
    def duration_s(self) -> float:
        return self.frames / self.sample_rate

    def num_samples(self, sample_rate: int = SAMPLE_RATE) -> int:
        """Samples after resampling to ``sample_rate``: what ``load_audio`` returns."""
        return round(Fraction(self.frames * sample_rate, self.sample_rate))


def _open(data: PathOrBytes):
    import av

    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data)
    try:
        return av.open(source, mode="r")
    except Exception as e:  # FFmpeg probes the format: any failure to open means "not media"
        raise MediaError("not_audio", f"cannot open as an audio container: {e}") from e


def _raw_head(data: PathOrBytes, n: int) -> bytes:
    if isinstance(data, (bytes, bytearray)):
        return bytes(data[:n])
    with open(data, "rb") as f:
        return f.read(n)


def _mp3_has_frame_count(data: PathOrBytes) -> bool:
    """Whether the first mp3 frame carries a Xing / Info / VBRI tag (looked for right after the
    frame header, past any ID3v2 tag, so that a title reading "Info" is not taken for one)."""
    head = _raw_head(data, 10)
    start = 0
    if head[:3] == b"ID3" and len(head) == 10:  # ID3v2: 10-byte header, syncsafe size, optional footer
        start = 10 + sum((b & 0x7F) << (7 * (3 - i)) for i, b in enumerate(head[6:10])) + (10 if head[5] & 0x10 else 0)
    frame = _raw_head(data, start + 4096)[start:]
    sync = next((i for i in range(len(frame) - 1) if frame[i] == 0xFF and frame[i + 1] & 0xE0 == 0xE0), None)
    # the tags sit after the side info: at most 4 + 32 bytes into the frame
    return sync is not None and any(tag in frame[sync + 4:sync + 4 + 40] for tag in _MP3_EXACT_TAGS)


def _wav_data_bytes(data: PathOrBytes) -> tuple[int, int] | None:
    """(declared, present) bytes of a RIFF/WAVE file's ``data`` chunk, or None when not found."""
    head = _raw_head(data, 1 << 16)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    total = len(data) if isinstance(data, (bytes, bytearray)) else Path(data).stat().st_size
    pos = 12
    while pos + 8 <= len(head):
        chunk, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
        if chunk == b"data":
            return size, total - pos - 8
        pos += 8 + size + (size & 1)
    return None


def _check_wav(data: PathOrBytes) -> None:
    sizes = _wav_data_bytes(data)
    if sizes is None:
        return
    declared, present = sizes
    if present == 0:
        raise MediaError("empty_audio", "the wav file's data chunk is empty (zero length)")
    if declared not in (0, 0xFFFFFFFF) and present < declared:  # 0 / 0xFFFFFFFF: streamed, size unknown
        raise MediaError("audio_truncated", f"the wav data chunk declares {declared} bytes, {present} are present")


def _packet_frames(container, stream) -> int:
    """Sample count from the demuxed packets' durations (reads compressed data, decodes nothing)."""
    end = 0
    for pkt in container.demux(stream):
        if pkt.pts is not None and pkt.duration:
            end = max(end, pkt.pts + pkt.duration)
    start = stream.start_time or 0
    return round((end - start) * stream.time_base * stream.sample_rate) if end else 0


def _header_frames(container, stream, data: PathOrBytes) -> int:
    rate = stream.sample_rate
    estimated = container.format.name in _ESTIMATED_DURATION_FORMATS or (
        container.format.name == "mp3" and not _mp3_has_frame_count(data)
    )
    if estimated:
        return _packet_frames(container, stream)
    if stream.duration is not None and stream.time_base is not None:
        frames = round(stream.duration * stream.time_base * rate)
    elif container.duration is not None:  # microseconds (AV_TIME_BASE)
        frames = round(Fraction(container.duration, 1_000_000) * rate)
    else:
        return _packet_frames(container, stream)
    if stream.codec_context.name == "opus":  # Ogg keeps the pre-skip (48 kHz samples, Opus's rate) in the duration
        frames -= stream.codec_context.delay
    return frames


def probe_audio(data: PathOrBytes) -> AudioInfo:
    """Sample count, rate, channels, codec and container from the header, without decoding audio.

    Opus streams report 48000 Hz (the rate Opus always decodes at), whatever the encoder's input was.
    """
    _check_wav(data)
    container = _open(data)
    try:
        if not container.streams.audio:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise MediaError("no_audio_stream", f"the file has no audio stream (streams: {', '.join(kinds)})")
        stream = container.streams.audio[0]
        if not stream.sample_rate or not stream.channels:
            raise MediaError("bad_audio", "the audio stream header has no sample rate / channel count")
        try:
            frames = _header_frames(container, stream, data)
        except Exception as e:  # a demux error while counting packets: a corrupt file
            raise MediaError("bad_audio", f"cannot read the audio stream: {e}") from e
        info = AudioInfo(
            frames=int(frames),
            sample_rate=int(stream.sample_rate),
            channels=int(stream.channels),
            codec=stream.codec_context.name,
            container=container.format.name,
        )
    finally:
        container.close()
    if info.frames <= 0:
        raise MediaError("empty_audio", "the audio stream holds no samples (zero length)")
    return info


def load_audio(data: PathOrBytes, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """float32 mono samples at ``sample_rate``, exactly ``probe_audio(data).num_samples(sample_rate)``.

    Channels are averaged (before resampling, as LLaMA-Factory / torchaudio do), the result resampled
    with FFmpeg's swresample (``av.AudioResampler``) and the resampler flushed. The length is then
    fixed to the header's count (see the module docstring for how far apart the two may be).
    """
    import av

    info = probe_audio(data)
    want = info.num_samples(sample_rate)
    to_float = av.AudioResampler(format="fltp")  # any sample format -> planar float, same layout/rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    pieces: list[np.ndarray] = []
    container = _open(data)
    try:
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            for mono in _to_mono(to_float.resample(frame)):
                pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(mono)]
        for mono in _to_mono(to_float.resample(None)):
            pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(mono)]
        pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except MediaError:
        raise
    except Exception as e:  # corrupt packets mid-stream
        raise MediaError("bad_audio", f"cannot decode the audio stream: {e}") from e
    finally:
        container.close()
    samples = np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0, np.float32)
    got = f"decoded {len(samples) / sample_rate:.3f} s but the header says {want / sample_rate:.3f} s"
    if len(samples) < want - MAX_SHORT_S * sample_rate:
        raise MediaError("audio_truncated", f"{got} (truncated or corrupt file)")
    if len(samples) > want + MAX_EXTRA_S * sample_rate:
        raise MediaError("audio_length_mismatch", f"{got} (the header's duration is wrong)")
    if len(samples) >= want:
        return samples[:want]
    return np.pad(samples, (0, want - len(samples)))


def _to_mono(frames):
    """Average the channels in float32 (swresample's own downmix would weight them by -3 dB)."""
    import av

    for frame in frames:
        mono = av.AudioFrame.from_ndarray(frame.to_ndarray().mean(axis=0, keepdims=True), format="fltp", layout="mono")
        mono.sample_rate = frame.sample_rate
        yield mono


# ---------------------------------------------------------------------------- token counts


def encoder_tokens(frames: int) -> int:
    """Whisper-style conv (stride 2) then AvgPool(2): ``_get_feat_extract_output_lengths`` of both
    Qwen2-Audio and Qwen2.5-Omni."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def qwen2_audio_chunks(num_samples: int) -> list[int]:
    """Sample counts of the consecutive <= 30 s pieces Qwen2-Audio sees: ceil(n / 30 s) near-equal
    chunks (the first ``n % k`` one sample longer), so no chunk is a tiny tail."""
    k = max(1, -(-num_samples // WINDOW_SAMPLES))
    base, extra = divmod(num_samples, k)
    return [base + (i < extra) for i in range(k)]


def qwen2_audio_tokens(num_samples: int) -> list[int]:
    """Tokens per 30 s chunk (each chunk padded to 3000 frames, as ``Qwen2AudioProcessor`` does)."""
    return [encoder_tokens(mel_frames(n, WINDOW_SAMPLES)) for n in qwen2_audio_chunks(num_samples)]


def qwen2_5_omni_frames(num_samples: int) -> int:
    """Mel frames of one whole clip as ``WhisperFeatureExtractor(padding="max_length",
    truncation=False)`` gives them: padded to 30 s when shorter, left as is when longer."""
    return mel_frames(num_samples, max(num_samples, WINDOW_SAMPLES))


def qwen2_5_omni_tokens(num_samples: int) -> int:
    """Tokens of Qwen2.5-Omni's audio tower for one clip: its 200-frame chunks are pooled over the
    whole clip, so the count is that of the unchunked length."""
    return encoder_tokens(qwen2_5_omni_frames(num_samples))


AUDIO_FAMILIES = ("qwen2_audio", "qwen2_5_omni")


def encoder_items(num_samples: int, family: str) -> list[int]:
    """Sample counts of a clip's audio-encoder items: Qwen2-Audio's <= 30 s chunks, or (Qwen2.5-Omni)
    the whole clip as one item."""
    if family == "qwen2_audio":
        return qwen2_audio_chunks(num_samples)
    if family == "qwen2_5_omni":
        return [num_samples]
    raise ValueError(f"unknown audio family {family!r}; known: {', '.join(map(repr, AUDIO_FAMILIES))}")


def audio_item_tokens(info: AudioInfo, family: str) -> list[int]:
    """Audio placeholder tokens of each encoder item of a clip, from its header; refuses a clip too
    short to give one token (< 3 mel frames, 30 ms) rather than emitting an empty span."""
    if family not in AUDIO_FAMILIES:
        raise ValueError(f"unknown audio family {family!r}; known: {', '.join(map(repr, AUDIO_FAMILIES))}")
    n = info.num_samples(SAMPLE_RATE)
    counts = qwen2_audio_tokens(n) if family == "qwen2_audio" else [qwen2_5_omni_tokens(n)]
    if min(counts) <= 0:
        raise MediaError("audio_too_short", f"{info.duration_s * 1000:.1f} ms gives no encoder token (need >= 30 ms)")
    return counts


def audio_tokens(info: AudioInfo, family: str) -> int:
    """Total audio placeholder tokens of a clip, from its header (the sum over its encoder items)."""
    return sum(audio_item_tokens(info, family))


# ---------------------------------------------------------------------------- recipe settings and plans


@dataclass(frozen=True)
class AudioConfig:
    """Audio processing parameters (a recipe's ``data.audio``): whose token rule (``family``, see
    ``encoder_items``) and how many mel bins the encoder reads (128 for both Qwen audio models).

    ``use_audio_in_video``: every video's own sound track is an audio input too (Qwen2.5-Omni,
    ``rope: mrope_omni``), its tokens interleaved with the video's in ``seconds_per_chunk`` chunks
    (the thinker config's ``seconds_per_chunk``)."""

    family: str = "qwen2_audio"
    n_mels: int = 128
    use_audio_in_video: bool = False
    seconds_per_chunk: int = 2

    def __post_init__(self):
        if self.family not in AUDIO_FAMILIES:
            raise ValueError(f"data.audio.family={self.family!r}; choose one of {AUDIO_FAMILIES}")
        if self.n_mels < 1:
            raise ValueError(f"data.audio.n_mels must be positive, got {self.n_mels}")
        if self.seconds_per_chunk <= 0:
            raise ValueError(f"data.audio.seconds_per_chunk must be positive, got {self.seconds_per_chunk}")
        if self.use_audio_in_video and self.family != "qwen2_5_omni":
            raise ValueError("data.audio.use_audio_in_video needs family: qwen2_5_omni (its interleaved layout)")

    @classmethod
    def from_mapping(cls, cfg: Mapping | None) -> "AudioConfig":
        cfg = {k: v for k, v in (cfg or {}).items() if v is not None}
        known = {f.name for f in fields(cls)}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"unknown audio keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**cfg)

    def spec(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class AudioPlan:
    """One clip as the model will see it, from its header: ``num_samples`` at 16 kHz, split into
    encoder items of ``item_samples`` samples giving ``item_tokens`` placeholder tokens each."""

    num_samples: int
    item_samples: tuple[int, ...]
    item_tokens: tuple[int, ...]

    kind = "audio"


def plan_audio(info: AudioInfo, cfg: AudioConfig) -> AudioPlan:
    n = info.num_samples(SAMPLE_RATE)
    return AudioPlan(n, tuple(encoder_items(n, cfg.family)), tuple(audio_item_tokens(info, cfg.family)))


def audio_items(data: PathOrBytes, cfg: AudioConfig, num_samples: int | None = None) -> list[np.ndarray]:
    """The decoded clip (``load_audio``) cut into its encoder items, as ``plan_audio`` planned them;
    ``num_samples``: the planned length, checked against the decoded one."""
    samples = load_audio(data)
    if num_samples is not None and len(samples) != num_samples:
        raise MediaError("media_changed", f"decoded {len(samples)} samples, planned {num_samples} (the bytes changed since pack)")
    bounds = np.cumsum([0, *encoder_items(len(samples), cfg.family)])
    return [samples[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
