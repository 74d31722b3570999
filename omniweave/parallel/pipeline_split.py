"""Where a pipeline cuts the model (parallel/pipeline.py runs the stages):

    sizes = split_layers(num_layers, pp, virtual, pp_layers, first_stage_cost)   # layers per stage
    part  = slice_model(model, stage_ranges(sizes)[s], first, last)             # a stage's parts

Stage 0 holds the encoders + projectors, the token embedding and its decoder layers; a middle
stage decoder layers; the last its layers, the final norm and the LM head. The split minimises
the largest stage's cost, the encoders counted on stage 0 in decoder-layer units from the FLOP
cost model (``encoder_cost_in_layers``), unless ``parallel.pp_layers`` says. ``check_model``: what
the stages need of the model, on every rank before any stage runs.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
from torch import nn


def split_layers(num_layers: int, pp: int, virtual: int = 1, pp_layers=None,
                 first_stage_cost: float | None = 0.0, layer_costs: list[float] | None = None) -> list[int]:
    """Decoder layers of each of the ``pp · virtual`` stages, in stage order.

    ``pp_layers``: explicit counts (``parallel.pp_layers``), one per stage, each >= 1, summing to
    ``num_layers``. Otherwise ``first_stage_cost`` decides: None asks for a uniform split (the
    layers must divide evenly); a number >= 0 is the encoders' work in decoder-layer units
    (``encoder_cost_in_layers``), which stage 0 carries besides its layers, and the split
    minimises the largest stage cost (layers cost alike; ties go to the most even split).
    ``layer_costs``: each layer's cost in those units where layers differ (a hybrid model's linear
    and full-attention layers, ``cost_model.decoder_layer_costs``); the split then minimises the
    largest stage's sum (ties: stage sizes nearest the even split)."""
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

    if layer_costs is not None:
        if len(layer_costs) != num_layers or min(layer_costs) < 0:
            raise ValueError(f"layer_costs needs {num_layers} non-negative entries, got {len(layer_costs)}")
        return _split_by_cost([float(c) for c in layer_costs], stages, first_stage_cost)

    def split(first: int) -> list[int]:  # stage 0 takes ``first``, the rest as evenly as possible
        q, r = divmod(num_layers - first, stages - 1)
        return [first] + [q + (s >= stages - 1 - r) for s in range(stages - 1)]  # extras to the last stages

    candidates = [split(first) for first in range(1, num_layers - stages + 2)]
    return min(candidates, key=lambda s: (max(s[0] + first_stage_cost, *s[1:]), max(s) - min(s)))


def _split_by_cost(costs: list[float], stages: int, first_stage_cost: float) -> list[int]:
    """Contiguous stage sizes minimising the largest stage cost (stage 0 also carries
    ``first_stage_cost``): dynamic programming over (stages, layers), O(stages · n²); among the
    optimal splits, from the last stage back, each stage's size nearest n / stages."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the least largest-stage cost of layers [0, j) in s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    for j in range(1, n + 1):
        best[1][j] = prefix[j] + first_stage_cost
    for s in range(2, stages + 1):
        for j in range(s, n + 1):
            best[s][j] = min(max(best[s - 1][k], prefix[j] - prefix[k]) for k in range(s - 1, j))
    sizes, j, even = [], n, n / stages
    for s in range(stages, 1, -1):
        target = best[s][j] * (1 + 1e-12)
        ks = [k for k in range(s - 1, j) if max(best[s - 1][k], prefix[j] - prefix[k]) <= target]
        k = min(ks, key=lambda k: abs((j - k) - even))
        sizes.append(j - k)
        j = k
    return [j, *reversed(sizes)]


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
        memo[id(model.media_handoffs)] = {}
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
