"""Rotary position embeddings: 1-D RoPE (with Llama-3 or YaRN scaling), Qwen2-VL M-RoPE, vision 2-D RoPE.

All functions return ``cos, sin`` of shape ``[L, head_dim]`` in float32 (the "rotate half" layout
of Hugging Face models: the two halves of the head repeat the same frequencies) and
:func:`apply_rope` rotates ``x [L, H, head_dim]`` in float32, returning x's dtype.

Frequencies are recomputed from the config on each call (``head_dim/2`` numbers): no buffers,
so a model initialised on the meta device needs nothing re-materialised after loading.
"""

from __future__ import annotations

import math

import torch


def rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1·mscale·ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies; ``scaling`` of rope_type llama3 or yarn supported."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, device)
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, llama3, yarn)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, s: dict, device=None) -> torch.Tensor:
    """YaRN (transformers' ``_compute_yarn_parameters``): frequencies rotating fewer than
    ``beta_slow`` times over ``original_max_position_embeddings`` are divided by ``factor``, those
    rotating more than ``beta_fast`` times are kept, a linear ramp in between."""
    if s.get("factor") is None:
        raise ValueError("yarn rope scaling needs 'factor' (post-yarn / original context length)")
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's ``attention_factor`` (given, or
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, or ``mscale(factor)``); else 1."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: list[int] | None = None,
    scaling: dict | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, head_dim] for ``position_ids`` [L], [1, L] or [3, L] (M-RoPE).

    M-RoPE (Qwen2-VL): frequency band ``f`` of ``head_dim/2`` takes its angle from axis
    ``i % 3`` (t, h, w) where ``i`` is the index of the ``mrope_section`` chunk holding ``f``.
    Interleaved M-RoPE (Qwen3-VL, ``mrope_interleaved``): bands start as t; h takes bands
    1, 4, 7, … below ``3·section[1]`` and w bands 2, 5, 8, … below ``3·section[2]`` (transformers'
    ``recomposition_frequencies``), so every axis spans low and high frequencies.
    Without ``mrope_section`` only the first row of position_ids is used.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, position_ids.device)
    pos = position_ids.reshape(-1, position_ids.shape[-1]).float()  # [A, L]
    if mrope_section is None:
        freqs = pos[0][:, None] * inv_freq  # [L, hd/2]
    else:
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim/2 = {head_dim // 2}")
        pos = pos.expand(3, -1) if pos.shape[0] == 1 else pos
        all_freqs = pos[:, :, None] * inv_freq  # [3, L, hd/2]
        if mrope_interleaved:
            freqs = all_freqs[0].clone()
            for axis in (1, 2):
                band = slice(axis, 3 * mrope_section[axis], 3)
                freqs[:, band] = all_freqs[axis][:, band]
        else:
            chunks = all_freqs.split(list(mrope_section), dim=-1)
            freqs = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [L, H, head_dim] by cos/sin [L, rope_dim] (computed in float32); with rope_dim <
    head_dim (partial rotary: Qwen3.5, Qwen3-Next) the first rope_dim dims, the rest passed through."""
    xf = x.float()
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    d = cos.shape[-1]
    if d < x.shape[-1]:
        rot = xf[..., :d]
        return torch.cat([rot * cos + rotate_half(rot) * sin, xf[..., d:]], -1).to(x.dtype)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def vision_position_ids(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """int64 [N, 2] (h, w) of every patch, in the patch order of the Qwen2-VL processor:
    merge×merge blocks row-major, patches inside a block row-major, repeated for each frame."""
    out = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h, device=grid_thw.device)[:, None].expand(h, w)
        wpos = torch.arange(w, device=grid_thw.device)[None, :].expand(h, w)
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        hpos = hpos.reshape(block).transpose(1, 2).flatten()
        wpos = wpos.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    if not out:
        return torch.zeros(0, 2, dtype=torch.long, device=grid_thw.device)
    return torch.cat(out)


class VisionRotaryEmbedding(torch.nn.Module):
    """2-D RoPE of the Qwen2-VL / Qwen2.5-VL ViT, equal to transformers' ``rot_pos_emb``.

    ``dim`` is half the ViT head dim (as in ``VisionRotaryEmbedding(head_dim // 2)`` of
    transformers 4.x): ``dim/2`` frequencies for h, ``dim/2`` for w, the pair repeated twice.
    """

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        self.dim, self.theta = dim, theta

    def inv_freq(self, device=None) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float, device=device) / self.dim))

    def freqs(self, grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
        """float32 [N, dim]: angles (h freqs then w freqs) of every patch."""
        pos = vision_position_ids(grid_thw, merge_size).float()  # [N, 2]
        return (pos[:, :, None] * self.inv_freq(grid_thw.device)).flatten(1)  # [N, 2 * dim/2]

    def forward(self, grid_thw: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 2*dim] (= head_dim) for :func:`apply_rope`."""
        f = self.freqs(grid_thw, merge_size)
        emb = torch.cat([f, f], dim=-1)
        return emb.cos(), emb.sin()
