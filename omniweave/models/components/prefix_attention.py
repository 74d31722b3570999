"""Prefix-LM attention over packed rows, and an action chunk attending to its document's prefix.

A document of a packed row may start with a *bidirectional prefix* (images, the instruction, the
robot state: PaliGemma's prefix-LM, Pi0.5's prefix) of ``prefix_lens[d]`` tokens; the rest of the
document (text the model predicts) is causal and sees the whole prefix. An action chunk (Pi0.5's
suffix, run by the action expert) is a separate sequence: its tokens see their document's prefix
and each other bidirectionally, and nothing sees them, so the backbone's pass over the prefix never
depends on the actions and runs first, whole.

Everything is varlen calls through the attention interface (components/attention.py), so every
backend serves it and no L×L mask is built:

    prefix   q = k = the prefix tokens of every document     non-causal, cu = prefix boundaries
    tail     q = the tail tokens, k = the whole document     causal, bottom-right aligned: a tail
                                                             token sees the prefix and the tail up to itself
    chunk    q = a chunk's tokens, k = [prefix of its        non-causal (key order does not matter:
             document, the chunk]                            RoPE is applied before the gather)

A layout is passed to the decoder as its ``kv_cache`` (the object that owns attention during a
forward, as the generation caches do): ``Attention`` hands it each layer's q, k, v.
:class:`PrefixLayout` keeps each layer's prefix keys and values for the chunks; :class:`ChunkLayout`
reads them — detached with ``insulate`` (knowledge insulation: the flow loss then trains only the
expert through attention, the backbone's own queries still see the live keys). At sampling time one
``PrefixLayout`` serves every Euler step: the prefix is computed once.

The dense equivalent of a VLA row is ``components/flow.prefix_suffix_mask`` (tests compare).
"""

from __future__ import annotations

import torch
from torch import Tensor

from omniweave.errors import UserError
from omniweave.models.components.attention import attn


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """int64 concat of ``arange(s, s + n)`` over (s, n) pairs; empty when all n are 0."""
    lengths = lengths.to(torch.long)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    offsets = torch.repeat_interleave(starts.to(torch.long) - (torch.cumsum(lengths, 0) - lengths), lengths)
    return torch.arange(total, device=starts.device) + offsets


def _cu(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths.to(torch.long), 0), (1, 0)).to(torch.int32)


class PrefixLayout:
    """Prefix-LM attention for a packed row: document ``d`` (``cu_seqlens[d]:cu_seqlens[d+1]``)
    has a bidirectional prefix of ``prefix_lens[d]`` tokens, then a causal tail. ``keep_kv``: keep
    each layer's keys and values for :class:`ChunkLayout`."""

    def __init__(self, cu_seqlens: Tensor, prefix_lens: Tensor, keep_kv: bool = False):
        cu = cu_seqlens.to(torch.long)
        doc_lens = cu[1:] - cu[:-1]
        prefix = prefix_lens.to(device=cu.device, dtype=torch.long).reshape(-1)
        if prefix.shape[0] != doc_lens.shape[0]:
            raise ValueError(f"prefix_lens has {prefix.shape[0]} entries for {doc_lens.shape[0]} documents")
        if bool(((prefix < 0) | (prefix > doc_lens)).any()):
            raise ValueError(f"prefix_lens {prefix.tolist()} must lie within the documents' lengths {doc_lens.tolist()}")
        self.cu_seqlens, self.doc_starts, self.prefix_lens = cu.to(torch.int32), cu[:-1], prefix
        self.num_tokens = int(cu[-1])
        tail = doc_lens - prefix
        self.all_prefix = bool((tail == 0).all())
        self.all_causal = bool((prefix == 0).all())
        has_prefix, has_tail = prefix > 0, tail > 0
        # the prefix call: prefix tokens of the documents that have one
        self.prefix_rows = _ranges(self.doc_starts[has_prefix], prefix[has_prefix])
        self.cu_prefix = _cu(prefix[has_prefix])
        # the tail call: tail tokens as queries over their whole documents as keys
        self.tail_rows = _ranges(self.doc_starts[has_tail] + prefix[has_tail], tail[has_tail])
        self.tail_key_rows = _ranges(self.doc_starts[has_tail], doc_lens[has_tail])
        self.cu_tail, self.cu_tail_keys = _cu(tail[has_tail]), _cu(doc_lens[has_tail])
        self.keep_kv = keep_kv
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def attend(self, layer: int, q, k, v, cu_seqlens, window: int | None, backend: str, attn_fn=None) -> Tensor:
        """out [L, H, Dh] of the row's queries under the prefix-LM pattern (the Attention hook)."""
        if attn_fn is not None:
            raise UserError("a prefix-LM / action-expert layout does not run under context parallelism or "
                            "chunked rows yet")
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"the layout covers {self.num_tokens} tokens, the layer got {q.shape[0]}")
        if self.keep_kv:
            self.k[layer], self.v[layer] = k, v
        if self.all_causal or self.all_prefix:  # one call: the plain causal row, or all-bidirectional documents
            out, _ = attn(q, k, v, self.cu_seqlens, self.cu_seqlens, self.all_causal, window, backend=backend,
                          need_lse=False)
            return out
        p, t, tk = self.prefix_rows, self.tail_rows, self.tail_key_rows
        out_prefix, _ = attn(q[p], k[p], v[p], self.cu_prefix, self.cu_prefix, False, window, backend=backend,
                             need_lse=False)
        out_tail, _ = attn(q[t], k[tk], v[tk], self.cu_tail, self.cu_tail_keys, True, window, backend=backend,
                           need_lse=False)
        out = q.new_zeros(q.shape[0], *out_prefix.shape[1:])
        return out.index_copy(0, p, out_prefix).index_copy(0, t, out_tail)

    def mix_linear(self, layer: int, mixer, h, cu_seqlens):
        raise UserError("a prefix-LM / action-expert layout needs attention layers; this decoder has linear-attention "
                        "(Gated DeltaNet) layers, which are causal by construction")

    def chunk_positions(self, position_ids: Tensor, chunk_docs: Tensor, chunk_len: int) -> Tensor:
        """Positions [P, N·chunk_len] of action chunks: chunk n (of document ``chunk_docs[n]``)
        continues after the largest position of its document's prefix, on every position axis
        (M-RoPE's three alike, as text after an image does), as Pi0.5's suffix continues at the
        number of prefix tokens."""
        pos = position_ids if position_ids.dim() == 2 else position_ids[None]
        docs = chunk_docs.to(device=pos.device, dtype=torch.long)
        if bool((self.prefix_lens[docs] == 0).any()):
            raise ValueError("an action chunk belongs to a document without a prefix")
        last = pos.max(0).values  # [L]: a token's largest position over the axes
        doc_of_row = torch.repeat_interleave(torch.arange(len(self.prefix_lens), device=pos.device),
                                             self.cu_seqlens.diff().to(torch.long))
        in_prefix = torch.zeros_like(last, dtype=torch.bool)
        in_prefix[self.prefix_rows] = True
        top = torch.full((len(self.prefix_lens),), -1, dtype=last.dtype, device=pos.device)
        top = top.scatter_reduce(0, doc_of_row[in_prefix], last[in_prefix], "amax")
        steps = torch.arange(1, chunk_len + 1, device=pos.device, dtype=last.dtype)
        flat = (top[docs][:, None] + steps[None]).reshape(-1)
        return flat[None].expand(pos.shape[0], -1)


class ChunkLayout:
    """Action chunks of ``chunk_len`` tokens each (``chunk_docs[n]``: the row document whose prefix
    chunk ``n`` attends to), over ``prefix``'s kept keys and values. ``insulate``: the chunks read
    the prefix keys and values detached (knowledge insulation)."""

    def __init__(self, prefix: PrefixLayout, chunk_docs: Tensor, chunk_len: int, insulate: bool = False):
        if not prefix.keep_kv:
            raise ValueError("the prefix layout must keep its keys and values (keep_kv=True) for action chunks")
        docs = chunk_docs.to(device=prefix.doc_starts.device, dtype=torch.long).reshape(-1)
        n = docs.shape[0]
        self.prefix, self.insulate, self.chunk_len, self.num_chunks = prefix, insulate, chunk_len, n
        lens = prefix.prefix_lens[docs]
        if bool((lens == 0).any()):
            raise ValueError("an action chunk belongs to a document without a prefix")
        # keys of chunk n: its document's prefix rows (in the prefix row), then its own rows
        # (offset by the prefix row's length in the concatenation [prefix keys, chunk keys])
        chunk_starts = prefix.num_tokens + torch.arange(n, device=docs.device) * chunk_len
        starts = torch.stack([prefix.doc_starts[docs], chunk_starts], 1).reshape(-1)
        counts = torch.stack([lens, torch.full_like(lens, chunk_len)], 1).reshape(-1)
        self.key_rows = _ranges(starts, counts)
        self.cu_q = _cu(torch.full((n,), chunk_len, dtype=torch.long, device=docs.device))
        self.cu_k = _cu(lens + chunk_len)

    def attend(self, layer: int, q, k, v, cu_seqlens, window: int | None, backend: str, attn_fn=None) -> Tensor:
        if attn_fn is not None:
            raise UserError("an action-expert layout does not run under context parallelism or chunked rows yet")
        if layer not in self.prefix.k:
            raise ValueError(f"the prefix kept no keys for layer {layer}: the expert and the backbone must have "
                             "the same number of layers")
        kp, vp = self.prefix.k[layer], self.prefix.v[layer]
        if self.insulate:
            kp, vp = kp.detach(), vp.detach()
        keys = torch.cat([kp.to(k.dtype), k])[self.key_rows]
        values = torch.cat([vp.to(v.dtype), v])[self.key_rows]
        out, _ = attn(q, keys, values, self.cu_q, self.cu_k, False, window, backend=backend, need_lse=False)
        return out

    def mix_linear(self, layer: int, mixer, h, cu_seqlens):
        raise UserError("an action expert needs attention layers, not linear-attention ones")
