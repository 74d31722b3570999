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

Two implementations with one signature: ``math_block_*`` (fp32, pure PyTorch, one document at a
time; any device — the CPU/test path) and ``flash_block_*`` (FlashAttention-2 >= 2.6 varlen
forward/backward, CUDA, fp16/bf16, head dim a multiple of 8).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from omniweave.models.components.attention import doc_bounds, flash_available, masked_scores, math_attn_fp32


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().repeat_interleave(group, dim=1) if group > 1 else x.float()


def math_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Partial ``(out fp32 [Tq, H, D], lse fp32 [H, Tq])`` of queries over this block's keys only
    (the segments of ``cu_q`` cover every query row); the reference kernel without its cast."""
    return math_attn_fp32(q, k, v, cu_q, cu_k, causal, None, scale)


def math_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(dq [Tq, H, D], dk, dv [Tk, Hkv, D])`` in fp32 of this block, from the global ``out``/``lse``."""
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for q0, q1, k0, k1 in doc_bounds(cu_q, cu_k):
        s = masked_scores(q[q0:q1], k[k0:k1], causal, None, scale)
        p = torch.exp(s - lse[:, q0:q1, None])  # [H, lq, lk]; exp(-inf) = 0 where masked
        d_out = dout[q0:q1].float()
        delta = (d_out * out[q0:q1].float()).sum(-1).T  # [H, lq]
        dp = torch.einsum("qhd,khd->hqk", d_out, _repeat_heads(v[k0:k1], group))
        ds = p * (dp - delta[..., None])
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, _repeat_heads(k[k0:k1], group)) * scale
        lk = k1 - k0
        dk[k0:k1] = (torch.einsum("hqk,qhd->khd", ds, q[q0:q1].float()) * scale).view(lk, hkv, group, -1).sum(2)
        dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, d_out).view(lk, hkv, group, -1).sum(2)
    return dq, dk, dv


def flash_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """FlashAttention-2 varlen forward: ``(out [Tq, H, D] in q's dtype, lse fp32 [H, Tq])``."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    out, lse, _, _ = _flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal
    )
    return out, lse


def flash_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """FlashAttention-2 varlen backward from the global ``out``/``lse`` (GQA summed by the kernel)."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    _flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
        0.0, scale, causal, -1, -1, 0.0, None, False,  # dropout, scale, causal, window, softcap, alibi, deterministic
    )  # fmt: skip
    return dq, dk, dv


class BlockKernel(NamedTuple):
    forward: Callable
    backward: Callable


MATH = BlockKernel(math_block_forward, math_block_backward)
FLASH = BlockKernel(flash_block_forward, flash_block_backward)


def select_block_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """``auto``: FlashAttention for fp16/bf16 on CUDA when importable, else math; ``math`` / ``flash``
    explicitly."""
    if backend == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        return FLASH if device.type == "cuda" and half and flash_available() else MATH
    if backend == "math":
        return MATH
    if backend == "flash":
        if not flash_available():
            raise RuntimeError("attention backend 'flash' needs the flash_attn package and a CUDA device")
        return FLASH
    raise ValueError(f"ring attention needs a block kernel that returns lse and recomputes from it: "
                     f"backend 'auto', 'math' or 'flash', not {backend!r}")


def merge_partials(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two disjoint key sets from each set's ``(out [T, H, D], lse [H, T])``;
    fp32. A side with ``lse = -inf`` (no visible key) contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = lse.masked_fill(lse == float("-inf"), 0.0)  # rows nobody saw: weights exp(-inf) = 0, not NaN
    weight_a = torch.exp(lse_a - ref).T[..., None]
    weight_b = torch.exp(lse_b - ref).T[..., None]
    return out_a.float() * weight_a + out_b.float() * weight_b, lse
