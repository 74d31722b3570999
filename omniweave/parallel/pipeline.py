"""Pipeline parallelism: an OmniModel cut into stages over ``torch.distributed.pipelining``.

    sizes  = split_layers(num_layers, pp, virtual, pp_layers, first_stage_cost)    # layers per stage
    pipe   = Pipeline(model, sizes, pp_group, device, schedule="1f1b", n_microbatches=4)
    loss   = pipe.step(rows, normaliser=global_loss_tokens)        # forward + backward of the rows

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
counts stack), ``labels [1, L]`` and ``token_valid [1, L]``. Media have a shape per row, so only
stage 0 reads them, from the step's rows by a row index (its positional input ``[1]``).

The loss of every micro-batch is its token-loss sum divided by ``normaliser`` (the loss tokens
of the global batch, DESIGN.md), so gradients are summed over micro-batches as they are
(``scale_grads=False``) and equal the single-process run's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
LOOPED = ("interleaved_1f1b", "zero_bubble")  # schedules with several (virtual) stages per rank


def split_layers(num_layers: int, pp: int, virtual: int = 1, pp_layers=None,
                 first_stage_cost: float | None = 0.0) -> list[int]:
    """Decoder layers of each of the ``pp · virtual`` stages, in stage order.

    ``pp_layers``: explicit counts (``parallel.pp_layers``), one per stage, each >= 1, summing to
    ``num_layers``. Otherwise ``first_stage_cost`` decides: None asks for a uniform split (the
    layers must divide evenly); a number >= 0 is the encoders' work in decoder-layer units
    (``encoder_cost_in_layers``), which stage 0 carries besides its layers, and the split
    minimises the largest stage cost (layers cost alike; ties go to the most even split)."""
    stages = pp * virtual
    if pp < 1 or virtual < 1:
        raise ValueError(f"parallel.pp={pp} and parallel.pp_virtual={virtual} must be >= 1")
    if num_layers < stages:
        raise ValueError(f"{num_layers} decoder layers cannot fill parallel.pp={pp} x parallel.pp_virtual={virtual} "
                         f"= {stages} stages (each stage needs at least one layer)")
    if pp_layers is not None:
        sizes = [int(n) for n in pp_layers]
        if len(sizes) != stages:
            raise ValueError(f"parallel.pp_layers {sizes} has {len(sizes)} entries; parallel.pp={pp} x "
                             f"parallel.pp_virtual={virtual} needs one per stage ({stages})")
        if min(sizes) < 1 or sum(sizes) != num_layers:
            raise ValueError(f"parallel.pp_layers {sizes} must be >= 1 each and sum to the foundation's "
                             f"{num_layers} layers (model.foundation.num_layers); they sum to {sum(sizes)}")
        return sizes
    if first_stage_cost is None:
        if num_layers % stages:
            raise ValueError(f"a uniform split of {num_layers} layers over parallel.pp={pp} x parallel.pp_virtual="
                             f"{virtual} = {stages} stages does not divide; set parallel.pp_layers")
        return [num_layers // stages] * stages
    if first_stage_cost < 0:
        raise ValueError(f"first_stage_cost={first_stage_cost} must be >= 0")
    if stages == 1:
        return [num_layers]

    def split(first: int) -> list[int]:  # stage 0 takes ``first``, the rest as evenly as possible
        q, r = divmod(num_layers - first, stages - 1)
        return [first] + [q + (s >= stages - 1 - r) for s in range(stages - 1)]  # extras to the last stages

    candidates = [split(first) for first in range(1, num_layers - stages + 2)]
    return min(candidates, key=lambda s: (max(s[0] + first_stage_cost, *s[1:]), max(s) - min(s)))


def encoder_cost_in_layers(model_cfg: dict, patches_per_token: float) -> float:
    """The encoders' forward + backward work per row in decoder-layer units, from the FLOP cost
    model (parallel/cost_model.py): ``p · patches / (b / num_layers)`` per token. Its proxy: a
    decoder layer costs its share of the per-token matmuls ``b`` (the LM head's share included),
    the encoder its per-patch matmuls and window attention ``p``; attention over whole frames and
    documents (the squared terms) is left out."""
    from omniweave.parallel.cost_model import CostModel

    cost = CostModel.from_model_config(model_cfg)
    per_layer = cost.b / int(model_cfg["foundation"]["num_layers"])
    return cost.p * patches_per_token / per_layer


def stage_ranges(sizes: list[int]) -> list[range]:
    """The decoder layers of each stage, from ``split_layers``' counts."""
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [range(end - n, end) for n, end in zip(sizes, ends)]


def slice_model(model: nn.Module, layers, first: bool, last: bool, share: bool = False) -> nn.Module:
    """A copy of ``model`` holding only decoder ``layers``, and the encoders, projectors and
    embedding when ``first``, the final norm and LM head when ``last``; the other parts are None
    (parameter names unchanged). ``share``: the kept parts are ``model``'s own modules (not copies).
    Every part of the model must be one of these, so that a new part cannot be dropped silently.
    The parallel hooks (CP attention, media splits, TP's loss) are copied but keep their process
    groups; a copy without the encoders has no media splits."""
    foundation = model.foundation
    first_parts = [foundation.embed_tokens, *(getattr(model, s) for m in model.modalities for s in (m.encoder, m.projector))]
    last_parts = [foundation.norm, foundation.lm_head]
    keep = {id(m): first for m in first_parts if m is not None}  # None: not in this (already sliced) model
    keep.update({id(m): last for m in last_parts if m is not None})
    keep.update({id(layer): i in layers for i, layer in enumerate(foundation.layers) if layer is not None})
    containers = {id(foundation), id(foundation.layers)}
    unknown = [name for name, m in (*model.named_children(), *foundation.named_children())
               if m is not None and id(m) not in keep and id(m) not in containers]
    if unknown:
        raise TypeError(f"pipeline stages do not know where these parts of the model go: {unknown}")
    memo = {i: None for i, kept in keep.items() if not kept}  # deepcopy maps each of them to None
    # the parallel hooks on the model (CP attention, media splits, TP's loss) are copied with it but keep
    # their process groups, which cannot be copied; without the encoders a stage needs no media split
    # (whose hooks hold the encoders' methods)
    memo.update({id(group): group for group in dist.distributed_c10d._world.pg_map} if dist.is_initialized() else {})
    if not first and hasattr(model, "media_splits"):
        memo[id(model.media_splits)] = {}
    if share:
        memo.update({id(m): m for m in (*first_parts, *last_parts, *foundation.layers) if m is not None and keep[id(m)]})
    part = copy.deepcopy(model, memo=memo)
    if not share:
        _check_no_original_modules(part, model)
    return part


def _check_no_original_modules(part: nn.Module, model: nn.Module) -> None:
    """TypeError if a function stored on the copy (an attribute, a hook) still reaches a module of
    ``model``: deepcopy copies modules and objects but not functions, so a closure (or a default
    argument, or a ``functools.partial``) over a layer would make the copy compute with the
    original's weights, and leave its own without gradients."""
    originals = {id(m) for m in model.modules()}
    copies = {id(m) for m in part.modules()}

    def reached(value, depth: int = 0):
        if isinstance(value, nn.Module):
            yield value
        elif depth < 3 and callable(value) and not isinstance(value, type):
            if isinstance(value, partial):
                inner = [value.func, *value.args, *value.keywords.values()]
            else:
                cells = getattr(value, "__closure__", None) or ()
                inner = [getattr(value, "__self__", None), *(getattr(value, "__defaults__", None) or ()),
                         *(c.cell_contents for c in cells if c.cell_contents is not None)]
            for v in inner:
                yield from reached(v, depth + 1)

    for name, module in part.named_modules():
        hooks = [h for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks") for h in getattr(module, attr).values()]
        stored = [v for k, v in vars(module).items() if not k.startswith("_") and callable(v)]
        for fn in (*hooks, *stored):
            leaked = [m for m in reached(fn) if id(m) in originals and id(m) not in copies]
            if leaked:
                raise TypeError(f"pipeline stage copy: {name or 'the model'} holds {fn!r}, which reaches a module of the "
                                f"original model ({type(leaked[0]).__name__}); store an object deepcopy can copy instead")


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
        self.row_loss = None  # the training mode's loss of a row on the last stage (Pipeline.set_row_loss)
        self.step_stats: dict[str, torch.Tensor] = {}  # the row losses' statistics of the step

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
        return out

    def _forward(self, x, position_ids, cu_seqlens, labels, token_valid, chunk=None, **row_inputs):
        if chunk is not None:  # parallel.seq_chunks: x is a chunk of a row (parallel/pipeline_chunks.py)
            from omniweave.parallel.pipeline_chunks import forward_chunk

            return forward_chunk(self, x, position_ids, cu_seqlens, labels, token_valid, chunk,
                                 row_inputs.get("loss_weight"))
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
        if self.row_loss is not None:  # e.g. DPO's pair loss (train/dpo.py)
            loss_sum, stats = self.row_loss(model, foundation.norm(h), labels[0], {k: v[0] for k, v in row_inputs.items()})
            for k, v in stats.items():
                self.step_stats[k] = self.step_stats.get(k, 0.0) + v.detach().double()
            return torch.stack([loss_sum])
        weights = row_inputs.get("loss_weight")
        return torch.stack([model.loss_sum(foundation.norm(h), labels[0], None if weights is None else weights[0])])


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
    if any("loss_weight" in (r.get("token_data") or {}) for r in rows):  # fractional per-turn loss weights
        kwargs["loss_weight"] = torch.stack([(r.get("token_data") or {}).get("loss_weight", torch.ones(length))
                                             for r in rows])
    return _Inputs(torch.arange(len(rows)), {k: v.to(device) for k, v in kwargs.items()})


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
        self.row_loss = None
        self.last_stats: dict[str, float] = {}  # the row loss's statistics of the last step, on every rank

    def set_row_loss(self, row_loss) -> None:
        """A training mode's own loss of a row on the last stage, instead of the token loss sum:
        ``row_loss.inputs(row) -> {name: tensor}`` (static shapes: they are stacked over the step's
        rows and handed to every stage with the row's metadata), ``row_loss(model, hidden [L, D]
        after the final norm, labels [L], inputs) -> (loss sum, {stat: 0-d tensor})`` and
        ``row_loss.stat_keys``: the statistics ``step`` sums over the rows into ``last_stats``."""
        if self.seq_chunks > 1:
            raise ValueError("a training mode's own row loss does not run on chunked rows (parallel.seq_chunks)")
        self.row_loss = row_loss
        for m in self.modules:
            m.row_loss = row_loss

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

    def step(self, rows: list[dict], normaliser: float) -> float:
        """Forward + backward of ``rows`` (gradients accumulate in the stages' parameters); returns
        Σ loss_sum / normaliser on every rank of the group."""
        self.check_rows(rows)  # before any send: a shape change would abort inside the backend
        self.capacity = int(rows[0]["input_ids"].shape[0])
        self._normaliser = float(normaliser)
        plans = None
        if self.seq_chunks > 1:  # the rows' chunk plans, once for the keyword tensors and every stage
            from omniweave.parallel.pipeline_chunks import chunk_kwargs, plan_rows

            plans = plan_rows(rows, self.seq_chunks, self.local.foundation.config.sliding_window)
            inputs = chunk_kwargs(rows, plans, self.device)
        else:
            inputs = stack_rows(rows, self.device)
        if self.row_loss is not None:
            per_row = [self.row_loss.inputs(r) for r in rows]
            inputs.kwargs.update({k: torch.stack([p[k] for p in per_row]).to(self.device) for k in per_row[0]})
        for m in self.modules:
            m.rows = rows
            if m.chunks is not None:
                m.chunks.begin_step(m, rows, plans)
        args = (inputs.row_index.to(self.device),) if any(m.is_first for m in self.modules) else ()
        has_last = any(m.is_last for m in self.modules)
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=inputs.kwargs["labels"] if has_last else None,
                           losses=losses if has_last else None, **inputs.kwargs)
        for m in self.modules:
            m.rows = []
            if m.chunks is not None:
                m.chunks.end_step(m)
        keys = tuple(self.row_loss.stat_keys) if self.row_loss is not None else ()
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


def check_model(model: nn.Module, sizes: list[int]) -> None:
    """What the stages need of the model, checked on every rank before any stage runs (an error
    inside the schedule would stop one rank and leave the others waiting for its sends)."""
    if not hasattr(model, "foundation_inputs") or not hasattr(model.foundation, "run_layers"):
        raise TypeError(f"pipeline stages are built from an OmniModel over a Decoder foundation, got "
                        f"{type(model).__name__}")
    if getattr(model.foundation.config, "tie_word_embeddings", False):
        raise ValueError("tied word embeddings (model.foundation.tie_word_embeddings) put the embedding "
                         "and the LM head in different pipeline stages; untie them to use parallel.pp")
    levels = getattr(model, "deepstack_levels", 0)
    if levels > sizes[0]:
        raise ValueError(f"stage 0 holds {sizes[0]} layers but the DeepStack adds {levels} levels after the "
                         f"first {levels} layers, which must sit in stage 0: give it at least {levels} "
                         "(parallel.pp_layers)")


def unsupported_with_pp(cfg) -> str | None:
    """Why a pipelined run (``parallel.pp`` > 1) of this recipe cannot run yet: the settings it
    cannot honour, by their keys, in one line; None when it can."""
    found = {"train.phase=grpo": cfg.train.get("phase") == "grpo",
             "data.mix": (cfg.get("data") or {}).get("mix") is not None}  # the stage split reads data.path's stats
    named = [k for k, v in found.items() if v]
    pp = int(cfg.parallel.get("pp", 1) or 1)
    return f"parallel.pp={pp} does not support {', '.join(named)} yet" if named else None


def build_pipeline(model: nn.Module, cfg, dims, meshes, device) -> Pipeline:
    """The trainer's pipeline from the recipe: ``parallel.pp_layers`` or the cost-model split
    (the encoders' share from the packed data's vision tokens per row), ``parallel.pp_schedule``,
    ``parallel.pp_virtual``; one micro-batch per row of the rank's ``train.global_batch / dp``, or
    ``parallel.seq_chunks`` per row (parallel/pipeline_chunks.py)."""
    from omniweave.config import to_dict

    from omniweave.parallel.pipeline_rows import static_row_length, static_rows
    from omniweave.parallel.tp import sequence_parallel_batch

    par, model_cfg = cfg.parallel, to_dict(cfg.model)
    pp_layers = par.get("pp_layers")
    cost = None if pp_layers is not None else encoder_cost_in_layers(model_cfg, _patches_per_token(cfg.data.path, model_cfg))
    sizes = split_layers(model.foundation.config.num_layers, dims.pp, int(par.get("pp_virtual", 1) or 1),
                         None if pp_layers is None else list(pp_layers), first_stage_cost=cost)
    from omniweave.parallel.seq_chunks import seq_chunks_of

    max_len, chunks = int(cfg.data.max_len), seq_chunks_of(cfg)
    length = static_row_length(max_len, dims.cp, dims.tp, _max_docs(cfg.data.path) if dims.cp > 1 else None)
    length = -(-length // chunks) * chunks  # parallel.seq_chunks (cp = tp = 1): equal chunks cross the stages
    prepare = partial(static_rows, max_len=max_len, length=length, cp=dims.cp, cp_rank=meshes.cp_rank, tp=dims.tp)
    return Pipeline(model, sizes, meshes.pp.get_group(), device, str(par.get("pp_schedule", "1f1b")),
                    n_microbatches=int(cfg.train.global_batch) // dims.dp, prepare_rows=prepare,
                    row_fn=partial(sequence_parallel_batch, meshes.tp) if dims.tp > 1 else None, seq_chunks=chunks)


def _stats(packed: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(packed) / "stats.json").read_text())


def _max_docs(packed: str) -> int | None:
    """The most documents in one pack of the packed data (stats.json; None if it does not say)."""
    most = (_stats(packed).get("docs_per_pack") or {}).get("max")
    return None if most is None else int(most)


def _patches_per_token(packed: str, model_cfg: dict) -> float:
    """Encoder patches per decoder token of the packed data (stats.json: vision tokens, each
    merge² patches, over the packs' capacity tokens); 0 for a model without an image encoder."""
    vit = model_cfg.get("image_encoder")
    if vit is None:
        return 0.0
    stats = _stats(packed)
    merge = int((model_cfg.get("projector") or {}).get("merge_size") or vit.get("spatial_merge_size", 2))
    return stats["vision_tokens"] * merge**2 / max(stats["capacity_tokens"], 1)
