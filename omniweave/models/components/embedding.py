"""Token-embedding scaling (Gemma, ``DecoderConfig.scale_embeddings``).

Gemma multiplies the looked-up embeddings by sqrt(hidden_size), the scale first rounded to float32
and then to the embeddings' dtype (transformers' ``GemmaTextScaledWordEmbedding``: in bf16 the
scale of width 2048 is 45.25, not 45.2548), so bf16 runs match transformers bit for bit. The
stored table stays unscaled, as in HF checkpoints; embeddings handed in as ``inputs_embeds`` are
not scaled (as in transformers).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as float32, then rounded to ``dtype`` (a Python float, exact in ``dtype``)."""
    return torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype).item()


def scale_embeddings(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """``x`` (embeddings [..., D]) times sqrt(hidden_size) rounded to ``x``'s dtype."""
    return x * embed_scale(hidden_size, x.dtype)
