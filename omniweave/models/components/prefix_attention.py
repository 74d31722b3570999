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


class _Plan:
    """Index plan of a prefix-LM row for the queries one rank holds, in *key space*: the rows whose
    keys / values the layer attends to (this rank's rows; under context parallelism the whole
    zigzag-padded row, ``row_map`` of the CP hook). Built once per forward, on the first layer."""

    def __init__(self, prefix_lens: Tensor, key_cu: Tensor, query_rows: Tensor, local_cu: Tensor):
        key_cu = key_cu.to(torch.long)
        starts, doc_lens = key_cu[:-1], key_cu[1:] - key_cu[:-1]
        prefix = prefix_lens
        if bool((prefix > doc_lens).any()):
            raise ValueError(f"prefix_lens {prefix.tolist()} must lie within the documents' lengths {doc_lens.tolist()}")
        self.key_doc_starts, self.key_len = starts, int(key_cu[-1])
        has_prefix = prefix > 0
        self.key_prefix_rows = _ranges(starts[has_prefix], prefix[has_prefix])  # every prefix, in key space
        self.key_doc = torch.repeat_interleave(torch.arange(len(prefix), device=key_cu.device), doc_lens)
        doc = torch.repeat_interleave(torch.arange(len(prefix), device=key_cu.device), local_cu.diff().to(torch.long))
        in_prefix = query_rows - starts[doc] < prefix[doc]
        # prefix call: each document's prefix queries held here against its whole prefix (non-causal)
        self.prefix_rows = torch.nonzero(in_prefix).squeeze(1)
        held = torch.bincount(doc[in_prefix], minlength=len(prefix))
        sel = held > 0
        self.prefix_key_rows = _ranges(starts[sel], prefix[sel])
        self.cu_prefix, self.cu_prefix_keys = _cu(held[sel]), _cu(prefix[sel])
        # tail call: runs of consecutive tail queries (per document: one, or two zigzag chunks), each
        # against its document's keys up to its last query, causal bottom-right aligned
        self.tail_rows = torch.nonzero(~in_prefix).squeeze(1)
        q, d = query_rows[self.tail_rows], doc[self.tail_rows]
        new_run = torch.ones_like(q, dtype=torch.bool)
        new_run[1:] = (q[1:] != q[:-1] + 1) | (d[1:] != d[:-1])
        run = torch.cumsum(new_run.to(torch.long), 0) - 1
        run_len = torch.bincount(run, minlength=int(new_run.sum()))
        run_end = q[torch.cumsum(run_len, 0) - 1] + 1 if q.numel() else q
        run_start = starts[d[new_run]]
        self.tail_key_rows = _ranges(run_start, run_end - run_start)
        self.cu_tail, self.cu_tail_keys = _cu(run_len), _cu(run_end - run_start)


class PrefixLayout:
    """Prefix-LM attention for a packed row: document ``d`` (``cu_seqlens[d]:cu_seqlens[d+1]``)
    has a bidirectional prefix of ``prefix_lens[d]`` tokens, then a causal tail. ``keep_kv``: keep
    each layer's keys and values for :class:`ChunkLayout`.

    Under context parallelism (the decoder's ``attn_fn`` is a CP hook with ``row_map`` /
    ``gather_row``: parallel/context) the rows are this rank's zigzag share of the row: every
    layer all-gathers the keys / values of the whole row, attends its own queries with the same
    rules, and keeps the whole row's keys / values (whatever the CP attention mode)."""

    def __init__(self, cu_seqlens: Tensor, prefix_lens: Tensor, keep_kv: bool = False):
        cu = cu_seqlens.to(torch.long)
        prefix = prefix_lens.to(device=cu.device, dtype=torch.long).reshape(-1)
        if prefix.shape[0] != cu.shape[0] - 1:
            raise ValueError(f"prefix_lens has {prefix.shape[0]} entries for {cu.shape[0] - 1} documents")
        if bool((prefix < 0).any()):
            raise ValueError(f"prefix_lens {prefix.tolist()} must not be negative")
        self.cu_seqlens, self.prefix_lens = cu.to(torch.int32), prefix
        self.num_tokens = int(cu[-1])
        self.all_causal = bool((prefix == 0).all())
        self.all_prefix = bool((prefix == cu.diff()).all())
        self.keep_kv = keep_kv
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.plan: _Plan | None = None
        self.gather = None  # under CP: the hook's gather_row (keys / values / positions of the whole row)

    def _plan_for(self, attn_fn) -> _Plan:
        if self.plan is None:
            if attn_fn is None:
                self.plan = _Plan(self.prefix_lens, self.cu_seqlens, torch.arange(self.num_tokens,
                                  device=self.cu_seqlens.device), self.cu_seqlens)  # fmt: skip
            elif hasattr(attn_fn, "row_map"):
                key_cu, rows = attn_fn.row_map(self.cu_seqlens)
                self.plan = _Plan(self.prefix_lens, key_cu, rows, self.cu_seqlens)
                self.gather = lambda x: attn_fn.gather_row(x, self.cu_seqlens)
            else:
                raise UserError("a prefix-LM / action-expert layout does not run under chunked rows yet")
        return self.plan

    def attend(self, layer: int, q, k, v, cu_seqlens, window: int | None, backend: str, attn_fn=None) -> Tensor:
        """out [L, H, Dh] of the row's queries under the prefix-LM pattern (the Attention hook)."""
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"the layout covers {self.num_tokens} tokens, the layer got {q.shape[0]}")
        plan = self._plan_for(attn_fn)
        if self.gather is not None:  # the whole row's keys / values, in row order
            k, v = self.gather(torch.stack([k, v], 1)).unbind(1)
        if self.keep_kv:
            self.k[layer], self.v[layer] = k, v
        if self.gather is None and (self.all_causal or self.all_prefix):  # one call: plain causal / bidirectional
            out, _ = attn(q, k, v, self.cu_seqlens, self.cu_seqlens, self.all_causal, window, backend=backend,
                          need_lse=False)
            return out
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        for rows, keys, cu_q, cu_k, causal in ((plan.prefix_rows, plan.prefix_key_rows, plan.cu_prefix,
                                                plan.cu_prefix_keys, False),
                                               (plan.tail_rows, plan.tail_key_rows, plan.cu_tail, plan.cu_tail_keys,
                                                True)):  # fmt: skip
            if rows.numel():
                part, _ = attn(q[rows], k[keys], v[keys], cu_q, cu_k, causal, window, backend=backend, need_lse=False)
                out = out.index_copy(0, rows, part)
        return out

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
        plan = self._plan_for(None)  # the one the layers built, or this rank's own before any layer ran
        last = pos.max(0).values  # [L]: a token's largest position over the axes
        if self.gather is not None:
            last = self.gather(last)  # the whole row's
        rows = plan.key_prefix_rows
        top = torch.full((len(self.prefix_lens),), -1, dtype=last.dtype, device=pos.device)
        top = top.scatter_reduce(0, plan.key_doc[rows], last[rows], "amax")
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
        docs = chunk_docs.to(device=prefix.cu_seqlens.device, dtype=torch.long).reshape(-1)
        n = docs.shape[0]
        self.prefix, self.insulate, self.chunk_len, self.num_chunks = prefix, insulate, chunk_len, n
        lens = prefix.prefix_lens[docs]
        if bool((lens == 0).any()):
            raise ValueError("an action chunk belongs to a document without a prefix")
        if prefix.plan is None:
            raise ValueError("the prefix layout has not run yet: the backbone's pass comes before the chunks'")
        # keys of chunk n: its document's prefix rows (in key space: the whole row under CP), then its
        # own rows (offset by the key space's length in the concatenation [prefix keys, chunk keys])
        chunk_starts = prefix.plan.key_len + torch.arange(n, device=docs.device) * chunk_len
        starts = torch.stack([prefix.plan.key_doc_starts[docs], chunk_starts], 1).reshape(-1)
        counts = torch.stack([lens, torch.full_like(lens, chunk_len)], 1).reshape(-1)
        self.key_rows = _ranges(starts, counts)
        self.cu_q = _cu(torch.full((n,), chunk_len, dtype=torch.long, device=docs.device))
        self.cu_k = _cu(lens + chunk_len)

    def attend(self, layer: int, q, k, v, cu_seqlens, window: int | None, backend: str, attn_fn=None) -> Tensor:
        if attn_fn is not None:  # the expert's own layers get no CP hook: its chunks are whole on each rank
            raise UserError("an action-expert layout runs its chunks whole on each rank, without an attention hook")
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
