"""Whisper-style audio towers of Qwen2-Audio and Qwen2.5-Omni, run varlen over ALL audio of a micro-batch.

    encoder(audio_features [A, n_mels, W], audio_lengths int64 [A]) -> hidden [N, d]

``audio_features`` holds A encoder items (log-mel frames, ``data/mel.log_mel``), each padded on the
right to W frames; ``audio_lengths`` are their valid frames. The output concatenates the items in
order, ``encoder_tokens(audio_lengths[i])`` rows each (``data/media/audio.py``: conv stride 2, then
AvgPool(2)). Both towers share the stem and the layers:

    conv1 (k3 p1) → GELU → conv2 (k3 s2 p1) → GELU → + positions → pre-LN layers (k_proj without
    bias; fc1 → GELU → fc2) → AvgPool(2) over each item → LayerNorm

``qwen2_audio``   transformers' ``Qwen2AudioEncoder``: an item is one 30 s window (3000 frames;
                  ``embed_positions``: 1500 rows, stored in checkpoints, never trained). The convs see the padded
                  window, because the extractor's padding frames are not zeros and the last valid
                  position reads one of them; transformers then runs all 1500 positions with the
                  padding keys masked, we run the valid positions only (varlen, one segment per
                  item): the valid outputs are the same, the padding is never computed. The convs
                  only read the frames the valid positions need (2·L1 + 1, L1 the positions).
``qwen2_5_omni``  transformers' ``Qwen2_5OmniAudioEncoder``: an item is a whole clip of any length,
                  cut into 2·n_window-frame chunks; each chunk gets its own convs (zero frames past
                  its end, conv1's output masked there), sinusoidal positions restarting at 0, and
                  attention within the chunk only; pooling runs over the whole clip, then
                  ``ln_post`` and ``proj`` to ``output_dim`` (the tower is its own projector).
                  ``audio_bos_eos_token`` is kept as a buffer only because checkpoints hold it.

Parameter names equal transformers' inside the tower (``conv1``, ``layers.N.self_attn.q_proj`` …),
so the HF adapters only change prefixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from omniweave.data.media.audio import encoder_tokens
from omniweave.models.components.attention import attn
from omniweave.models.components.mlp import activation
from omniweave.models.registry import register


@dataclass
class Qwen2AudioEncoderConfig:
    """Qwen2-Audio's tower (defaults: Qwen2-Audio-7B, HF ``Qwen2AudioEncoderConfig``)."""

    num_mel_bins: int = 128
    num_layers: int = 32  # HF: encoder_layers
    hidden_size: int = 1280  # HF: d_model
    num_heads: int = 20  # HF: encoder_attention_heads
    intermediate_size: int = 5120  # HF: encoder_ffn_dim
    max_source_positions: int = 1500  # positions after conv2; the input window is twice this
    activation: str = "gelu"  # HF: activation_function
    attn_backend: str = "auto"  # attention.BACKENDS name; auto = varlen on CUDA, else sdpa


@dataclass
class Qwen25OmniAudioEncoderConfig(Qwen2AudioEncoderConfig):
    """Qwen2.5-Omni's thinker tower (defaults: Qwen2.5-Omni-7B, HF ``Qwen2_5OmniAudioEncoderConfig``)."""

    n_window: int = 100  # chunks of 2·n_window frames
    output_dim: int = 3584  # proj: the text model's hidden size


# ----------------------------------------------------------------------------- index helpers (pure)


def conv_positions(frames: torch.Tensor) -> torch.Tensor:
    """Positions after conv2 (stride 2) of ``frames`` mel frames (HF ``_get_feat_extract_output_lengths``[0])."""
    return (frames - 1) // 2 + 1


def check_audio(audio_features: torch.Tensor, audio_lengths: torch.Tensor, n_mels: int) -> torch.Tensor:
    """audio_lengths as int64 after checking them against ``audio_features [A, n_mels, W]``."""
    if audio_features.dim() != 3 or audio_features.shape[1] != n_mels:
        raise ValueError(f"audio_features must be [items, {n_mels} mel bins, frames], got {tuple(audio_features.shape)}")
    lengths = audio_lengths.to(torch.long).reshape(-1)
    if lengths.shape[0] != audio_features.shape[0]:
        raise ValueError(f"{audio_features.shape[0]} audio items but {lengths.shape[0]} audio_lengths")
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > audio_features.shape[-1]):
        raise ValueError(f"audio_lengths {lengths.tolist()} must lie in [1, {audio_features.shape[-1]}] (the frames given)")
    return lengths


def segments(seqlens: torch.Tensor) -> torch.Tensor:
    """int32 [S+1] cumulative boundaries of segments of ``seqlens`` rows (attention's cu_seqlens)."""
    return F.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)


def pool_pairs(positions: torch.Tensor) -> torch.Tensor:
    """int64: first row of every AvgPool(2) pair when items of ``positions`` rows lie concatenated;
    an item of P rows gives (P - 2) // 2 + 1 pairs (an odd last row is dropped, as AvgPool1d does)."""
    pairs = (positions - 2) // 2 + 1
    starts = torch.repeat_interleave(F.pad(positions.cumsum(0)[:-1], (1, 0)), pairs)
    first_pair = torch.repeat_interleave(F.pad(pairs.cumsum(0)[:-1], (1, 0)), pairs)
    return starts + 2 * (torch.arange(int(pairs.sum()), device=positions.device) - first_pair)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] float32 ``[sin | cos]`` table of Whisper / Qwen2.5-Omni."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    inv = torch.exp(-math.log(max_timescale) / (channels // 2 - 1) * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


# ----------------------------------------------------------------------------- modules


class Table(nn.Module):
    """A non-trainable table stored as the buffer ``weight`` (the name of HF's nn.Embedding weight)."""

    def __init__(self, rows: int, dim: int, persistent: bool = True):
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim), persistent=persistent)


class AudioAttention(nn.Module):
    def __init__(self, cfg: Qwen2AudioEncoderConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} not divisible by num_heads {cfg.num_heads}")
        d = cfg.hidden_size
        self.head_dim = d // cfg.num_heads
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=True)
        self.out_proj = nn.Linear(d, d, bias=True)
        self.backend = cfg.attn_backend

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:  # x [T, d]
        T = x.shape[0]
        # heads counted from the projection's output (-1), so tensor parallelism can give each rank its own heads
        q, k, v = (p(x).view(T, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, causal=False, backend=self.backend, need_lse=False)
        return self.out_proj(out.reshape(T, -1))


class AudioEncoderLayer(nn.Module):
    """Pre-LN Whisper layer; fc1 / fc2 sit in the layer itself, as in transformers."""

    def __init__(self, cfg: Qwen2AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.act = activation(cfg.activation)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperStyleEncoder(nn.Module):
    """The parts both towers share: conv stem, layers, pooling, init. Subclasses say how items
    become attention segments (``forward``) and add their positions and output layers."""

    def __init__(self, cfg: Qwen2AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.num_layers))

    def num_tokens(self, audio_lengths: torch.Tensor) -> torch.Tensor:
        """int64 [A]: output rows per item."""
        return encoder_tokens(audio_lengths.to(torch.long))

    def run_layers(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x

    @staticmethod
    def pool(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """AvgPool(2) within each item of ``positions`` rows (items concatenated in ``x``)."""
        first = pool_pairs(positions.to(x.device))
        return (x[first] + x[first + 1]) / 2

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights (after ``to_empty`` from the meta device): normal(std) linears and convs,
        unit norms, sinusoidal position tables."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d)):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        self.init_tables()


class Qwen2AudioEncoder(WhisperStyleEncoder):
    """transformers' ``Qwen2AudioEncoder`` (30 s windows); see the module doc."""

    hf_model_type = "qwen2_audio"

    def __init__(self, cfg: Qwen2AudioEncoderConfig):
        super().__init__(cfg)
        self.out_dim = cfg.hidden_size
        self.window = 2 * cfg.max_source_positions  # mel frames of one item, padding included
        self.embed_positions = Table(cfg.max_source_positions, cfg.hidden_size)  # saved by HF, never trained
        self.layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.init_tables()

    @torch.no_grad()
    def init_tables(self) -> None:
        self.embed_positions.weight.copy_(sinusoids(*self.embed_positions.weight.shape))

    def forward(self, audio_features: torch.Tensor, audio_lengths: torch.Tensor) -> torch.Tensor:
        """audio_features [A, n_mels, W >= frames read], audio_lengths [A] <= 3000 -> hidden [N, d]."""
        lengths = check_audio(audio_features, audio_lengths, self.cfg.num_mel_bins)
        if int(lengths.max()) > self.window:
            raise ValueError(f"qwen2_audio items hold at most {self.window} frames (30 s); got {lengths.tolist()}")
        positions = conv_positions(lengths).to(audio_features.device)
        # conv2's output p reads conv1's 2p+1, which reads frame 2p+2: the last valid position needs
        # frame 2·P (a padding frame when the length is odd); frames past the window are conv zeros
        read = min(self.window, 2 * int(positions.max()) + 1)
        if audio_features.shape[-1] < read:
            raise ValueError(f"audio_features has {audio_features.shape[-1]} frames; these items read {read} "
                             f"(pass the extractor's padded {self.window}-frame windows)")  # fmt: skip
        x = audio_features[..., :read].to(self.conv1.weight.dtype)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)  # [A, T, d]
        x = x + self.embed_positions.weight[: x.shape[1]].to(x.dtype)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < positions[:, None]
        x = self.run_layers(x[valid], segments(positions))  # only the valid positions, item by item
        return self.layer_norm(self.pool(x, positions))

    def dummy_input(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A tiny valid item (4 frames of a zero window: one output row), for rows without audio
        that must still run the encoder (FSDP collectives)."""
        features = torch.zeros(1, self.cfg.num_mel_bins, self.window, device=device)
        return features, torch.tensor([4], dtype=torch.long, device=device)


class Qwen25OmniAudioEncoder(WhisperStyleEncoder):
    """transformers' ``Qwen2_5OmniAudioEncoder`` (whole clips in 2·n_window-frame chunks); see the module doc."""

    hf_model_type = "qwen2_5_omni_thinker"  # exports as the thinker alone (hf/qwen2_5_omni.py)

    def __init__(self, cfg: Qwen25OmniAudioEncoderConfig):
        super().__init__(cfg)
        if cfg.n_window > cfg.max_source_positions:
            raise ValueError(f"n_window {cfg.n_window} exceeds max_source_positions {cfg.max_source_positions}")
        self.out_dim = cfg.output_dim
        self.chunk = 2 * cfg.n_window
        self.positional_embedding = Table(cfg.max_source_positions, cfg.hidden_size, persistent=False)
        self.audio_bos_eos_token = Table(2, cfg.output_dim)  # in HF checkpoints; unused by the thinker
        self.ln_post = nn.LayerNorm(cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.output_dim)
        self.init_tables()

    @torch.no_grad()
    def init_tables(self) -> None:
        """The computed table (never in checkpoints; loading.load_hf recomputes it): positions."""
        self.positional_embedding.weight.copy_(sinusoids(*self.positional_embedding.weight.shape))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        super().init_weights(std)
        self.audio_bos_eos_token.weight.zero_()  # a checkpoint tensor, not a computed one: zero when fresh

    def chunks(self, audio_features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(frames [C, n_mels, chunk] zero past each chunk's end, chunk_lengths int64 [C]): every
        item's valid frames cut into consecutive chunks, items in order."""
        pieces, sizes = [], []
        for i, n in enumerate(lengths.tolist()):
            k = -(-n // self.chunk)
            item = F.pad(audio_features[i, :, :n], (0, k * self.chunk - n))  # [n_mels, k·chunk]
            pieces.append(item.view(item.shape[0], k, self.chunk).transpose(0, 1))
            sizes += [self.chunk] * (k - 1) + [n - (k - 1) * self.chunk]
        return torch.cat(pieces), torch.tensor(sizes, dtype=torch.long, device=audio_features.device)

    def forward(self, audio_features: torch.Tensor, audio_lengths: torch.Tensor) -> torch.Tensor:
        """audio_features [A, n_mels, W], audio_lengths [A] (any length <= W) -> hidden [N, output_dim]."""
        lengths = check_audio(audio_features, audio_lengths, self.cfg.num_mel_bins)
        frames, chunk_lengths = self.chunks(audio_features.to(self.conv1.weight.dtype), lengths)
        inside = torch.arange(self.chunk, device=frames.device)[None, None, :] < chunk_lengths[:, None, None]
        x = F.gelu(self.conv1(frames)) * inside  # HF zeroes conv1 past the chunk's end
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [C, n_window, d]
        x = x + self.positional_embedding.weight[: x.shape[1]].to(x.dtype)  # restarts in every chunk
        chunk_positions = conv_positions(chunk_lengths)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < chunk_positions[:, None]
        x = self.run_layers(x[valid], segments(chunk_positions))  # attention within each chunk
        x = self.pool(x, conv_positions(lengths).to(x.device))  # over the whole clip
        return self.proj(self.ln_post(x))

    def dummy_input(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A tiny valid item (4 zero frames: one output row), for rows without audio."""
        return torch.zeros(1, self.cfg.num_mel_bins, 4, device=device), torch.tensor([4], dtype=torch.long, device=device)


register("audio_encoder", "qwen2_audio", Qwen2AudioEncoderConfig)(Qwen2AudioEncoder)
register("audio_encoder", "qwen2_5_omni", Qwen25OmniAudioEncoderConfig)(Qwen25OmniAudioEncoder)
