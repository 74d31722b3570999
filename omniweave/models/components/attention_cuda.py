"""FlashAttention-2 kernels on CUDA: ``varlen`` (PyTorch's own, ``torch.nn.attention.varlen``, no
extra package) and ``flash`` (the separately installed ``flash_attn`` package). Both take packed
rows with ``cu_seqlens`` directly, so a row of many short documents is one kernel launch.

Conventions translated here (the interface is in :mod:`omniweave.models.components.attention`):
- ``causal`` is bottom-right aligned in FlashAttention too; a window ``W`` becomes
  ``window_size = (W - 1, 0)`` causal or ``(W - 1, W - 1)`` bidirectional; no window is ``(-1, 0)``
  (PyTorch's varlen reads exactly that pair as causal) or ``(-1, -1)``.
- the log-sum-exp comes back ``[H, Tq]`` fp32. FlashAttention writes ``+inf`` for a query that sees
  no key; the interface says ``-inf`` (ring attention's merge gives such a side zero weight).
- the lse of ``varlen`` carries no gradient (PyTorch's backward ignores it), so its ``attn`` is for
  outputs; ring attention uses the block kernels below, whose backward takes the global lse.

The ``*_block_*`` functions are ring attention's block kernels (forward with lse; backward from the
global ``out``/``lse``, FlashAttention-2's recomputation scheme; see ``attention_ref``'s math ones).
"""

from __future__ import annotations

import functools
import weakref

import torch


def fa_window(causal: bool, window: int | None) -> tuple[int, int]:
    """FlashAttention's ``(left, right)`` window of the interface's ``causal`` / ``window``."""
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    return (window - 1, 0) if causal else (window - 1, window - 1)


_MAX_LEN: dict[int, tuple[weakref.ref, int, int]] = {}  # id -> (the tensor, its version, longest)


def max_len(cu_seqlens: torch.Tensor) -> int:
    """The longest segment. Reading it from a GPU tensor waits for the GPU; every layer gets the
    same ``cu_seqlens`` tensor, so the answer is kept per tensor object (and in-place version)
    and the host waits once per micro-batch, not once per layer."""
    hit = _MAX_LEN.get(id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    if len(_MAX_LEN) > 256:  # entries of freed tensors: their weak references are dead
        _MAX_LEN.clear()
    _MAX_LEN[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, longest)
    return longest


def _empty_rows_plus_inf(lse: torch.Tensor) -> torch.Tensor:
    """The interface's lse back to FlashAttention's convention (``+inf``: saw nothing) for its backward."""
    return lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()


def _empty_rows_minus_inf(lse: torch.Tensor, heads: int, rows: int) -> torch.Tensor:
    if lse.shape != (heads, rows):  # the interface is [H, Tq]; anything else would merge wrongly
        raise RuntimeError(f"FlashAttention returned a log-sum-exp of shape {tuple(lse.shape)}, expected "
                           f"[{heads}, {rows}]; this torch / flash_attn version is not supported")
    return lse.masked_fill(lse == float("inf"), float("-inf"))


# ---------------------------------------------------------------------------- varlen (torch)


@functools.lru_cache(maxsize=None)
def varlen_missing() -> str | None:
    """Why PyTorch's varlen FlashAttention cannot run on this machine, or None when it can."""
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no FlashAttention kernels"
    return None


def fa2_refuses(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why FlashAttention-2 cannot serve this call (device, dtype, head dim, GPU), or None."""
    if q.device.type != "cuda":
        return f"tensors on {q.device.type}, not cuda"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
        return f"dtype {q.dtype} (needs float16 or bfloat16)"
    d = q.shape[-1]
    if d > 256 or d % 8:
        return f"head dim {d} (needs a multiple of 8, at most 256)"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return f"GPU compute capability {torch.cuda.get_device_capability(q.device)} (needs 8.0+)"
    return None


def _varlen(q, k, v, cu_q, cu_k, mq, mk, window_size, scale, seqused_k=None):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    out, lse = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), mq, mk,
                           return_aux=AuxRequest(lse=True), scale=scale, window_size=window_size,
                           enable_gqa=q.shape[1] != k.shape[1],
                           seqused_k=None if seqused_k is None else seqused_k.to(torch.int32))  # fmt: skip
    return out, _empty_rows_minus_inf(lse, q.shape[1], q.shape[0])


def varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, **_):
    """PyTorch's varlen FlashAttention (differentiable in ``out``; see the module docstring for lse)."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_len(cu_seqlens_q), max_len(cu_seqlens_k),
                   fa_window(causal, window), scale)


def varlen_decode(q, k_cache, v_cache, slots, lengths, scale=None):
    """Inference (see ``attention_ref.math_decode``): the cache slots stay where they are; each query
    reads its slot through ``cu_seqlens_k`` (slot offsets) and ``seqused_k`` (its length), no copy."""
    n_slots, slot = k_cache.shape[:2]
    starts = slots.to(torch.int32) * slot
    cu_k = torch.cat([starts, starts[-1:] + slot])  # only the starts are read when seqused_k is given
    cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    k, v = (c.view(n_slots * slot, *c.shape[2:]) for c in (k_cache, v_cache))
    return _varlen(q, k, v, cu_q, cu_k, 1, slot, (-1, -1), scale, seqused_k=lengths)


def varlen_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(out [Tq, H, D] in q's dtype, lse fp32 [H, Tq])`` of one ring block."""
    return _varlen(q, k, v, cu_q, cu_k, max_q, max_k, fa_window(causal, None), scale)


def varlen_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(dq, dk, dv)`` of one ring block from the global ``out``/``lse`` (GQA summed by the kernel)."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
    return torch.ops.torch_attn._varlen_attn_backward(
        dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), _empty_rows_plus_inf(lse), cu_q.to(torch.int32),
        cu_k.to(torch.int32), max_q, max_k, causal, rng_state, scale, list(fa_window(causal, None)),
    )  # fmt: skip


# ---------------------------------------------------------------------------- flash (package)


@functools.lru_cache(maxsize=None)
def flash_missing() -> str | None:
    """Why the flash_attn package cannot run here, or None when it can."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "the flash_attn package is not installed (pip install flash-attn)"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return None


def flash_available() -> bool:
    return flash_missing() is None


def flash_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, **_):
    """FlashAttention-2 varlen kernel of the flash_attn package (differentiable in ``out``)."""
    from flash_attn import flash_attn_varlen_func

    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), max_len(cu_seqlens_q),
        max_len(cu_seqlens_k), softmax_scale=scale, causal=causal, window_size=fa_window(causal, window),
        return_attn_probs=True,
    )  # fmt: skip
    return out, _empty_rows_minus_inf(lse, q.shape[1], q.shape[0])


def flash_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    out, lse, _, _ = _flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal
    )
    return out, _empty_rows_minus_inf(lse, q.shape[1], q.shape[0])


def flash_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    _flash_attn_varlen_backward(
        dout, q, k, v, out.to(q.dtype), _empty_rows_plus_inf(lse), dq, dk, dv, cu_q, cu_k, max_q, max_k,
        0.0, scale, causal, -1, -1, 0.0, None, False,  # dropout, scale, causal, window, softcap, alibi, deterministic
    )  # fmt: skip
    return dq, dk, dv
