"""Varlen attention kernels over packed rows.

Every backend has the same interface::

    attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None) -> (out, lse)

- ``q [Tq, H, D]``, ``k, v [Tk, Hkv, D]`` packed documents (``H % Hkv == 0``: grouped-query
  attention), ``cu_seqlens_q [N+1]`` / ``cu_seqlens_k [N+1]`` int32 document boundaries.
- ``out [Tq, H, D]`` in q's dtype, ``lse [H, Tq]`` float32 log-sum-exp of each query's scaled scores
  (what ring attention needs to merge partial results). ``-inf`` where a query sees no key.
- ``causal``: query ``i`` of a document sees key ``j`` iff ``j <= i + (Lk - Lq)`` (bottom-right
  aligned, the FlashAttention convention: with a KV cache the new queries are the last ones).
- ``window=W``: additionally only the ``W`` nearest keys (``i' - j < W``; both sides when
  bidirectional), like FlashAttention's ``window_size=(W-1, 0 or W-1)``.

Backends: ``math`` (pure PyTorch, per-document loop: O(Σ len²) memory, never an L×L mask; the
reference for tests), ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention`` per document;
its lse is computed by a separate chunked pass, skipped with ``need_lse=False``), ``flash``
(``flash_attn_varlen_func`` when the package is importable and tensors are on CUDA).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class AttnFn(Protocol):
    def __call__(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, window: int | None = None, **kw
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def doc_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} documents but cu_seqlens_k has {len(ck) - 1}")
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def visible_mask(lq: int, lk: int, causal: bool, window: int | None, device=None) -> torch.Tensor | None:
    """bool [lq, lk], True where query i may see key j; None when everything is visible."""
    if not causal and window is None:
        return None
    qi = torch.arange(lq, device=device)[:, None] + (lk - lq)  # query position on the key axis
    kj = torch.arange(lk, device=device)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        mask &= kj <= qi
    if window is not None:
        mask &= (qi - kj) < window
        if not causal:
            mask &= (kj - qi) < window
    return mask


def scaled_dot(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """fp32 scores [H, Lq, Lk] of q [Lq, H, D] against k [Lk, Hkv, D] (GQA: k heads repeated)."""
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = k.repeat_interleave(h // hkv, dim=1) if h != hkv else k
    return torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale


def masked_scores(q, k, causal: bool, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """fp32 scores [H, Lq, Lk] of one document, ``-inf`` where a query may not see a key."""
    s = scaled_dot(q, k, scale)
    mask = visible_mask(q.shape[0], k.shape[0], causal, window, q.device)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def math_attn_fp32(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None):
    """:func:`math_attn` with the output left in fp32 (ring attention merges partial outputs)."""
    h, hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        s = masked_scores(q[q0:q1], k[k0:k1], causal, window, scale)  # [H, lq, lk]
        lse = torch.logsumexp(s, dim=-1)  # [H, lq]
        p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])  # 0 where masked
        vd = v[k0:k1].float()
        vd = vd.repeat_interleave(h // hkv, dim=1) if h != hkv else vd
        outs.append(torch.einsum("hqk,khd->qhd", p, vd))
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=torch.float32)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros((h, 0), dtype=torch.float32)
    return out, lse


def math_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, **_):
    """Reference kernel in fp32, one document at a time."""
    out, lse = math_attn_fp32(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale)
    return out.to(q.dtype), lse


def chunked_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, chunk=1024):
    """lse [H, Tq] alone, query chunk by query chunk (bounded memory); differentiable."""
    lses = []
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        lq, lk = q1 - q0, k1 - k0
        full = visible_mask(lq, lk, causal, window, q.device)
        for c0 in range(0, lq, chunk):
            c1 = min(lq, c0 + chunk)
            s = scaled_dot(q[q0 + c0 : q0 + c1], k[k0:k1], scale)
            if full is not None:
                s = s.masked_fill(~full[c0:c1], float("-inf"))
            lses.append(torch.logsumexp(s, dim=-1))
    return torch.cat(lses, dim=1) if lses else q.new_zeros((q.shape[1], 0), dtype=torch.float32)


def sdpa_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, need_lse=True, **_):
    """``F.scaled_dot_product_attention`` per document; lse from :func:`chunked_lse` if asked."""
    h, hkv = q.shape[1], k.shape[1]
    outs = []
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        lq, lk = q1 - q0, k1 - k0
        # [1, H, L, D]: 4-D inputs let SDPA pick its fused kernels (also on CPU)
        qd, kd, vd = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        if h != hkv:  # enable_gqa is not supported by every SDPA kernel; repeat explicitly
            kd, vd = kd.repeat_interleave(h // hkv, dim=1), vd.repeat_interleave(h // hkv, dim=1)
        if window is None and (not causal or lq == lk):
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)
        else:
            mask = visible_mask(lq, lk, causal, window, q.device)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            o = o.masked_fill(~mask.any(-1)[:, None], 0.0)  # rows that see nothing: 0, not NaN
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs) if outs else torch.zeros_like(q)
    lse = chunked_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, window, scale) if need_lse else None
    return out, lse


@functools.lru_cache(maxsize=None)
def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def flash_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, **_):
    """FlashAttention-2 varlen kernel; returns its own lse [H, Tq] (fp32)."""
    from flash_attn import flash_attn_varlen_func

    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item() if cu_seqlens_q.numel() > 1 else 0
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item() if cu_seqlens_k.numel() > 1 else 0
    window_size = (-1, -1) if window is None else (window - 1, 0 if causal else window - 1)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), lens_q, lens_k,
        softmax_scale=scale, causal=causal, window_size=window_size, return_attn_probs=True,
    )  # fmt: skip
    return out, lse


BACKENDS: dict[str, Callable] = {"math": math_attn, "sdpa": sdpa_attn, "flash": flash_attn}


def select_backend(name: str = "auto", device: torch.device | str | None = None) -> str:
    """Resolve ``auto``: flash on CUDA when importable, else sdpa. Explicit names are checked."""
    if name == "auto":
        on_cuda = device is None or torch.device(device).type == "cuda"
        return "flash" if on_cuda and flash_available() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    if name == "flash" and not flash_available():
        raise RuntimeError("attention backend 'flash' needs the flash_attn package and a CUDA device")
    return name


def attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, backend: str = "auto", **kw):
    """Dispatch to a backend by name (``auto`` resolved against q's device)."""
    return BACKENDS[select_backend(backend, q.device)](q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, **kw)
