"""Varlen attention over packed rows: one interface, several backends, one place that chooses.

Every backend has the same interface::

    attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None) -> (out, lse)

- ``q [Tq, H, D]``, ``k, v [Tk, Hkv, D]`` packed documents (``H % Hkv == 0``: grouped-query
  attention), ``cu_seqlens_q [N+1]`` / ``cu_seqlens_k [N+1]`` int32 document boundaries.
- ``out [Tq, H, D]`` in q's dtype, ``lse [H, Tq]`` float32 log-sum-exp of each query's scaled scores
  (what ring attention needs to merge partial results). ``-inf`` where a query sees no key.
- ``causal``: query ``i`` of a document sees key ``j`` iff ``j <= i + (Lk - Lq)`` (bottom-right
  aligned, the FlashAttention convention: with a KV cache the new queries are the last ones).
- ``window=W``: additionally only the ``W`` nearest keys (``i' - j < W``; both sides when
  bidirectional), like FlashAttention's ``window_size=(W-1, 0 or W-1)``.

Backends (``BACKENDS``):

- ``varlen``: PyTorch's own FlashAttention-2 (``torch.nn.attention.varlen``); CUDA, fp16/bf16,
  head dim a multiple of 8 up to 256, compute capability 8.0+. The default on CUDA.
- ``flash``: the ``flash_attn`` package, where it is installed. Optional; chosen only by name.
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` per document (any device, any
  dtype); its lse comes from a separate chunked pass, skipped with ``need_lse=False``. The default
  on CPU and the fallback everywhere.
- ``math``: pure PyTorch in fp32, per document, never an L×L mask. The reference for tests and for
  ``omniweave check``.

Choosing (:func:`resolve`): a name the machine lacks (``varlen`` without CUDA, ``flash`` without the
package) is a :class:`UnavailableBackend` error listing what this machine has
(:func:`check_backend`, raised when the model is built). At call time, a backend that cannot serve
a particular call (dtype, head dim, device, GPU) falls back along ``varlen -> sdpa``,
``flash -> sdpa`` with one warning saying why (``omniweave.attention`` logger). Ring attention asks
for a *block* kernel (forward with lse, backward from a given lse): ``varlen``, ``flash`` or ``math``;
``sdpa`` has none, so a ring over ``sdpa`` runs ``math`` blocks (logged once).
KV-cache decoding (one new query per sequence over its cache slot) is :func:`decode`: ``varlen``
reads the slots in place with ``seqused_k``, the others gather and mask.
Every call site (decoder, ViT, KV caches, the CP modes) goes through :func:`attn` / :func:`decode` /
:func:`resolve`; none picks a kernel by itself.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from omniweave.models.components import attention_cuda as cuda
from omniweave.models.components.attention_ref import (  # noqa: F401  (re-exported: the kernels' helpers)
    chunked_lse, doc_bounds, masked_scores, math_attn, math_attn_fp32, math_block_backward, math_block_forward,
    math_decode, scaled_dot, sdpa_attn, visible_mask,
)
from omniweave.models.components.attention_cuda import flash_available  # noqa: F401
from omniweave.errors import UserError

log = logging.getLogger("omniweave.attention")


class BlockKernel(NamedTuple):
    """Ring attention's pair: ``forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse)``
    and ``backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)``
    from the *global* out / lse."""

    forward: Callable
    backward: Callable


@dataclass(frozen=True)
class Backend:
    name: str
    attn: Callable  # the interface above
    missing: Callable[[], str | None]  # why this machine cannot run it at all; None when it can
    refuses: Callable[..., str | None]  # (q, k) -> why it cannot serve this call; None when it can
    fallback: str | None  # where a refused call goes
    block: BlockKernel | None = None  # ring attention's kernels; None: no backward from a given lse
    decode: Callable = math_decode  # KV-cache decoding over cache slots (see decode())


def _never(*_) -> None:
    return None


BACKENDS: dict[str, Backend] = {
    "varlen": Backend("varlen", cuda.varlen_attn, cuda.varlen_missing, cuda.fa2_refuses, "sdpa",
                      BlockKernel(cuda.varlen_block_forward, cuda.varlen_block_backward), decode=cuda.varlen_decode),
    "flash": Backend("flash", cuda.flash_attn, cuda.flash_missing, cuda.fa2_refuses, "sdpa",
                     BlockKernel(cuda.flash_block_forward, cuda.flash_block_backward)),
    "sdpa": Backend("sdpa", sdpa_attn, _never, _never, None),
    "math": Backend("math", math_attn, _never, _never, None, BlockKernel(math_block_forward, math_block_backward)),
}
AUTO = {"cuda": "varlen"}  # device type -> the default backend; anything else: sdpa


class UnavailableBackend(UserError, ValueError):
    """A backend name that does not exist, or that this machine cannot run."""


def available() -> list[str]:
    """Backend names this machine can run (``auto`` first)."""
    return ["auto", *(n for n, b in BACKENDS.items() if b.missing() is None)]


def check_backend(name: str, field: str = "attn_backend") -> str:
    """``name`` when this machine has it; else an error naming what it has."""
    if name == "auto":
        return name
    if name not in BACKENDS:
        raise UnavailableBackend(f"{field}: unknown attention backend {name!r}; choose from "
                                 f"{', '.join(['auto', *BACKENDS])} (available here: {', '.join(available())})")
    why = BACKENDS[name].missing()
    if why is not None:
        raise UnavailableBackend(f"{field}: attention backend {name!r} is not available on this machine: {why}; "
                                 f"available here: {', '.join(available())}")
    return name


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning(message)


def default_backend(device: torch.device | str) -> str:
    name = AUTO.get(torch.device(device).type, "sdpa")
    return name if BACKENDS[name].missing() is None else "sdpa"


def resolve(name: str, q: torch.Tensor, k: torch.Tensor, *, block: bool = False) -> Backend:
    """The backend that will serve this call: ``name`` (``auto``: this device's default) unless it
    refuses the call, then its fallback, with one warning per distinct reason."""
    check_backend(name)
    chosen = default_backend(q.device) if name == "auto" else name
    while True:
        backend = BACKENDS[chosen]
        why = backend.missing() or backend.refuses(q, k)
        if why is None:
            break
        _warn_once(f"attention: {chosen} cannot serve this call ({why}); using {backend.fallback}")
        chosen = backend.fallback
    if block and backend.block is None:
        _warn_once(f"attention: {chosen} has no block kernel for ring attention; ring blocks use math")
        backend = BACKENDS["math"]
    return backend


def autocast_inputs(q, k, v):
    """q, k, v in the autocast dtype when autocast is on (as autocast does for SDPA): a norm with
    fp32 weights (Qwen3's qk-norm) promotes q and k to fp32 while v stays bf16, and FlashAttention
    takes one half-precision dtype."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, backend: str = "auto", **kw):
    """Dispatch to a backend by name (resolved against this call's tensors)."""
    q, k, v = autocast_inputs(q, k, v)
    return resolve(backend, q, k).attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, **kw)


def decode(q, k_cache, v_cache, slots, lengths, backend: str = "auto", scale=None):
    """KV-cache decoding, one query per sequence: ``q [B, H, D]`` over the first ``lengths[b]`` keys of
    cache slot ``slots[b]`` (``k_cache, v_cache [N, S, Hkv, D]``, ``slots`` ascending) ->
    ``(out [B, H, D], lse fp32 [H, B])``. ``varlen`` reads the slots in place (``seqused_k``); the
    others gather them and mask (``attention_ref.math_decode``)."""
    q, k_cache, v_cache = autocast_inputs(q, k_cache, v_cache)
    return resolve(backend, q, k_cache).decode(q, k_cache, v_cache, slots, lengths, scale)
