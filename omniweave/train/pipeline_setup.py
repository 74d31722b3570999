"""A pipelined run's pipeline from its recipe (``parallel.pp`` > 1; parallel/pipeline.py builds it).

    rows     = PipelineRows.of(cfg, dims)              # SFT / DPO: data.max_len, global_batch / dp rows
    pipeline = build_pipeline(model, cfg, dims, meshes, device, rows)

The stage split is ``parallel.pp_layers`` or the cost model's (the encoders' share from the packed
data's vision tokens per row, stats.json; a hybrid model's linear and full-attention layers at
their own costs); ``parallel.pp_schedule`` and ``parallel.pp_virtual``
pick the schedule; one micro-batch per row, or ``parallel.seq_chunks`` per row
(parallel/pipeline_chunks.py). Every row reaches the stages at one static length
(parallel/pipeline_rows.py), from the mode's row capacity: a training mode whose rows are not the
packs (GRPO's prompt + response rows) passes its own :class:`PipelineRows`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torch import nn

from omniweave.parallel.pipeline import Pipeline
from omniweave.parallel.pipeline_split import encoder_cost_in_layers, split_layers


@dataclass(frozen=True)
class PipelineRows:
    max_len: int  # tokens per row at most (before padding)
    per_step: int  # rows (micro-batches) per step and pipeline
    max_docs: int | None  # documents per row at most (None: as many as tokens); sizes CP's padding

    @classmethod
    def of(cls, cfg, dims) -> "PipelineRows":
        """The packs as rows: ``data.max_len`` tokens, ``train.global_batch / dp`` per step."""
        return cls(int(cfg.data.max_len), int(cfg.train.global_batch) // dims.dp,
                   _max_docs(cfg.data.path) if dims.cp > 1 else None)


def build_pipeline(model: nn.Module, cfg, dims, meshes, device, rows: PipelineRows) -> Pipeline:
    """The trainer's pipeline over the built ``model`` (see the module docstring)."""
    from omniweave.config import section, to_dict
    from omniweave.parallel.pipeline_rows import static_row_length, static_rows
    from omniweave.parallel.tp import sequence_parallel_batch
    from omniweave.train.layouts import seq_chunks_of

    par, model_cfg = section(cfg, "parallel"), to_dict(cfg.model)
    pp_layers = par.pp_layers
    cost = None if pp_layers is not None else encoder_cost_in_layers(model_cfg, _patches_per_token(cfg.data.path, model_cfg))
    sizes = split_layers(model.foundation.config.num_layers, dims.pp, par.pp_virtual,
                         None if pp_layers is None else list(pp_layers), first_stage_cost=cost,
                         layer_costs=_layer_costs(model.foundation.config, cfg.data.path) if pp_layers is None else None)
    chunks = seq_chunks_of(cfg)
    length = static_row_length(rows.max_len, dims.cp, dims.tp, rows.max_docs)
    length = -(-length // chunks) * chunks  # parallel.seq_chunks (cp = tp = 1): equal chunks cross the stages
    prepare = partial(static_rows, max_len=rows.max_len, length=length, cp=dims.cp, cp_rank=meshes.cp_rank, tp=dims.tp)
    return Pipeline(model, sizes, meshes.pp.get_group(), device, par.pp_schedule,
                    n_microbatches=rows.per_step, prepare_rows=prepare,
                    row_fn=partial(sequence_parallel_batch, meshes.tp) if dims.tp > 1 else None, seq_chunks=chunks)


def _layer_costs(dec, packed: str) -> list[float] | None:
    """Each decoder layer's cost in average-layer units where layers differ in kind (a hybrid
    model's linear and full-attention layers: cost_model.decoder_layer_costs over the packed
    data's mean sample length); None where every layer is alike (the uniform rule)."""
    from omniweave.parallel.cost_model import decoder_layer_costs

    if dec.layer_types is None or len(set(dec.layer_types)) == 1:
        return None
    doc_len = float((_stats(packed).get("sample_length") or {}).get("mean") or 1.0)
    costs = decoder_layer_costs(dec, doc_len)
    mean = sum(costs) / len(costs)
    return [c / mean for c in costs]


def _stats(packed: str) -> dict:
    return json.loads((Path(packed) / "stats.json").read_text())


def _max_docs(packed: str) -> int | None:
    """The most documents in one pack of the packed data (stats.json; None if it does not say)."""
    most = (_stats(packed).get("docs_per_pack") or {}).get("max")
    return None if most is None else int(most)


def _patches_per_token(packed: str, model_cfg: dict) -> float:
    """Encoder patches per decoder token of the packed data (stats.json: vision tokens, each
    merge² patches, over the packs' capacity tokens); 0 for a model without an image encoder."""
    from omniweave.parallel.cost_model import component_config

    if model_cfg.get("image_encoder") is None:
        return 0.0
    stats = _stats(packed)
    vit = component_config("image_encoder", model_cfg["image_encoder"])  # its registered config dataclass
    proj = component_config("projector", model_cfg.get("projector"))
    # a merging projector's, else the tower's, else 1 (LLaVA-OneVision: a token per patch, give or take its layout)
    merge = getattr(proj, "merge_size", None) or getattr(vit, "spatial_merge_size", None) or 1
    return stats["vision_tokens"] * merge**2 / max(stats["capacity_tokens"], 1)
