"""Whisper log-mel features in torch, batched, on any device: ``transformers.WhisperFeatureExtractor``.

Per clip (16 kHz mono float32, n samples), as the extractor computes it:

1. truncate to 30 s (``truncation=True``, its default) and zero-pad to P samples
   (``padding="max_length"``: 30 s; ``"longest"``: the longest clip of the batch);
2. ``torch.stft(n_fft=400, hop=160, periodic Hann, center=True, reflect)`` -> P // 160 + 1 frames,
   the last dropped -> P // 160 frames; power spectrum;
3. slaney mel filters (0-8 kHz) -> clamp(1e-10) -> log10 -> max(x, max - 8) per clip -> (x + 4) / 4;
4. valid frames (its ``attention_mask`` sum): min(ceil(n / 160), P // 160).

``padding="max_length"`` with ``truncation=False`` pads each clip to max(n, 30 s) on its own
(``P_i``), which is what the extractor does for one clip (Qwen2.5-Omni's long audio); it cannot
batch clips of different padded lengths, we can: the centre padding is applied per clip, so every
clip's features equal the extractor's on that clip alone. Frames past ``P_i // 160`` are 0.

Speed: frames of pure padding are a constant, so a 5 s clip padded to 30 s costs the STFT of ~5 s,
not 30 s (the extractor transforms all 30 s).

The filter bank is computed here (slaney mel scale and area norm, as ``audio_utils.mel_filter_bank``
with ``norm="slaney", mel_scale="slaney"``); tests compare it against transformers'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SAMPLES = 30 * SAMPLE_RATE


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(hz < min_log_hz, hz / f_sp, min_log_mel + torch.log(hz.clamp(min=min_log_hz) / min_log_hz) / logstep)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(mel < min_log_mel, mel * f_sp, min_log_hz * torch.exp(logstep * (mel - min_log_mel)))


def mel_frames(num_samples: int, padded_samples: int) -> int:
    """Valid frames (the extractor's attention-mask sum) of a clip of ``num_samples`` padded to
    ``padded_samples``: ceil(n / hop), at most padded // hop (the STFT's last frame is dropped)."""
    return min(-(-num_samples // HOP_LENGTH), padded_samples // HOP_LENGTH)


@lru_cache(maxsize=8)
def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE, f_max: float = 8000.0) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] float64 triangular slaney filters with area normalisation."""
    fft_hz = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    mel_edges = torch.linspace(_hz_to_mel(torch.tensor(0.0, dtype=torch.float64)).item(),
                               _hz_to_mel(torch.tensor(f_max, dtype=torch.float64)).item(), n_mels + 2, dtype=torch.float64)
    hz_edges = _mel_to_hz(mel_edges)
    slopes = hz_edges[None, :] - fft_hz[:, None]  # [freq, n_mels + 2]
    widths = hz_edges[1:] - hz_edges[:-1]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    return filters * (2.0 / (hz_edges[2:] - hz_edges[:-2]))[None, :]


@dataclass
class MelBatch:
    features: torch.Tensor  # [B, n_mels, T] float32
    num_frames: torch.Tensor  # [B] int64: valid frames (the extractor's attention-mask sum)
    padded_frames: torch.Tensor  # [B] int64: P_i // 160, the extractor's output length for the clip

    def attention_mask(self) -> torch.Tensor:
        """[B, T] int64, 1 on valid frames (``feature_attention_mask`` for the Qwen audio models)."""
        t = torch.arange(self.features.shape[-1], device=self.num_frames.device)
        return (t[None, :] < self.num_frames[:, None]).long()


def log_mel(
    clips: list[torch.Tensor],
    n_mels: int = 80,
    padding: str = "max_length",
    truncation: bool = True,
) -> MelBatch:
    """Whisper log-mel features of 16 kHz mono clips (1-D float tensors, all on one device)."""
    if padding not in ("max_length", "longest"):
        raise ValueError(f"padding must be 'max_length' or 'longest', got {padding!r}")
    if not clips:
        raise ValueError("log_mel needs at least one clip")
    device = clips[0].device
    clips = [c.to(torch.float32).reshape(-1) for c in clips]
    if truncation:
        clips = [c[:CHUNK_SAMPLES] for c in clips]
    lengths = [len(c) for c in clips]
    if padding == "longest":
        padded = [max(lengths)] * len(clips)
    else:
        padded = [CHUNK_SAMPLES if truncation else max(n, CHUNK_SAMPLES) for n in lengths]
    longest = max(padded)
    # Frames whose window lies wholly in the zero padding have power 0, i.e. log10(1e-10) = -10: the
    # STFT only runs over the first min(P, longest clip + n_fft) samples (zeros past the clips are
    # their own reflection, so those frames are exact) and the rest is that constant.
    span = min(longest, max(lengths) + N_FFT)
    batch = torch.zeros(len(clips), span, device=device)
    for i, c in enumerate(clips):
        batch[i, : len(c)] = c
    window = torch.hann_window(N_FFT, device=device)
    uniform = all(p == longest for p in padded)
    if uniform:  # one padded length: the extractor's own call, centre (reflect) padding in the STFT
        spec = torch.stft(batch, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect", return_complex=True)
    else:  # per clip centre padding at its own end (span == longest here), then zeros to the batch length
        half = N_FFT // 2
        framed = torch.zeros(len(clips), span + N_FFT, device=device)
        for i, p in enumerate(padded):
            framed[i, : p + N_FFT] = torch.nn.functional.pad(batch[i : i + 1, :p], (half, half), mode="reflect")[0]
        spec = torch.stft(framed, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
    frames_out = longest // HOP_LENGTH  # the extractor drops the STFT's last frame
    power = spec.real.square() + spec.imag.square()  # |X|^2 (3x faster than abs() ** 2 on CPU)
    filters = mel_filters(n_mels).to(device=device, dtype=torch.float32)
    log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()[..., :frames_out]
    if log_spec.shape[-1] < frames_out:
        silence = torch.clamp(torch.zeros((), device=device), min=1e-10).log10().item()
        log_spec = torch.nn.functional.pad(log_spec, (0, frames_out - log_spec.shape[-1]), value=silence)
    padded_frames = torch.tensor([p // HOP_LENGTH for p in padded], device=device)
    if uniform:
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0
    else:
        in_clip = torch.arange(frames_out, device=device)[None, None, :] < padded_frames[:, None, None]
        peak = log_spec.masked_fill(~in_clip, -torch.inf).amax(dim=(1, 2), keepdim=True)
        log_spec = ((torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0).masked_fill(~in_clip, 0.0)
    num_frames = torch.tensor([mel_frames(n, p) for n, p in zip(lengths, padded)], device=device)
    return MelBatch(features=log_spec, num_frames=num_frames, padded_frames=padded_frames)
