"""Block kernels for ring attention: one varlen call's partial result, its merge, and its backward
from the *global* softmax statistics (FlashAttention-2's recomputation scheme).

Shapes: ``q [Tq, H, D]``, ``k, v [Tk, Hkv, D]`` (GQA: key/value head ``j`` serves query heads
``[j·g, (j+1)·g)``, ``g = H/Hkv``), ``cu_q / cu_k`` int32 segment boundaries, ``causal`` bottom-right
aligned (query ``i`` of a segment sees key ``j`` iff ``j <= i + Lk - Lq``)::

    forward   s = q·kᵀ·scale (masked)    lse = logsumexp(s)      out = exp(s - lse)·v
    merge     lse = logaddexp(lse_a, lse_b)    out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)
    backward  p = exp(s - lse_global)    dv = pᵀ·dout    dp = dout·vᵀ    Δ = rowsum(dout ∘ out_global)
              ds = p ∘ (dp - Δ)    dq = ds·k·scale    dk = dsᵀ·q·scale     (dk, dv summed over a group)

With the global ``lse`` and ``out`` every block's gradient is exact on its own, so the backward of
a ring needs only ``q, k, v, out, lse`` (linear memory) and one block at a time.

The block kernels themselves belong to the attention backends (``Backend.block``:
``math`` in ``attention_ref``, ``varlen`` / ``flash`` in ``attention_cuda``); ring attention gets
one from ``components.attention.resolve(name, q, k, block=True)``. This module keeps the merge.
"""

from __future__ import annotations

import torch

from omniweave.models.components.attention import BlockKernel  # noqa: F401  (the block kernels' type)


def merge_partials(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two disjoint key sets from each set's ``(out [T, H, D], lse [H, T])``;
    fp32. A side with ``lse = -inf`` (no visible key) contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = lse.masked_fill(lse == float("-inf"), 0.0)  # rows nobody saw: weights exp(-inf) = 0, not NaN
    weight_a = torch.exp(lse_a - ref).T[..., None]
    weight_b = torch.exp(lse_b - ref).T[..., None]
    return out_a.float() * weight_a + out_b.float() * weight_b, lse
