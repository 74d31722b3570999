"""Chunked rows (``parallel.seq_chunks``): one long packed row run as ``n`` chunks along the sequence,
so that the activation memory of its forward/backward is set by the chunk, not by the row.

    loss_sum, stats = chunked_forward_backward(model, mb, loss_fn, n, scale)   # backward done inside

The only thing that crosses from one chunk into another is token mixing: a chunk's queries see the
keys of their own documents in the chunks before it (a linear-attention layer instead carries the
state a document had at the chunk boundary: parallel/chunk_state.py). So (the ChunkPipe / TeraPipe
recipe):

1. forward sweep, no grad, chunks 0 .. n-1: every attention layer writes its chunk's post-RoPE
   keys and values into the row's :class:`ChunkKV` store and attends over the keys its documents
   have so far (:func:`plan_chunks`: per document, queries = document ∩ chunk, keys = document ∩
   [0, chunk end), trimmed to the sliding window; causal bottom-right alignment then lines every
   query up with its own row). Nothing else of the sweep is kept.
2. backward sweep, chunks n-1 .. 0: chunk c is recomputed with grad; the stored K/V of earlier
   rows enter as leaf tensors; ``autograd.backward([loss_c · scale, k_c, v_c, …], [1, gK_c, gV_c,
   …])`` backpropagates the chunk's loss together with what later chunks' queries sent to its own
   keys and values (the fp32 accumulators gK, gV), and the leaves' gradients are added into the
   accumulators of the earlier rows. Every row's gK/gV is complete before its chunk runs, and the
   parameter gradients sum to the unchunked row's.
3. media (``OmniModel.media_splits``, :class:`RowFeatures`): the forward sweep encodes the row's
   items once, under no grad; in the backward sweep chunks > 0 read the features as a leaf whose
   gradient accumulates, and chunk 0 (the last backward) encodes them with grad and backpropagates
   its own loss plus the accumulated feature gradient, so the encoders' backward runs once.
   DeepStack levels ride in the same features (components/deepstack.py).

The model sees ordinary micro-batches (:func:`chunk_batch`: the chunk's ids, labels, positions,
document boundaries and media feature rows, the keys a context-parallel shard has) through its own
forward, so FSDP2's hooks see one forward and one backward per chunk; ``gradient_sync`` turns the
reduce-scatter on for the last backward only. The per-chunk pieces (:func:`plan_chunks`,
:class:`ChunkKV` and its per-layer ``attn_fn``) know nothing of the sweeps and would serve a
pipeline stage as they are.

Memory, per row of L tokens: the activations of one chunk, plus per layer the K/V store
(2·L·kv_dim values in the compute dtype) and its fp32 gradient accumulator (2·L·kv_dim·4 bytes),
plus, while a chunk runs, the earlier keys and values its documents see (at most 2·L·kv_dim per
layer). MLA layers (components/mla.py) store the expanded per-head k and the padded v.

Under pipeline parallelism the chunks are the pipeline's micro-batches (parallel/pipeline_chunks.py:
``ChunkKV``'s ``pipelined`` mode, ``LateGrad``, ``RowFeatures``' ``pipelined`` mode). What it cannot
do yet is refused, with the reason, by train/layouts.py: context or tensor parallelism, a
pipeline schedule other than gpipe, MoE foundations (the router statistics would count the forward
sweep and the recompute). Every training objective runs: a sum over tokens chunk by chunk, a
sequence-level one (DPO's pairs) through its per-row sums carried across the chunks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from omniweave.models.components.attention import attn, autocast_inputs
from omniweave.models.registry import MODALITIES
from omniweave.parallel.chunk_state import ChunkStates
from omniweave.parallel.context.sharding import WHOLE_ROW_KEYS

# keys of a micro-batch (loader.collate_pack) that chunk_batch cuts / passes through
_ROW_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "token_valid", "token_data",
             *(k for m in MODALITIES for k in (m.spans, m.rows)))


# ---------------------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of a row: its rows ``[start, end)``, the first row whose K/V its queries see
    (``key_start``), and the kernel's boundaries: ``cu_q`` the chunk's documents (relative to
    ``start``), ``cu_k`` the same documents' key rows in ``[key_start, end)`` (relative to
    ``key_start``)."""

    start: int
    end: int
    key_start: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    doc_start: int = 0  # the first row of the chunk's first document (< start: it began in an earlier chunk)
    doc_end: int = 0  # the end of the chunk's last document (> end: it goes on in a later chunk)


def chunk_bounds(length: int, n_chunks: int) -> list[tuple[int, int]]:
    """``n_chunks`` chunks of ``ceil(length / n_chunks)`` rows (the last one shorter; fewer chunks
    when the row is shorter than ``n_chunks`` rows)."""
    if n_chunks < 1:
        raise ValueError(f"parallel.seq_chunks={n_chunks} must be >= 1")
    size = max(1, -(-length // n_chunks))
    return [(s, min(s + size, length)) for s in range(0, length, size)]


def plan_chunks(cu_seqlens, n_chunks: int, window: int | None = None) -> list[ChunkPlan]:
    """The chunks of a row with document boundaries ``cu_seqlens`` ``[0, …, L]`` (empty documents
    allowed). A query at row i sees the keys of its document at rows <= i, and with a sliding
    ``window`` only rows > i - window: a chunk starting at row s needs no key before s - window + 1."""
    bounds = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the row length, got {bounds[:8]}")
    docs = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    plans = []
    for s, e in chunk_bounds(bounds[-1], n_chunks):
        inside = [(a, b) for a, b in docs if a < e and b > s]
        key_start = max(inside[0][0], s - window + 1 if window else 0)
        cu_q, cu_k = [0], [0]
        for a, b in inside:
            cu_q.append(cu_q[-1] + min(b, e) - max(a, s))
            cu_k.append(cu_k[-1] + min(b, e) - max(a, key_start))
        plans.append(ChunkPlan(s, e, key_start, tuple(cu_q), tuple(cu_k), inside[0][0], inside[-1][1]))
    return plans


# ---------------------------------------------------------------------------- K/V store and attention


class ChunkKV:
    """The K/V of one row's chunks for every attention layer, and their gradient accumulators.

    ``begin(plan, grad)`` before each chunk; the layers' ``attn_fn`` (:meth:`attn_fn`) then attend
    through :meth:`attend`. Without grad a chunk's K/V are written into the store; with grad the
    chunk's own k, v (as the layer computed them) are recorded in ``own`` and the earlier rows'
    K/V enter as leaves whose gradients are added into ``grads(layer)`` as soon as they exist."""

    def __init__(self, length: int):
        self.length = length
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.gk: dict[int, torch.Tensor] = {}
        self.gv: dict[int, torch.Tensor] = {}
        self.plan: ChunkPlan | None = None
        self.grad = False
        self.states = ChunkStates()  # the linear-attention layers' (parallel/chunk_state.py)

    def begin(self, plan: ChunkPlan, grad: bool, pipelined: bool = False) -> None:
        """``pipelined`` (with ``grad``): the chunk runs once, with grad, inside a pipeline stage
        (parallel/pipeline_chunks.py): its K/V are written to the store for the later chunks, and
        its own k, v take the gradient those sent them when its backward runs (after theirs)."""
        self.plan, self.grad, self.pipelined = plan, grad, pipelined
        self.states.begin(plan, grad, pipelined)
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._cu: tuple[torch.Tensor, torch.Tensor] | None = None

    def attn_fn(self, layer: int, backend: str) -> "ChunkAttention":
        return ChunkAttention(self, layer, backend)

    def hook(self, index: int, layer: nn.Module) -> None:
        """Decoder layer ``index`` reads its earlier chunks through this store: attention's K/V
        (``attn_fn``), a linear-attention layer's carried state (``carry``)."""
        if layer.linear:
            layer.linear_attn.carry = self.states.carry(index)
        else:
            layer.self_attn.attn_fn = self.attn_fn(index, layer.self_attn.cfg.attn_backend)

    @staticmethod
    def unhook(layer: nn.Module) -> None:
        if layer.linear:
            layer.linear_attn.carry = None
        else:
            layer.self_attn.attn_fn = None

    def attend(self, layer: int, q, k, v, window: int | None, backend: str) -> torch.Tensor:
        """out [chunk, H, D] of the chunk's queries over their documents' keys up to the chunk's end."""
        p = self.plan
        if q.shape[0] != p.end - p.start:
            raise ValueError(f"chunked attention got {q.shape[0]} queries for the chunk of rows [{p.start}, {p.end})")
        q, kc, vc = autocast_inputs(q, k, v)
        if layer not in self.k:
            self.k[layer] = kc.new_empty((self.length, *kc.shape[1:]))
            self.v[layer] = vc.new_empty((self.length, *vc.shape[1:]))
        if not self.grad:
            self.k[layer][p.start:p.end] = kc
            self.v[layer][p.start:p.end] = vc
            keys, values = self.k[layer][p.key_start:p.end], self.v[layer][p.key_start:p.end]
        else:
            self.own.setdefault(layer, (k, v))  # a recompute (activation checkpointing) keeps the first
            if self.pipelined:
                self.k[layer][p.start:p.end] = kc.detach()
                self.v[layer][p.start:p.end] = vc.detach()
                kc, vc = (LateGrad.apply(t, partial(self._sent, layer, i, p.start, p.end)) for i, t in enumerate((kc, vc)))
            keys, values = kc, vc
            if p.key_start < p.start:
                if layer not in self.leaves:
                    self.leaves[layer] = (self._leaf(self.k, self.gk, layer), self._leaf(self.v, self.gv, layer))
                lk, lv = self.leaves[layer]
                keys, values = torch.cat([lk, kc]), torch.cat([lv, vc])
        cu_q, cu_k = self._cu_tensors(q.device)
        out, _ = attn(q, keys, values, cu_q, cu_k, True, window, backend=backend, need_lse=False)
        return out

    def grads(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gK, gV) fp32 [L, Hkv, D] of ``layer``: what later queries sent to each row's key / value."""
        for store, acc in ((self.k, self.gk), (self.v, self.gv)):
            if layer not in acc:
                acc[layer] = torch.zeros(store[layer].shape, dtype=torch.float32, device=store[layer].device)
        return self.gk[layer], self.gv[layer]

    def _sent(self, layer: int, which: int, start: int, end: int) -> torch.Tensor:
        """What later chunks' queries sent to rows [start, end) of ``layer``'s keys (0) / values (1)."""
        return self.grads(layer)[which][start:end]

    def backward_roots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chunk's own k, v of every layer and the gradients later chunks sent them."""
        p, roots, grads = self.plan, [], []
        for layer, own in self.own.items():
            for t, acc in zip(own, self.grads(layer)):
                if t.requires_grad:
                    roots.append(t)
                    grads.append(acc[p.start:p.end].to(t.dtype))
        return roots, grads

    def _leaf(self, store: dict, acc: dict, layer: int) -> torch.Tensor:
        p = self.plan
        leaf = store[layer][p.key_start:p.start].detach().requires_grad_()
        target = self.grads(layer)[0 if acc is self.gk else 1][p.key_start:p.start]

        def add(t: torch.Tensor) -> None:  # into the accumulator, and the leaf's own copy freed
            target.add_(t.grad)
            t.grad = None

        leaf.register_post_accumulate_grad_hook(add)
        return leaf

    def _cu_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cu is None:
            self._cu = (torch.tensor(self.plan.cu_q, dtype=torch.int32, device=device),
                        torch.tensor(self.plan.cu_k, dtype=torch.int32, device=device))
        return self._cu


class LateGrad(torch.autograd.Function):
    """Identity whose backward adds ``extra()``, read when the backward runs: the gradient that
    later chunks sent to a chunk's keys / values (or features) by then."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, extra) -> torch.Tensor:
        ctx.extra = extra
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        more = ctx.extra()
        return (grad if more is None else grad + more.to(grad.dtype)), None


@dataclass
class ChunkAttention:
    """A decoder layer's ``attn_fn`` (``fn(q, k, v, cu_seqlens, window) -> out``) over a :class:`ChunkKV`."""

    store: ChunkKV
    layer: int
    backend: str

    def __call__(self, q, k, v, cu_seqlens, window: int | None = None) -> torch.Tensor:
        return self.store.attend(self.layer, q, k, v, window, self.backend)


class RowFeatures:
    """One modality's ``media_splits`` hook for one row (see the module docstring, step 3).
    ``mode``: ``forward`` (encode once, no grad, reuse), ``leaf`` (the features as a leaf that
    gathers the chunks' gradients) or ``live`` (encode with grad); ``pipelined`` (a pipeline
    stage, chunks in order, backwards in reverse): the first chunk encodes with grad and its
    backward, the last one, carries what the later chunks' leaf gathered."""

    def __init__(self, inner=None):
        self.inner = inner  # the hook this one wraps (None: the model's own encode)
        self.mode, self.value, self.leaf, self.live = "forward", None, None, None

    def _encode(self, encode, inputs, grid) -> torch.Tensor:
        return encode(inputs, grid) if self.inner is None else self.inner(encode, inputs, grid)

    def __call__(self, encode, inputs, grid) -> torch.Tensor:
        if self.mode == "forward":
            if self.value is None:
                self.value = self._encode(encode, inputs, grid)
            return self.value
        if self.mode == "pipelined":
            if self.live is None:
                self.live = self._encode(encode, inputs, grid)
                self.leaf = self.live.detach().requires_grad_()
                return LateGrad.apply(self.live, lambda: self.leaf.grad)
            return self.leaf
        if self.mode == "leaf":
            if self.leaf is None:
                self.leaf = self.value.detach().requires_grad_()
            return self.leaf
        self.live = self._encode(encode, inputs, grid)
        return self.live

    def backward_root(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The live features and the gradient the leaf gathered (nothing when none flowed)."""
        if self.live is None or not self.live.requires_grad or self.leaf is None or self.leaf.grad is None:
            return [], []
        return [self.live], [self.leaf.grad]


# ---------------------------------------------------------------------------- the row


def row_features(model: nn.Module, mode: str = "forward") -> dict[str, RowFeatures]:
    """A ``RowFeatures`` hook per modality of the model, items in the row or not: a row without
    items encodes the encoder's dummy input (``OmniModel.run_encoder_always``) through the same
    hook, so every row runs each encoder the same number of times and data-parallel ranks' FSDP
    collectives stay matched whatever media their rows hold."""
    splits = getattr(model, "media_splits", {})
    out = {m.name: RowFeatures(splits.get(m.name)) for m in getattr(model, "modalities", ())}
    for f in out.values():
        f.mode = mode
    return out


def media_rows(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """Per modality with items in the row: its feature rows int64 [L] (from the batch's own rows
    key, or its checked spans)."""
    from omniweave.models.omni import feature_rows_from_spans

    length, out = batch["input_ids"].shape[0], {}
    for m in getattr(model, "modalities", ()):
        grid = batch.get(m.grid)
        if grid is None or grid.shape[0] == 0:
            continue
        rows = batch.get(m.rows)
        if rows is None:
            spans = model.check_media_spans(batch.get(m.spans), grid, length, m.name, batch.get(m.sizes) if m.sizes else None)
            rows = feature_rows_from_spans(spans, length)
        out[m.name] = rows.to(device=batch["input_ids"].device, dtype=torch.long)
    return out


def chunk_batch(batch: dict, plan: ChunkPlan, rows: dict[str, torch.Tensor], labels: bool = True) -> dict:
    """The micro-batch of one chunk: ids, labels (all -100 with ``labels=False``), positions,
    token_valid cut to the chunk's rows, its document boundaries, per modality with items its
    feature rows in place of the spans; the encoders' inputs and the pack's counts unchanged."""
    unknown = sorted(set(batch) - set(_ROW_KEYS) - set(WHOLE_ROW_KEYS))
    if unknown:
        raise ValueError(f"parallel.seq_chunks does not know how to cut batch key(s) {unknown}")
    s, e, ids = plan.start, plan.end, batch["input_ids"]
    positions = batch.get("position_ids")
    positions = torch.arange(ids.shape[0], device=ids.device)[None] if positions is None else positions
    out = {"input_ids": ids[s:e], "labels": batch["labels"][s:e] if labels else torch.full_like(ids[s:e], -100),
           "position_ids": positions[..., s:e],
           "cu_seqlens": torch.tensor(plan.cu_q, dtype=torch.int32, device=ids.device)}
    if batch.get("token_valid") is not None:
        out["token_valid"] = batch["token_valid"][s:e]
    if batch.get("token_data") is not None:  # per-token values (a turn's loss_weight) cut like the labels
        out["token_data"] = {k: v[s:e] for k, v in batch["token_data"].items()}
    by_name = {m.name: m for m in MODALITIES}
    for name, r in rows.items():
        out[by_name[name].rows] = r[s:e]
    out.update({k: batch[k] for k in WHOLE_ROW_KEYS if k in batch})
    return out


@contextlib.contextmanager
def media_hooks(model: nn.Module, features: dict[str, RowFeatures]):
    """``features`` as the model's media hooks (``media_splits``) for the duration of one row (or
    one chunk: parallel/pipeline_chunks.py); the previous hooks come back after."""
    splits = model.media_splits if hasattr(model, "media_splits") else {}
    saved = {name: splits.get(name) for name in features}
    try:
        splits.update(features)
        yield
    finally:
        for name, hook in saved.items():
            if hook is None:
                splits.pop(name, None)
            else:
                splits[name] = hook


@contextlib.contextmanager
def installed(model: nn.Module, store: ChunkKV, features: dict[str, RowFeatures]):
    """The store as every decoder layer's ``attn_fn`` and ``features`` as the model's media hooks,
    for the duration of one row; the previous hooks come back after."""
    layers = list(model.foundation.layers)
    if any(l.linear_attn.cp_fn is not None if l.linear else l.self_attn.attn_fn is not None for l in layers):
        raise ValueError("parallel.seq_chunks: the decoder's attention is already swapped (context "
                         "parallelism, parallel.cp > 1); chunked rows need parallel.cp = 1")
    try:
        for i, layer in enumerate(layers):
            store.hook(i, layer)
        with media_hooks(model, features):
            yield
    finally:
        for layer in layers:
            store.unhook(layer)


def chunked_forward_backward(model: nn.Module, batch: dict, objective, row: dict, n_chunks: int, scale: float,
                             forward_context=contextlib.nullcontext, gradient_sync=None):
    """Forward and backward of one packed row in ``n_chunks`` chunks (module docstring); the
    parameter gradients of ``loss_sum · scale`` are accumulated into ``.grad``.

    ``objective`` (train/objective.py) scores each chunk's micro-batch (:func:`chunk_batch`) with
    the row's inputs ``row``. A token-sum objective's loss is each chunk's own, taken in the
    backward sweep. A sequence-level one (``token_sum`` False) is a function of per-row sums:
    the forward sweep adds up every chunk's ``sums``, ``from_sums`` gives the row's loss and its
    gradient ``g`` with respect to the sums, and each chunk's backward backpropagates
    ``Σ g · sums_chunk``: by the chain rule exactly the gradient of the unchunked row's loss.
    ``forward_context()`` wraps every forward (the trainer's autocast); ``gradient_sync(on)`` is
    called before each backward, ``on`` for the last one (FSDP2's ``set_requires_gradient_sync``).
    Returns (loss_sum, stats) of the row, detached."""
    from omniweave.models.components.router_loss import router_layers

    if router_layers(model):
        raise ValueError("parallel.seq_chunks does not support MoE foundations yet (model.foundation.num_experts): "
                         "the router statistics would count each chunk twice")
    length = batch["input_ids"].shape[0]
    cu = batch.get("cu_seqlens")
    window = model.foundation.config.sliding_window
    plans = plan_chunks([0, length] if cu is None else cu, n_chunks, window)
    if plans and plans[-1].end != length:
        raise ValueError(f"cu_seqlens end at {plans[-1].end}, the row has {length} tokens")
    rows = media_rows(model, batch)
    store, features = ChunkKV(length), row_features(model)
    whole = objective.token_sum
    loss_sum = torch.zeros((), dtype=torch.float64, device=batch["input_ids"].device)
    stats = {k: torch.zeros((), dtype=torch.float64, device=loss_sum.device) for k in objective.stat_keys}
    sums, grad = None, None
    with installed(model, store, features):
        with torch.no_grad():
            for plan in plans:
                store.begin(plan, grad=False)
                with forward_context():
                    part = model(chunk_batch(batch, plan, rows, labels=not whole), head=objective.sums_head(row))
                sums = part if sums is None or part is None else sums + part
        if not whole:  # the row's loss from its sums, and its gradient with respect to them
            sums = sums.detach().float().requires_grad_()
            loss, extra = objective.from_sums(sums, objective.target(batch, row))
            (grad,) = torch.autograd.grad(loss.float() * scale, sums)
            loss_sum += loss.detach().double()
            for k, v in extra.items():
                stats[k] = stats[k] + v.detach().double()
        for i in reversed(range(len(plans))):
            store.begin(plans[i], grad=True)
            for f in features.values():
                f.mode = "live" if i == 0 else "leaf"
            with forward_context():
                mb = chunk_batch(batch, plans[i], rows)
                if whole:
                    loss, extra = model(mb, head=objective.head(row))
                    root = loss.float() * scale
                else:
                    root = model(mb, head=objective.surrogate_head(row, grad))
            roots, grads = store.backward_roots()
            for f in features.values() if i == 0 else ():
                more = f.backward_root()
                roots, grads = roots + more[0], grads + more[1]
            if gradient_sync is not None:
                gradient_sync(i == 0)
            torch.autograd.backward([root, *roots], [None, *grads])
            if whole:
                loss_sum += loss.detach().double()
                for k, v in extra.items():
                    stats[k] = stats[k] + v.detach().double()
    return loss_sum, stats


__all__ = ["ChunkAttention", "ChunkKV", "ChunkPlan", "RowFeatures", "chunk_batch", "chunk_bounds",
           "chunked_forward_backward", "plan_chunks"]
