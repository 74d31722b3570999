"""Pipeline parallelism: an OmniModel cut into stages over ``torch.distributed.pipelining``.

    sizes  = split_layers(num_layers, pp, virtual, pp_layers, first_stage_cost)    # pipeline_split.py
    pipe   = Pipeline(model, sizes, pp_group, device, schedule="1f1b", n_microbatches=4)
    loss   = pipe.step(rows, normaliser, objective)      # forward + backward of the rows, scored by the objective

Stages are built from the model's own parts, from outside it (the model has no pipeline code):
stage 0 holds the encoders + projectors, the token embedding and its decoder layers (DeepStack
levels are added after the first layers, so those layers must sit in stage 0); a middle stage
holds decoder layers; the last holds its layers, the final norm, the LM head and the loss. A
stage module carries the parts under the model's own names (``foundation.layers.5.mlp…``), so
its ``named_parameters`` / state dict are a slice of the model's. Rank r holds stages
r, r + pp, r + 2·pp… (``virtual`` of them: the interleaved schedules' loop placement).

A micro-batch is one packed row. What crosses a stage boundary is the hidden state
``[1, capacity, D]``, and ``torch.distributed.pipelining`` fixes its receive buffers from the first
micro-batch: a later row of another length would abort the process inside the communication
backend (pytorch#159942). So every row of a run must have the run's length (pad short rows with
``pad_rows``; a trainer's rows: parallel/pipeline_rows.py), and ``Pipeline.step`` checks that
before anything is sent, raising ValueError.

With TP and CP (parallel/dims.py: ``pp`` is the outermost mesh dim, so every (dp, cp, tp)
coordinate has its own pipeline of pp ranks): the model is cut after it was tensor-parallelised
and its attention swapped for CP's, so the stages hold the sharded parts and the CP attention. A
row reaches a pipeline as its CP shard, and what crosses a boundary is the tp rank's sequence
shard ``[1, length / tp, D]`` (a plain tensor: the decoder layers' output between TP regions);
the per-row metadata below are the CP shard's, whole over tp (the TP layers gather the
sequence). Stage 0 takes each row through TP's sequence-parallel batch (``row_fn``), as the
model's forward pre-hook would. The CP and TP collectives in a stage's forward and backward run
between the ranks holding that stage, which run the same schedule in the same order. The last
stage's loss is TP's vocab-parallel one (replicated over tp); each CP rank's pipeline reports its
shard's (the trainer sums them over dp x cp, parallel/dims.py's dp_cp mesh).

Per-row metadata does not cross a boundary: the schedule hands every stage its micro-batch's
slice of the step's keyword tensors (checked in torch 2.13: ``step(**kwargs)`` is chunked on dim
0 on every rank and each stage's forward receives its chunk): M-RoPE ``position_ids [1, 3, L]``,
``cu_seqlens [1, K]`` (-1 past the row's own documents, so that rows with different document
counts stack), ``labels [1, L]``, ``token_valid [1, L]``, the row's per-token values
``tok__<key> [1, L]`` (``token_data``: loss weights, pair slots, old log-probs, …) and the training
objective's per-row inputs ``row__<key>`` (``Objective.row_inputs``, static shapes). Media have a
shape per row, so only stage 0 reads them, from the step's rows by a row index (its positional
input ``[1]``).

The last stage scores each micro-batch with the step's training objective (train/objective.py,
``StageModule.score``): its loss sum divided by ``normaliser`` (the global count of the step,
DESIGN.md), so gradients are summed over micro-batches as they are (``scale_grads=False``) and
equal the single-process run's; the objective's statistics are summed over the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omniweave.parallel.pipeline_split import check_model, slice_model, stage_ranges

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
LOOPED = ("interleaved_1f1b", "zero_bubble")  # schedules with several (virtual) stages per rank


class StageModule(nn.Module):
    """One stage of an OmniModel: the model's parts it needs, under their own names.

    ``forward(x, position_ids, cu_seqlens, labels, token_valid)``: x is the row index ``[1]``
    (int64) on stage 0, else the hidden state ``[1, L, D]``; the last stage returns the row's
    token-loss sum ``[1]`` (fp32), the others the hidden state ``[1, L, D]``."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool, row_fn=None):
        """``model``: this rank's part of the model (``slice_model``), whose modules the stage shares;
        ``row_fn(model, row)``: the row as stage 0's model takes it (a tp foundation's
        ``tp.sequence_parallel_batch``: the model's forward pre-hook, which no stage calls)."""
        super().__init__()
        part = slice_model(model, layers, first, last, share=True)
        for name, child in part.named_children():
            self.add_module(name, child)
        self._model = (part,)  # not a submodule: its children are registered above
        self.layer_ids, self.is_first, self.is_last, self.row_fn = layers, first, last, row_fn
        self.rows: list[dict] = []  # the step's rows (stage 0 reads their media)
        self.chunks = None  # parallel.seq_chunks: the step's per-row chunk state (pipeline_chunks.StageChunks)
        self.metadata_pass = True  # the next forward is torch's shape inference (see forward)
        self.objective = None  # the step's training objective (train/objective.py), on the last stage
        self.step_stats: dict[str, torch.Tensor] = {}  # the objective's statistics of the step

    def forward(self, *args, **kwargs):
        """A micro-batch through the stage. The first call is torch.distributed.pipelining's
        metadata inference at the start of the first step (micro-batch 0 on stage 0, empty tensors
        on the others, before any real forward of this stage): what it counted in the MoE layers'
        router statistics and the row loss's statistics is dropped, so the step's metrics and bias
        update see the real forwards only."""
        out = self._forward(*args, **kwargs)
        if self.metadata_pass:
            from omniweave.models.components.router_loss import RouterStats, router_layers

            self.metadata_pass = False
            for m in router_layers(self):
                m.stats = RouterStats()
            self.step_stats.clear()
            if self.chunks is not None:
                self.chunks.sums.clear()
        return out

    def score(self, h: torch.Tensor, labels: torch.Tensor, inputs: dict):
        """The last stage's objective on one micro-batch's hidden states (after the final norm):
        (loss sum, target) with the statistics added to the step's."""
        model = self._model[0]
        target = self.objective.target(*split_inputs(labels, inputs))
        loss_sum, stats = self.objective.loss(model, h, target)
        self.add_stats(stats)
        return loss_sum

    def add_stats(self, stats: dict) -> None:
        for k, v in stats.items():
            self.step_stats[k] = self.step_stats.get(k, 0.0) + v.detach().double()

    def _forward(self, x, position_ids, cu_seqlens, labels, token_valid, chunk=None, **inputs):
        if chunk is not None:  # parallel.seq_chunks: x is a chunk of a row (parallel/pipeline_chunks.py)
            from omniweave.parallel.pipeline_chunks import forward_chunk

            return forward_chunk(self, x, position_ids, cu_seqlens, labels, token_valid, chunk, inputs)
        model, foundation = self._model[0], self.foundation
        cu = cu_seqlens[0][cu_seqlens[0] >= 0]
        deepstack = None
        if self.is_first:
            row = self.rows[int(x)]
            inputs = model.foundation_inputs(row if self.row_fn is None else self.row_fn(model, row))
            h, deepstack = inputs["inputs_embeds"], inputs.get("deepstack")
        else:
            h = x[0]
        cos, sin = foundation.rope(position_ids[0])
        layers = ((i, foundation.layers[i]) for i in self.layer_ids)
        h = foundation.run_layers(h, cos, sin, cu, layers, deepstack=deepstack, token_valid=token_valid[0])
        # outputs are not views: the split (zero-bubble) backward detaches a stage's outputs in place
        if not self.is_last:
            return h[None].clone()
        return torch.stack([self.score(foundation.norm(h), labels, inputs)])


TOKEN_PREFIX, ROW_PREFIX = "tok__", "row__"  # the step's keyword tensors: a row's token_data, its objective inputs


def split_inputs(labels: torch.Tensor, inputs: dict) -> tuple[dict, dict]:
    """A micro-batch's keyword tensors ``[1, …]`` back as (batch with labels and token_data, row inputs)."""
    tokens = {k[len(TOKEN_PREFIX):]: v[0] for k, v in inputs.items() if k.startswith(TOKEN_PREFIX)}
    row = {k[len(ROW_PREFIX):]: v[0] for k, v in inputs.items() if k.startswith(ROW_PREFIX)}
    return {"labels": labels[0], "token_data": tokens}, row


def pad_rows(rows: list[dict], capacity: int) -> list[dict]:
    """Each row with one loss-free pad document appended up to ``capacity`` tokens (the packs'
    ``max_len``): the static length a pipeline run needs. Pads change no loss or gradient."""
    from omniweave.parallel.context.sharding import append_pad_document

    long = [r["input_ids"].shape[0] for r in rows if r["input_ids"].shape[0] > capacity]
    if long:
        raise ValueError(f"rows of {long} tokens exceed the pipeline capacity of {capacity} (data.max_len)")
    return [append_pad_document(r, capacity - r["input_ids"].shape[0]) for r in rows]


@dataclass
class _Inputs:
    row_index: torch.Tensor  # [n] int64
    kwargs: dict  # name -> [n, ...]


def stack_rows(rows: list[dict], device) -> _Inputs:
    """The step's per-row metadata stacked on dim 0 (the schedule chunks it per micro-batch)."""
    length = rows[0]["input_ids"].shape[0]
    docs = max(r["cu_seqlens"].numel() for r in rows)

    def cu(r):
        c = r["cu_seqlens"].to(torch.int32)
        return torch.cat([c, c.new_full((docs - c.numel(),), -1)])

    def valid(r):
        v = r.get("token_valid")
        return torch.ones(length, dtype=torch.bool) if v is None else v

    def pos(r):
        p = r.get("position_ids")
        p = torch.arange(length)[None] if p is None else p
        return p[None] if p.dim() == 1 else p

    kwargs = {"position_ids": torch.stack([pos(r) for r in rows]), "cu_seqlens": torch.stack([cu(r) for r in rows]),
              "labels": torch.stack([r["labels"] for r in rows]), "token_valid": torch.stack([valid(r) for r in rows])}
    for key in sorted({k for r in rows for k in (r.get("token_data") or {})}):  # per-token values of the objective
        kwargs[TOKEN_PREFIX + key] = torch.stack([_token_values(r, key, length) for r in rows])
    return _Inputs(torch.arange(len(rows)), {k: v.to(device) for k, v in kwargs.items()})


def _token_values(row: dict, key: str, length: int) -> torch.Tensor:
    """A row's ``token_data[key]``; a row without fractional loss weights has weight 1 everywhere."""
    values = (row.get("token_data") or {}).get(key)
    if values is not None:
        return values
    if key == "loss_weight":
        return torch.ones(length)
    raise ValueError(f"a pipeline step's rows must all carry token_data[{key!r}] (one row lacks it)")


def stack_row_inputs(per_row: list[dict]) -> dict:
    """The rows' objective inputs (``Objective.row_inputs``, static shapes) stacked on dim 0."""
    if not per_row or not per_row[0]:
        return {}
    return {ROW_PREFIX + k: torch.stack([p[k] for p in per_row]) for k in per_row[0]}


class Pipeline:
    """This rank's stages of ``model`` and the schedule that runs them (see the module doc).

    ``sizes``: layers per stage (``split_layers``); ``group``: the pipeline's process group (its
    ranks hold stages r, r + pp, …); ``n_microbatches``: rows per step; ``prepare_rows(rows)``: the
    step's rows as ``step`` takes them (``static_rows``; default: unchanged); ``row_fn``: see
    ``StageModule``."""

    def __init__(self, model: nn.Module, sizes: list[int], group, device, schedule: str = "1f1b",
                 n_microbatches: int = 1, prepare_rows=None, row_fn=None, seq_chunks: int = 1):
        from torch.distributed import pipelining as pl

        from omniweave.parallel import pipeline_chunks

        pp, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(sizes) % pp:
            raise ValueError(f"{len(sizes)} stages do not spread over parallel.pp={pp} ranks")
        virtual = len(sizes) // pp
        check_schedule(schedule, virtual)
        if seq_chunks > 1:
            pipeline_chunks.check_chunked_pipeline(seq_chunks, schedule, virtual)
        check_microbatches(n_microbatches * seq_chunks, pp, schedule)
        check_model(model, sizes)
        ranges = stage_ranges(sizes)
        ids = [rank + v * pp for v in range(virtual)]
        mine = [i for s in ids for i in ranges[s]]
        # this rank's part of the model: what the optimizer and checkpoints see; the stages share its modules
        self.local = slice_model(model, mine, 0 in ids, len(sizes) - 1 in ids)
        self.modules = [StageModule(self.local, ranges[s], s == 0, s == len(sizes) - 1, row_fn) for s in ids]
        self.stages = [pl.PipelineStage(m, s, len(sizes), device, group=group) for m, s in zip(self.modules, ids)]
        self.n_microbatches, self.group, self.device = n_microbatches, group, device
        self.prepare_rows = prepare_rows or (lambda rows: rows)
        self.capacity: int | None = None  # the row length fixed by the first step
        self._normaliser = 1.0
        cls = {"1f1b": pl.Schedule1F1B, "gpipe": pl.ScheduleGPipe, "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
               "zero_bubble": pl.ScheduleInterleavedZeroBubble}[schedule]
        stages = self.stages if schedule in LOOPED else self.stages[0]
        self.seq_chunks = seq_chunks
        if seq_chunks > 1:  # micro-batches are the rows' chunks, backwards in reverse
            self.schedule = pipeline_chunks.chunked_schedule(self.stages, n_microbatches * seq_chunks, self._loss)
            for m in self.modules:
                m.chunks = pipeline_chunks.StageChunks()
        else:
            self.schedule = cls(stages, n_microbatches, loss_fn=self._loss, scale_grads=False)
        self.last_rank = dist.get_global_rank(group, (len(sizes) - 1) % pp)
        self.last_stats: dict[str, float] = {}  # the objective's statistics of the last step, on every rank

    def _loss(self, loss_sum: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
        return loss_sum.sum() / self._normaliser

    def named_parameters(self):
        """(name, parameter) of this rank's stages, under the model's names."""
        return self.local.named_parameters()

    def check_rows(self, rows: list[dict]) -> None:
        """ValueError unless the step has ``n_microbatches`` rows, all of the run's length."""
        if len(rows) != self.n_microbatches:
            raise ValueError(f"a pipeline step takes {self.n_microbatches} rows (micro-batches), got {len(rows)}")
        lengths = [int(r["input_ids"].shape[0]) for r in rows]
        capacity = lengths[0] if self.capacity is None else self.capacity
        if self.seq_chunks > 1 and capacity % self.seq_chunks:
            raise ValueError(f"parallel.seq_chunks={self.seq_chunks}: the pipeline's rows of {capacity} tokens do not "
                             "split into equal chunks (what crosses the stages has one shape); pad them to a multiple")
        if any(n != capacity for n in lengths):
            raise ValueError(f"pipeline rows must all have the run's length {capacity} (the hidden state crossing "
                             f"the stages has a fixed shape); got lengths {lengths}: pad them with pad_rows")

    def step(self, rows: list[dict], normaliser: float, objective) -> float:
        """Forward + backward of ``rows`` (gradients accumulate in the stages' parameters), the last
        stage scoring each with ``objective`` (train/objective.py; its ``row_inputs`` are taken
        without a model: a stage holds part of it); returns Σ loss_sum / normaliser on every rank
        of the group, and the objective's statistics summed over the rows in ``last_stats``."""
        self.check_rows(rows)  # before any send: a shape change would abort inside the backend
        self.capacity = int(rows[0]["input_ids"].shape[0])
        self._normaliser = float(normaliser)
        per_row = [objective.row_inputs(None, r) for r in rows]
        plans = None
        if self.seq_chunks > 1:  # the rows' chunk plans, once for the keyword tensors and every stage
            from omniweave.parallel.pipeline_chunks import chunk_kwargs, plan_rows

            plans = plan_rows(rows, self.seq_chunks, self.local.foundation.config.sliding_window)
            inputs = chunk_kwargs(rows, plans, self.device)
            per_row = [p for p, row_plans in zip(per_row, plans) for _ in row_plans]  # each chunk its row's
        else:
            inputs = stack_rows(rows, self.device)
        inputs.kwargs.update({k: v.to(self.device) for k, v in stack_row_inputs(per_row).items()})
        for m in self.modules:
            m.rows, m.objective = rows, objective
            if m.chunks is not None:
                m.chunks.begin_step(m, rows, plans)
        args = (inputs.row_index.to(self.device),) if any(m.is_first for m in self.modules) else ()
        has_last = any(m.is_last for m in self.modules)
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=inputs.kwargs["labels"] if has_last else None,
                           losses=losses if has_last else None, **inputs.kwargs)
        for m in self.modules:
            m.rows, m.objective = [], None
            if m.chunks is not None:
                m.chunks.end_step(m)
        keys = tuple(objective.stat_keys)
        total = torch.zeros(1 + len(keys), dtype=torch.float64)
        if has_last:
            stats = next(m.step_stats for m in self.modules if m.is_last)
            total = torch.stack([torch.stack(losses).sum().detach().double().cpu(),
                                 *(torch.as_tensor(stats.get(k, 0.0), dtype=torch.float64).cpu() for k in keys)])
            stats.clear()
        total = total.to(self.device)
        dist.broadcast(total, src=self.last_rank, group=self.group)
        self.last_stats = dict(zip(keys, total[1:].tolist()))
        return float(total[0])


def check_schedule(schedule: str, virtual: int) -> None:
    """``parallel.pp_schedule`` is known and fits ``parallel.pp_virtual`` (stages per rank)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if (virtual > 1) != (schedule in LOOPED):
        raise ValueError(f"parallel.pp_schedule={schedule} with parallel.pp_virtual={virtual}: "
                         f"{', '.join(LOOPED)} need pp_virtual >= 2, the others 1")


def check_microbatches(n_microbatches: int, pp: int, schedule: str) -> None:
    """The schedules' rules on micro-batches (rows per step and pipeline), as errors naming keys."""
    if n_microbatches < pp:
        raise ValueError(f"{n_microbatches} micro-batches (packed rows per step and data-parallel rank: "
                         f"train.global_batch / dp) are fewer than the parallel.pp={pp} pipeline stages")
    rounds = max(1, n_microbatches // pp)
    if schedule in LOOPED and n_microbatches % rounds:
        raise ValueError(f"parallel.pp_schedule={schedule} runs micro-batches in rounds of parallel.pp={pp}: "
                         f"{n_microbatches} rows per step (train.global_batch / dp) must be a multiple of {rounds}")
