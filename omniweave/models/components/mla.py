"""Multi-head latent attention (MLA) of DeepSeek-V2 / V3, equal to transformers'
``DeepseekV3Attention``, on one packed row (``[L, D]``, documents delimited by ``cu_seqlens``)::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))         (q_lora_rank set; else q_proj(x))
             [L, H, qk_nope + qk_rope] -> q_nope | q_pe
    latent = kv_a_proj_with_mqa(x) -> kv [L, kv_lora_rank] | k_pe [L, qk_rope]  (one head, shared)
    kv     = kv_b_proj(kv_a_layernorm(kv)) [L, H, qk_nope + v] -> k_nope | v
    q = q_nope | rope(q_pe),  k = k_nope | rope(k_pe) (broadcast to every head)

RoPE rotates the ``qk_rope_head_dim`` dims only. With ``rope_interleave`` (DeepSeek's released
weights; transformers' default) those dims hold interleaved pairs ``(x0, x1), (x2, x3), …``: they
are de-interleaved (evens then odds) and rotated the usual rotate-half way, which is exactly
transformers' ``apply_rotary_pos_emb_interleave``. The cos / sin come from the decoder over the
rope dims (``DecoderConfig.rope_dim``), with YaRN when ``rope_scaling`` says so; M-RoPE positions
``[3, L]`` use ``mrope_section`` over the rope dims if set, else row 0 (the text positions).

Softmax scale ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)²`` for a scaled rope
with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``).

The attention itself goes through the same three doors as ``decoder.Attention`` (KV cache,
the ``attn_fn`` hook of context parallelism, ``attention.attn``), which all take q, k, v of one
head dim and use the kernels' default scale ``1/sqrt(head dim)``. So:

- v is zero-padded to the qk head dim (192 vs 128 in DeepSeek-V3) and the output sliced back:
  FlashAttention (``varlen``, ``flash``) and the ring attention block kernels need one head dim
  for q, k and v, and a KV cache / CP kernel must not care. Zero value columns give zero output
  columns; the cost is the padded part of ``P·V`` (SDPA and ``math`` could do without it);
- the softmax scale is folded into q (``q · scale · sqrt(head dim)``), so every kernel's default
  scale gives exactly the MLA scale and the hook keeps its ``(q, k, v, cu_seqlens, window)``
  signature.

KV caches hold the expanded k and (padded) v per head, not the compressed latent: generation
works with every cache, without MLA's memory saving (a latent cache with absorbed ``kv_b_proj``
would be a cache of its own).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omniweave.models.components.attention import attn
from omniweave.models.components.norm import RMSNorm
from omniweave.models.components.rope import apply_rope, rope_kind, yarn_mscale

# transformers builds q_a_layernorm / kv_a_layernorm as DeepseekV3RMSNorm(rank): its default eps,
# not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def check_mla_config(cfg) -> None:
    """ValueError naming the field when a DecoderConfig's MLA dims do not fit together."""
    if cfg.kv_lora_rank <= 0 or cfg.qk_rope_head_dim <= 0 or cfg.v_head_dim <= 0 or cfg.qk_nope_head_dim < 0:
        raise ValueError(f"family deepseek_v3 (MLA) needs kv_lora_rank, qk_rope_head_dim, v_head_dim > 0 and "
                         f"qk_nope_head_dim >= 0; got kv_lora_rank={cfg.kv_lora_rank}, qk_rope_head_dim="
                         f"{cfg.qk_rope_head_dim}, v_head_dim={cfg.v_head_dim}, qk_nope_head_dim={cfg.qk_nope_head_dim}")  # fmt: skip
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
        raise ValueError(f"q_lora_rank={cfg.q_lora_rank}: a positive rank, or null for a plain q_proj")
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.head_dim != qk:
        raise ValueError(f"head_dim={cfg.head_dim}: with MLA the head dim of q and k is qk_nope_head_dim + "
                         f"qk_rope_head_dim = {cfg.qk_nope_head_dim} + {cfg.qk_rope_head_dim} = {qk} "
                         "(leave head_dim unset)")  # fmt: skip
    if cfg.num_kv_heads != cfg.num_heads:
        raise ValueError(f"num_kv_heads={cfg.num_kv_heads}: MLA expands keys and values for every head; "
                         f"set num_kv_heads = num_heads = {cfg.num_heads}")  # fmt: skip


def mla_softmax_scale(cfg) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if rope_kind(s) != "default" and s.get("mscale_all_dim"):
        m = yarn_mscale(s["factor"], s["mscale_all_dim"])
        scale *= m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rope pairs ``(x0, x1), (x2, x3), …`` -> ``x0, x2, … | x1, x3, …``."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


class MLAttention(nn.Module):
    """Multi-head latent attention over a packed row; parameter names are transformers' (see the
    module docstring). Same ``forward`` and ``attn_fn`` hook as ``decoder.Attention``; biases on
    ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` with ``qkv_bias`` (HF ``attention_bias``)."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_fn = None
        D, H, bias = cfg.hidden_size, cfg.num_heads, cfg.qkv_bias
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=bias)
        self.head_dim = max(qk, self.v_dim)  # of q, k, v as the kernels see them (padded)
        self.q_scale = mla_softmax_scale(cfg) * math.sqrt(self.head_dim)  # see the module docstring

    def qkv(self, x, cos, sin):
        """q, k, v [L, H, head_dim] (zero-padded, scale folded into q) for the attention kernels."""
        L = x.shape[0]
        qk = self.nope + self.rope
        q = self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(L, -1, qk).split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(kv)).view(L, -1, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)  # fmt: skip
        k_pe = k_pe[:, None, :]  # [L, 1, rope]: one rope key shared by every head
        if self.cfg.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return _pad_to(q, self.head_dim), _pad_to(k, self.head_dim), _pad_to(v, self.head_dim)

    def forward(self, x, cos, sin, cu_seqlens, kv_cache=None):
        L = x.shape[0]
        q, k, v = self.qkv(x, cos, sin)
        backend, window = self.cfg.attn_backend, self.cfg.sliding_window
        if kv_cache is not None:  # generation: the cache attends over what it holds (decoder.KVCache)
            out = kv_cache.attend(self.layer, q, k, v, cu_seqlens, window, backend, self.attn_fn)
        elif self.attn_fn is not None:
            out = self.attn_fn(q, k, v, cu_seqlens, window)
        else:
            out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, True, window, backend=backend, need_lse=False)
        return self.o_proj(out[..., : self.v_dim].reshape(L, -1))


__all__ = ["MLAttention", "check_mla_config", "mla_softmax_scale"]
