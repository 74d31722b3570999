"""Chunked rows through a pipeline (``parallel.seq_chunks`` with ``parallel.pp``): each packed row
is cut into ``n`` chunks along the sequence and the chunks are the pipeline's micro-batches.

    pipe = Pipeline(model, sizes, group, device, schedule="gpipe", n_microbatches=rows, seq_chunks=4)
    pipe.step(rows, normaliser)        # rows * 4 micro-batches: row 0's chunks, then row 1's, ...

What crosses a stage boundary is a chunk's hidden state ``[1, length / n, D]`` (every row padded
to one length divisible by ``n``: parallel/pipeline_rows.py), so the receive buffers are the
chunk's, whatever the row length. Inside a stage the chunks meet only in attention, through the
row's K/V store of parallel/seq_chunks.py (:class:`ChunkKV`, per stage and row): a chunk attends to
its documents' keys in the earlier chunks, and sends them gradient.

The order makes that exact: the schedule (torch's ``ScheduleLoopedBFS`` with one stage per rank:
fill-drain, the backwards in reverse micro-batch order) runs every chunk's forward in order,
then the backwards from the last chunk to the first. A chunk's forward writes its K/V into the
store and passes its own k, v through ``LateGrad``; the earlier K/V enter as leaves whose
gradients add into the store's accumulators. When a chunk's backward runs, every later chunk's
has, so ``LateGrad`` adds the complete gradient those sent to its keys and values. Media: stage 0
encodes a row's items in its first chunk, with grad; the later chunks read the features as a
leaf, whose gathered gradient the first chunk's backward (the row's last) carries into the
encoders (``RowFeatures``' ``pipelined`` mode).

Memory: the decoder layers of a stage run under activation checkpointing per chunk, so a stage
keeps each chunk's input hidden state (what the schedule keeps anyway) and the K/V store with its
fp32 accumulators (2·L·kv_dim values + 2·L·kv_dim·4 bytes per layer and row), and the
activations of one chunk at a time; its backward recomputes the chunk's forward (as at pp = 1).
The rows of a step all stay in flight until the drain, so their stores add up.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from omniweave.parallel.seq_chunks import ChunkKV, ChunkPlan, chunk_batch, media_hooks, media_rows, plan_chunks, row_features


def check_chunked_pipeline(seq_chunks: int, schedule: str, virtual: int) -> None:
    """What chunked rows need of the pipeline's recipe keys (errors name them)."""
    if schedule != "gpipe" or virtual != 1:
        raise ValueError(f"parallel.seq_chunks={seq_chunks} under parallel.pp runs fill-drain with the backwards in "
                         "reverse chunk order (a chunk's keys get their gradient from the later chunks): set "
                         f"parallel.pp_schedule=gpipe and parallel.pp_virtual=1 (got {schedule}, {virtual})")


def chunked_schedule(stages: list, n_microbatches: int, loss_fn):
    """Fill-drain with the backwards in reverse micro-batch order (see the module doc)."""
    from torch.distributed import pipelining as pl

    return pl.ScheduleLoopedBFS(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


class StageChunks:
    """One stage's chunk state for a step: per row its chunk plans, K/V store and media features."""

    def __init__(self):
        self.plans, self.stores, self.media, self.features = [], [], [], []
        self.sums: dict[int, torch.Tensor] = {}  # a sequence-level objective's sums of each row so far
        self.grads: dict[int, torch.Tensor] = {}  # d loss / d sums of each row, once its last chunk ran

    def begin_step(self, stage, rows: list[dict], plans: list[list[ChunkPlan]]) -> None:
        """``plans``: each row's chunks (:func:`plan_rows`)."""
        model = stage._model[0]
        self.plans = plans
        self.stores = [ChunkKV(r["input_ids"].shape[0]) for r in rows]
        if stage.is_first:
            self.media = [media_rows(model, r) for r in rows]
            self.features = [row_features(model, "pipelined") for _ in rows]

    def end_step(self, stage) -> None:
        self.plans, self.stores, self.media, self.features = [], [], [], []
        self.sums.clear()
        self.grads.clear()
        for i in stage.layer_ids:
            ChunkKV.unhook(stage.foundation.layers[i])


def plan_rows(rows: list[dict], n_chunks: int, window: int | None) -> list[list[ChunkPlan]]:
    """Each row's ``n_chunks`` chunks (seq_chunks.plan_chunks; ``window``: the foundation's sliding window)."""
    return [plan_chunks(r["cu_seqlens"], n_chunks, window) for r in rows]


def chunk_kwargs(rows: list[dict], plans: list[list[ChunkPlan]], device):
    """The step's micro-batches (``pipeline._Inputs``): each chunk's positions, document boundaries,
    labels and token_valid (seq_chunks.chunk_batch) stacked as ``pipeline.stack_rows`` stacks rows,
    in micro-batch order (row-major), with ``chunk`` = (row, chunk index); ``plans``: :func:`plan_rows`."""
    from omniweave.parallel.pipeline import stack_rows

    inputs = stack_rows([chunk_batch(row, p, {}) for row, row_plans in zip(rows, plans) for p in row_plans], device)
    index = [(r, c) for r, row_plans in enumerate(plans) for c in range(len(row_plans))]
    inputs.kwargs["chunk"] = torch.tensor(index).to(device)
    return inputs


def forward_chunk(stage, x, position_ids, cu_seqlens, labels, token_valid, chunk, inputs: dict) -> torch.Tensor:
    """``StageModule.forward`` for one chunk (micro-batch), with the stage's ``StageChunks``."""
    state, (r, c) = stage.chunks, (int(v) for v in chunk[0])
    model, foundation = stage._model[0], stage.foundation
    plan, store = state.plans[r][c], state.stores[r]
    deepstack = None
    if stage.is_first:
        if c == 0:  # a row's media are encoded afresh by its first chunk (torch runs a first step's first
            for f in state.features[r].values():  # micro-batch once more, to infer the stage's shapes)
                f.live = f.leaf = None
        with media_hooks(model, state.features[r]):
            inputs = model.foundation_inputs(chunk_batch(stage.rows[r], plan, state.media[r]))
        h, deepstack = inputs["inputs_embeds"], inputs.get("deepstack")
    else:
        h = x[0]
    cos, sin = foundation.rope(position_ids[0])
    cu = cu_seqlens[0][cu_seqlens[0] >= 0]

    def layers(h, cos, sin):  # re-run by the checkpoint's recompute: the store is set to this chunk again
        store.begin(plan, grad=True, pipelined=True)
        for i in stage.layer_ids:
            store.hook(i, foundation.layers[i])
        return foundation.run_layers(h, cos, sin, cu, ((i, foundation.layers[i]) for i in stage.layer_ids),
                                     deepstack=deepstack, token_valid=token_valid[0])

    h = checkpoint(layers, h, cos, sin, use_reentrant=False)
    if not stage.is_last:
        return h[None].clone()
    if stage.objective.token_sum:
        return torch.stack([stage.score(foundation.norm(h), labels, inputs)])
    return torch.stack([_sequence_chunk(stage, foundation.norm(h), labels, inputs, r, c)])


def _sequence_chunk(stage, h, labels, inputs: dict, r: int, c: int) -> torch.Tensor:
    """A sequence-level objective on chunk ``c`` of row ``r`` (the last stage): the chunk's sums are
    added to the row's; the row's last chunk computes the loss from them and d loss / d sums.
    Each chunk returns :class:`SumsGrad` of its sums, whose value is the row's loss on its last
    chunk (0 before) and whose backward, which runs after every chunk's forward (fill-drain),
    sends d loss / d sums into the chunk's sums: the chain rule over the row's chunks."""
    from omniweave.parallel.pipeline import split_inputs

    state, objective = stage.chunks, stage.objective
    batch, row = split_inputs(labels, inputs)
    target = objective.target(batch, row)
    sums = objective.sums(stage._model[0], h, target).float()
    state.sums[r] = sums.detach() if r not in state.sums else state.sums[r] + sums.detach()
    value = torch.zeros((), dtype=torch.float32, device=h.device)
    if c == len(state.plans[r]) - 1:
        with torch.enable_grad():
            whole = state.sums[r].requires_grad_()
            loss, stats = objective.from_sums(whole, target)
            (state.grads[r],) = torch.autograd.grad(loss.float(), whole)
        stage.add_stats(stats)
        value = loss.detach().float()
    if stage.metadata_pass:  # torch's shape inference runs a backward of this one forward alone
        return SumsGrad.apply(sums, value, lambda: torch.zeros_like(sums))
    return SumsGrad.apply(sums, value, lambda: state.grads[r])


class SumsGrad(torch.autograd.Function):
    """``value`` forward; backward: the upstream gradient times ``grad()`` (d loss / d sums, read
    when the backward runs) into ``sums``."""

    @staticmethod
    def forward(ctx, sums: torch.Tensor, value: torch.Tensor, grad) -> torch.Tensor:
        ctx.grad = grad
        return value.clone()

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):
        return upstream * ctx.grad(), None, None
