"""Audio: header probe, decoding, Whisper log-mel, token counts (omniweave/data/media/audio.py, mel.py).

The references are transformers' ``WhisperFeatureExtractor`` (features, attention masks) and the
Qwen2-Audio / Qwen2.5-Omni ``_get_feat_extract_output_lengths`` (token counts), run on real files
written by PyAV's encoders at several rates, channel counts and lengths (one longer than 30 s).
"""

from __future__ import annotations

import io
import wave
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
    _get_feat_extract_output_lengths as omni_lengths,
)
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

from omniweave.data.media import audio as A
from omniweave.data.media.vision import MediaError
from omniweave.data.media.mel import log_mel, mel_filters
from tests.audio_factory import FORMATS, OPUS_RATES, available, encode, signal

MEL_TOL = 1e-4  # on the log-mel values, whose range is about [-1.5, 1.5]
RATES = (8000, 16000, 22050, 44100, 48000)
# how far the header's length may be from what was written: lossless, AAC's edit list and Opus's
# pre-skip are exact; FFmpeg's native Vorbis encoder rounds to its block size
WRITE_SLACK = {"ogg": 64, "mp3": 1152}  # mp3: the LAME tag's padding (29 samples off seen), < 1 frame
EXTRA_TAIL = {"m4a": 1024, "ogg": 1024}  # source samples a codec may decode past the header's end


def _cases():
    """(format, rate, channels, seconds): every format at every rate it supports, mono and stereo,
    lengths 0.3 s - 3 s spread over the matrix, plus one 35 s file."""
    out, k = [], 0
    for fmt in FORMATS:
        for rate in RATES:
            if fmt == "opus" and rate not in OPUS_RATES:
                continue
            for channels in (1, 2):
                if fmt == "ogg" and channels == 1:  # FFmpeg's native Vorbis encoder is stereo only
                    continue
                out.append((fmt, rate, channels, (0.3, 1.23, 2.071, 2.9)[k % 4]))
                k += 1
    return out + [("flac", 44100, 2, 35.0)]


@pytest.fixture(scope="module")
def files():
    """[(case, written samples, bytes)] for every case whose encoder this PyAV wheel has."""
    out = []
    for i, (fmt, rate, channels, seconds) in enumerate(_cases()):
        if available(fmt):
            x = signal(seconds, rate, channels, seed=i)
            out.append(((fmt, rate, channels, seconds), x, encode(x, rate, fmt)))
    return out


def _raw_decoded_16k(data: bytes) -> int:
    """Samples PyAV decodes + resamples to 16 kHz, before load_audio fixes the length."""
    resampler, n = av.AudioResampler(format="flt", layout="mono", rate=16000), 0
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(c.streams.audio[0]):
            n += sum(f.samples for f in resampler.resample(frame))
    return n + sum(f.samples for f in resampler.resample(None))


MISSING = [f"{fmt} ({FORMATS[fmt][1]})" for fmt in FORMATS if not available(fmt)]
needs_mp3 = pytest.mark.skipif(not available("mp3"), reason="this PyAV wheel has no libmp3lame encoder")


@pytest.mark.skipif(bool(MISSING), reason=f"this PyAV wheel lacks the encoders of {', '.join(MISSING)}: "
                    "the file tests skip those formats")
def test_every_format_is_encodable_here():
    """Says (as a skip, with the reason) when the file matrix below tests fewer formats than listed."""
    assert all(available(f) for f in FORMATS)


# ---------------------------------------------------------------------------- mel features


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equal_transformers(n_mels):
    ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
                          sampling_rate=16000, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(mel_filters(n_mels).numpy(), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("padding", ["max_length", "longest"])
def test_log_mel_equals_whisper_feature_extractor_batched(n_mels, padding):
    """Several clips of non-round lengths (one a multiple of the hop, one over 30 s, cut to 30 s
    like the extractor's default truncation): features and valid-frame counts."""
    rng = np.random.default_rng(n_mels)
    lengths = (4801, 16000 * 3 + 77, 160 * 371, 16000 * 31 + 5, 12345)
    clips = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in lengths]
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    ref = fe(clips, sampling_rate=16000, padding=padding, return_attention_mask=True, return_tensors="np")
    ours = log_mel([torch.from_numpy(c) for c in clips], n_mels, padding=padding)
    assert ours.features.shape == ref["input_features"].shape
    assert np.abs(ours.features.numpy() - ref["input_features"]).max() <= MEL_TOL
    assert ours.num_frames.tolist() == ref["attention_mask"].sum(-1).tolist()
    assert torch.equal(ours.attention_mask(), torch.from_numpy(ref["attention_mask"]).long())


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_untruncated_equals_the_extractor_per_clip(n_mels):
    """truncation=False (Qwen2.5-Omni's long audio): each clip padded to max(n, 30 s) on its own,
    batched, equals the extractor on that clip alone; frames past a clip's own length are 0."""
    rng = np.random.default_rng(1)
    clips = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (16000 * 33 + 99, 7000, 16000 * 31)]
    ours = log_mel([torch.from_numpy(c) for c in clips], n_mels, truncation=False)
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    for i, c in enumerate(clips):
        ref = fe(c, sampling_rate=16000, truncation=False, return_attention_mask=True, return_tensors="np")
        t = ref["input_features"].shape[-1]
        assert ours.padded_frames[i] == t
        assert np.abs(ours.features[i, :, :t].numpy() - ref["input_features"][0]).max() <= MEL_TOL
        assert (ours.features[i, :, t:] == 0).all()
        assert ours.num_frames[i] == ref["attention_mask"].sum()


def test_log_mel_skips_only_pure_padding_frames():
    """The STFT runs over the clips + n_fft samples only; lengths around that cut (and 30 s exactly)
    still equal the extractor, whose frames over pure padding are log10(1e-10)."""
    rng = np.random.default_rng(3)
    w = A.WINDOW_SAMPLES
    for n in (w - 1000, w - 401, w - 400, w - 399, w - 160, w, 401):
        c = (0.1 * rng.standard_normal(n)).astype(np.float32)
        ref = WhisperFeatureExtractor(feature_size=80)(c, sampling_rate=16000, return_tensors="np")["input_features"]
        ours = log_mel([torch.from_numpy(c)], 80).features.numpy()
        assert np.abs(ours - ref).max() <= MEL_TOL, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_log_mel_on_cuda_equals_cpu():
    rng = np.random.default_rng(2)
    clips = [torch.from_numpy((0.1 * rng.standard_normal(n)).astype(np.float32)) for n in (5000, 70001)]
    cpu = log_mel(clips, 128)
    gpu = log_mel([c.cuda() for c in clips], 128)
    assert gpu.features.is_cuda
    assert (gpu.features.cpu() - cpu.features).abs().max() <= MEL_TOL
    assert torch.equal(gpu.num_frames.cpu(), cpu.num_frames)


# ---------------------------------------------------------------------------- files


def test_probe_reads_rate_channels_and_duration_from_the_header(files):
    for (fmt, rate, channels, _), x, data in files:
        info = A.probe_audio(data)
        assert (info.channels, info.sample_rate) == (channels, 48000 if fmt == "opus" else rate), (fmt, rate)
        written = Fraction(x.shape[1], rate) * info.sample_rate
        assert abs(info.frames - written) <= WRITE_SLACK.get(fmt, 0), (fmt, rate, channels, info, x.shape)


def test_decoded_length_relates_to_the_header_as_documented(files):
    """PyAV's decode + resample ends within 2 samples of the header's end, or (AAC, Vorbis) up to one
    codec frame past it; load_audio returns exactly the header's count."""
    for (fmt, rate, channels, _), _x, data in files:
        info = A.probe_audio(data)
        want = info.num_samples(16000)
        extra = _raw_decoded_16k(data) - want
        tail = EXTRA_TAIL.get(fmt, 0) * 16000 // info.sample_rate
        assert -2 <= extra <= tail + 2, (fmt, rate, channels, extra)
        samples = A.load_audio(data)
        assert samples.dtype == np.float32 and samples.shape == (want,)


def test_load_audio_averages_channels_and_resamples():
    """A stereo 16-bit wav at 16 kHz: the mean of the two channels (to 16-bit precision); at
    44.1 kHz: the same tones resampled (compared away from the edges)."""
    x = signal(1.0, 16000, 2, seed=3)
    got = A.load_audio(encode(x, 16000, "wav"))
    np.testing.assert_allclose(got, x.mean(0), rtol=0, atol=2 / 32768)
    y = 0.3 * np.sin(2 * np.pi * 440 * np.arange(44100) / 44100)[None].astype(np.float32)
    got = A.load_audio(encode(y, 44100, "wav"))
    expect = 0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert np.abs(got[800:-800] - expect[800:-800]).max() < 2e-3


def test_token_counts_from_headers_equal_counts_after_decoding_and_mel(files):
    """For every file: the Qwen2-Audio token count (per <= 30 s chunk, each padded to 30 s as its
    processor does) and the Qwen2.5-Omni one (whole clip, truncation=False) from the header alone
    == transformers' ``_get_feat_extract_output_lengths`` of WhisperFeatureExtractor's attention
    masks on the decoded samples; and our log-mel of those samples equals the extractor's (80 bins on
    the Qwen2-Audio chunks, 128 on the Qwen2.5-Omni clips)."""
    infos = [A.probe_audio(data) for _, _, data in files]
    clips = [A.load_audio(data) for _, _, data in files]
    pieces = [np.split(c, np.cumsum(A.qwen2_audio_chunks(len(c)))[:-1]) for c in clips]
    for c, p in zip(clips, pieces):
        assert all(0 < len(q) <= A.WINDOW_SAMPLES for q in p) and sum(map(len, p)) == len(c)
    chunks = [q for p in pieces for q in p]

    ref = WhisperFeatureExtractor(feature_size=80)(chunks, sampling_rate=16000, return_attention_mask=True,
                                                   return_tensors="pt")
    ours = log_mel([torch.from_numpy(c) for c in chunks], 80)
    assert np.abs(ours.features.numpy() - ref["input_features"].numpy()).max() <= MEL_TOL
    assert torch.equal(ours.num_frames, ref["attention_mask"].sum(-1))
    per_chunk = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, ref["attention_mask"].sum(-1))[1]
    per_file = [t.sum().item() for t in per_chunk.split([len(p) for p in pieces])]
    assert [A.audio_tokens(i, "qwen2_audio") for i in infos] == per_file

    fe = WhisperFeatureExtractor(feature_size=128)  # one clip at a time when longer than 30 s (no batching)
    short = [c for c in clips if len(c) <= A.WINDOW_SAMPLES]
    groups = [short] + [[c] for c in clips if len(c) > A.WINDOW_SAMPLES]
    assert len(groups) == 2  # the 35 s file
    frames = {}
    for group in groups:
        ref = fe(group, sampling_rate=16000, truncation=False, return_attention_mask=True, return_tensors="pt")
        ours = log_mel([torch.from_numpy(c) for c in group], 128, truncation=False)
        assert np.abs(ours.features.numpy() - ref["input_features"].numpy()).max() <= MEL_TOL
        assert torch.equal(ours.num_frames, ref["attention_mask"].sum(-1))
        frames.update({id(c): n for c, n in zip(group, ref["attention_mask"].sum(-1))})
    for info, c in zip(infos, clips):
        assert A.qwen2_5_omni_frames(info.num_samples()) == frames[id(c)].item()
        assert A.audio_tokens(info, "qwen2_5_omni") == omni_lengths(frames[id(c)]).item()


def test_long_audio_is_split_not_truncated():
    """Qwen2-Audio: > 30 s becomes ceil(n / 30 s) near-equal chunks (no tiny tail, nothing dropped),
    where the processor's default (truncation=True) would keep only the first 750 tokens."""
    w = A.WINDOW_SAMPLES
    assert A.qwen2_audio_chunks(w) == [w]
    assert A.qwen2_audio_chunks(w + 1) == [w // 2 + 1, w // 2]
    assert A.qwen2_audio_chunks(2 * w) == [w, w]
    assert A.qwen2_audio_chunks(35 * 16000) == [280000, 280000]
    assert sum(A.qwen2_audio_tokens(35 * 16000)) == 2 * 437 > 750
    assert A.qwen2_audio_tokens(w) == [750]
    # Qwen2.5-Omni pools over the whole clip: 35 s -> 3500 frames -> 875 tokens
    assert A.qwen2_5_omni_tokens(35 * 16000) == 875


@needs_mp3
def test_header_without_exact_duration_counts_packets():
    """Raw ADTS AAC and mp3 without a Xing tag (one with an ID3 title that reads like the tags):
    FFmpeg only estimates the duration from the bitrate; the probe sums the demuxed packets
    instead, which equals the decoded length."""
    x = signal(2.0, 44100, 2, seed=5)
    no_xing = {"write_xing": "0"}
    for data in (encode(x, 44100, "mp3", no_xing), encode(x, 44100, "mp3", no_xing, {"title": "Xing Info VBRI"}),
                 _adts(x, 44100)):
        info = A.probe_audio(data)
        with av.open(io.BytesIO(data)) as c:
            s = c.streams.audio[0]
            estimate = s.duration * s.time_base * s.sample_rate
            decoded = sum(f.samples for f in c.decode(s))
        assert info.frames == decoded != round(estimate)
        assert len(A.load_audio(data)) == info.num_samples()


def _adts(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="adts") as out:
        stream = out.add_stream("aac", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x), format="fltp", layout="stereo")
        frame.sample_rate, frame.pts = rate, 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


# ---------------------------------------------------------------------------- bad input


def _reason(fn, data) -> str:
    with pytest.raises(MediaError) as e:
        fn(data)
    return e.value.reason


@needs_mp3
def test_bad_files_raise_named_errors(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("this is a text file, not audio\n" * 40)
    assert _reason(A.probe_audio, text) == "not_audio"
    assert _reason(A.load_audio, str(text)) == "not_audio"

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
    assert _reason(A.probe_audio, buf.getvalue()) == "empty_audio"

    from tests.data_factory import video_bytes
    assert _reason(A.probe_audio, video_bytes(4)) == "no_audio_stream"

    x = signal(2.0, 22050, 2)
    wav, mp3, m4a = (encode(x, 22050, f) for f in ("wav", "mp3", "m4a"))
    assert _reason(A.probe_audio, wav[: len(wav) * 9 // 10]) == "audio_truncated"
    assert _reason(A.load_audio, mp3[: len(mp3) * 9 // 10]) == "audio_truncated"  # the Xing tag says 2 s
    assert _reason(A.probe_audio, m4a[: len(m4a) // 2]) == "not_audio"  # the moov atom is at the end
    short = A.probe_audio(encode(signal(0.02, 16000, 1), 16000, "wav"))
    assert _reason(lambda info: A.audio_tokens(info, "qwen2_audio"), short) == "audio_too_short"
    with pytest.raises(ValueError, match="unknown audio family"):
        A.audio_tokens(A.probe_audio(wav), "whisper")
