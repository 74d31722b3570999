"""ParallelDims: the recipe's ``parallel:`` section resolved against the world size, and its meshes.

    dims = ParallelDims.from_config(cfg.parallel, world_size=8, model=cfg.model)   # dp=-1 -> 8 // (cp * tp)
    meshes = dims.build_meshes("cuda")                                          # DeviceMesh + groups

Mesh dims, outermost first: ``pp`` (pipeline stages, parallel/pipeline.py: each (dp, cp, tp)
coordinate has its own pipeline of pp ranks, whose stages' parts FSDP shards over the dp x cp
ranks holding the same stages), ``dp``, ``cp`` (or ``cp_ring`` x ``cp_ulysses`` with hybrid CP
attention: Ulysses inside each group of ``cp_ulysses`` consecutive ranks, ring across them),
``tp_rep`` x ``tp_enc``. Tensor parallelism is per component (``model.foundation.tp``,
``model.image_encoder.tp`` = ``model.audio_encoder.tp``: the encoders share one): the foundation is
sharded over the whole tp group (``tp_rep`` x ``tp_enc``), the encoders over ``tp_enc`` = their own, smaller, tp; over ``tp_rep`` the
encoder's ranks act as extra data parallelism for encoding (each encodes a share of the media).
TP is innermost (fastest links), then CP (the sequence exchange), then DP.

FSDP shards the foundation over the flattened (dp, cp) mesh (the CP ranks of a DP group hold the
same packs but different tokens: for the gradients they are just more data-parallel ranks) and
the encoder + projector over (dp, cp, tp_rep).

HSDP, for several nodes (``parallel.dp_replicate`` x ``parallel.dp_shard``, as torchtitan names
them): dp = dp_replicate x dp_shard with ``dp_replicate`` outer, so with a node's ranks
consecutive (torchrun numbers them so) each replica's ranks sit on as few nodes as possible. FSDP
then shards over (dp_shard, cp) and replicates over ``dp_replicate``: the all-gathers and
reduce-scatters stay inside a replica, only the gradients' all-reduce crosses replicas. The
loader, the loss normaliser and every statistic still see dp ranks (``Meshes.dp_cp``: all of
them); only the weights' placement changes.

Expert parallelism (``parallel.ep``, parallel/expert.py): the experts of every MoE layer are split
over ``ep`` consecutive ranks of the flattened (dp, cp) mesh, the ranks FSDP shards the foundation
over (each holds different tokens: other rows, or other shards of a row), so dp x cp = dp x cp /
ep x ep with ``ep`` inner; the ranks holding the same experts (``expert_dp``, dp x cp / ep of
them) sum the expert gradients. Under a tp foundation every tp rank routes the whole row (MoE
layers are not tensor-parallel, parallel/tp.py), so the EP groups are formed per tp rank; under
``pp`` per stage too (the ranks of an EP group hold the same layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniweave.models.registry import MODALITIES

CP_ATTENTION = ("ring", "allgather", "ulysses", "hybrid")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    cp: int
    tp: int
    world_size: int
    cp_attention: str = "ring"
    cp_ulysses: int = 1  # hybrid: Ulysses group size (inner), ring across cp / cp_ulysses groups
    vision_split: bool = True  # CP ranks share the vision encoder's work (else each encodes all media)
    tp_encoder: int = 1  # model.image_encoder.tp (= model.audio_encoder.tp: one for all encoders); divides tp
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep data-parallel ranks
    pp: int = 1  # pipeline stages (ranks), the outermost mesh dim (parallel/pipeline.py)
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard; FSDP shards within a replica, replicates across

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @classmethod
    def from_config(cls, parallel: Any, world_size: int, model: Any = None) -> "ParallelDims":
        from omniweave.config import section
        from omniweave.models.registry import common_config

        if parallel is not None and "tp" in parallel and parallel["tp"] != 1:  # not a schema key: an older recipe
            raise NotImplementedError(f"parallel.tp={parallel['tp']}: set tensor parallelism per component "
                                      "(model.foundation.tp, model.image_encoder.tp)")
        par = section({"parallel": parallel}, "parallel")  # typed: the schema's defaults for what it lacks
        comp = (lambda c: common_config(model.get(c)).tp) if model is not None else (lambda c: 1)
        encoders = [m.encoder for m in MODALITIES if model is not None and model.get(m.encoder) is not None]
        encoder_tp = {e: int(comp(e)) for e in encoders}
        if len(set(encoder_tp.values())) > 1:
            raise ValueError("the encoders share one tp group: set the same tp for each "
                             f"({', '.join(f'model.{e}.tp={t}' for e, t in encoder_tp.items())})")
        trunk = "generator" if model is not None and model.get("generator") is not None else "foundation"
        dp, cp, tp, pp = par.dp, par.cp, int(comp(trunk)), par.pp
        tp_enc, enc_key = next(iter(encoder_tp.values()), 1), f"model.{encoders[0] if encoders else 'image_encoder'}.tp"
        if cp < 1 or tp < 1 or tp_enc < 1:
            raise ValueError(f"parallel.cp={cp}, model.foundation.tp={tp}, {enc_key}={tp_enc} must be >= 1")
        if tp % tp_enc:
            raise ValueError(f"{enc_key}={tp_enc} must divide model.foundation.tp={tp} "
                             "(the encoder's tp group sits inside the foundation's)")
        if pp < 1:
            raise ValueError(f"parallel.pp={pp} must be >= 1")
        pp_names = ("pp*", f"pp={pp} x ") if pp > 1 else ("", "")
        factors = dp == -1 and par.dp_shard != -1  # HSDP given by its two factors
        if factors:
            dp = par.dp_replicate * par.dp_shard
        if dp == -1:
            if world_size % (pp * cp * tp):
                raise ValueError(f"world size {world_size} is not divisible by {pp_names[0]}cp*tp = {pp * cp * tp}")
            dp = world_size // (pp * cp * tp)
        if dp < 1 or pp * dp * cp * tp != world_size:
            dp_name = f"(dp_replicate={par.dp_replicate} x dp_shard={par.dp_shard})" if factors else ""
            raise ValueError(f"parallel {pp_names[1]}dp={dp}{dp_name} x cp={cp} x tp={tp} = {pp * dp * cp * tp} != world size "
                             f"{world_size} (set parallel.dp=-1 to use all remaining ranks)")
        mode = par.cp_attention
        if mode not in CP_ATTENTION:
            raise ValueError(f"parallel.cp_attention={mode!r}; choose one of {', '.join(CP_ATTENTION)}")
        uly = par.cp_ulysses
        if mode == "hybrid" and cp > 1 and not (1 < uly < cp and cp % uly == 0):
            raise ValueError(f"parallel.cp_attention=hybrid needs parallel.cp_ulysses (the Ulysses group size) "
                             f"strictly between 1 and cp={cp} and dividing it; got {uly}")
        dp_replicate = resolve_hsdp(dp, par.dp_replicate, par.dp_shard)
        ep = par.ep
        if ep != 1:
            check_ep(ep, dp, cp, (model.get("foundation") or {}) if model is not None else {})
        if pp > 1:
            check_pp(par, pp, dp, cp, tp, ep, model)
        return cls(dp=dp, cp=cp, tp=tp, world_size=world_size, cp_attention=mode,
                   cp_ulysses=uly if mode == "hybrid" else 1, vision_split=par.vision_split,
                   tp_encoder=tp_enc, ep=ep, pp=pp, dp_replicate=dp_replicate)

    @property
    def shard_ranks(self) -> int:
        """Ranks the foundation's FSDP shards over: dp x cp."""
        return self.dp * self.cp

    def build_meshes(self, device_type: str) -> "Meshes":
        """All meshes and groups of the run (the process group must be initialised)."""
        from torch.distributed.device_mesh import init_device_mesh

        hybrid = self.cp_attention == "hybrid" and self.cp > 1
        cp_dims = [("cp_ring", self.cp // self.cp_ulysses), ("cp_ulysses", self.cp_ulysses)] if hybrid else [("cp", self.cp)]
        named = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), *cp_dims,
                 ("tp_rep", self.tp // self.tp_encoder), ("tp_enc", self.tp_encoder)]
        mesh = init_device_mesh(device_type, tuple(n for _, n in named), mesh_dim_names=tuple(k for k, _ in named))
        cp_names = tuple(k for k, _ in cp_dims)

        def flat(names: tuple[str, ...], name: str):
            return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten(name)

        def hsdp(flat_mesh, name: str):
            """FSDP's mesh over a flattened (dp_replicate, dp_shard, ...) mesh: itself, or under HSDP
            (replicate, shard), dp_replicate being the outermost of the flattened dims."""
            if self.dp_replicate == 1:
                return flat_mesh
            return flat_mesh._unflatten(0, (self.dp_replicate, flat_mesh.size() // self.dp_replicate),
                                        (f"{name}_replicate", f"{name}_shard"))

        cp_mesh = flat(cp_names, "cp") if hybrid else mesh["cp"]
        dp_mesh = flat(("dp_replicate", "dp_shard"), "dp")
        ep_mesh = expert_dp = None
        if self.ep > 1:  # the world as (pp, dp x cp / ep, ep, tp): each stage and tp rank has its own EP groups
            ep_world = init_device_mesh(device_type, (self.pp, self.dp * self.cp // self.ep, self.ep, self.tp),
                                        mesh_dim_names=("ep_pp", "expert_dp", "ep", "ep_tp"))
            ep_mesh, expert_dp = ep_world["ep"], ep_world["expert_dp"]
            if (self.dp_shard * self.cp) % self.ep == 0:  # EP groups inside a replica: experts HSDP-sharded too
                expert_dp = hsdp(expert_dp, "experts")
        split = (*cp_names, "tp_rep") if self.vision_split else ("tp_rep",)
        split_size = (self.cp if self.vision_split else 1) * (self.tp // self.tp_encoder)
        dp_cp = flat(("dp_replicate", "dp_shard", *cp_names), "dp_cp")
        encoder_dp = flat(("dp_replicate", "dp_shard", *cp_names, "tp_rep"), "dp_cp_tprep")
        return Meshes(
            world=mesh, dp_cp=dp_cp, fsdp=hsdp(dp_cp, "fsdp"), cp=cp_mesh, tp=flat(("tp_rep", "tp_enc"), "tp"),
            tp_encoder=mesh["tp_enc"], encoder_fsdp=hsdp(encoder_dp, "encoder_fsdp"),
            vision_split=flat(split, "vision_split") if split_size > 1 else None,
            dp_rank=dp_mesh.get_local_rank(), cp_rank=cp_mesh.get_local_rank(),
            ring_group=mesh["cp_ring"].get_group() if hybrid else None,
            ulysses_group=mesh["cp_ulysses"].get_group() if hybrid else None,
            ep=ep_mesh, expert_dp=expert_dp, pp=mesh["pp"],
        )


def resolve_hsdp(dp: int, dp_replicate: int, dp_shard: int) -> int:
    """``parallel.dp_replicate`` (and ``dp_shard``, -1: dp / dp_replicate) against the resolved dp;
    returns dp_replicate (errors name the keys)."""
    if dp_replicate < 1 or dp % dp_replicate:
        raise ValueError(f"parallel.dp_replicate={dp_replicate} must be >= 1 and divide the data-parallel size "
                         f"dp={dp} (HSDP: dp = dp_replicate x dp_shard)")
    if dp_shard != -1 and dp_replicate * dp_shard != dp:
        raise ValueError(f"parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard} = "
                         f"{dp_replicate * dp_shard} != the data-parallel size dp={dp} (set parallel.dp_shard=-1 "
                         "to take dp / dp_replicate)")
    return dp_replicate


def check_ep(ep: int, dp: int, cp: int, foundation: Any) -> None:
    """``parallel.ep`` against the layout and the foundation's MoE layers (errors name the keys)."""
    if ep < 1:
        raise ValueError(f"parallel.ep={ep} must be >= 1")
    if (dp * cp) % ep:
        raise ValueError(f"parallel.ep={ep} must divide parallel.dp x parallel.cp = {dp} x {cp} "
                         "(an EP group is ep of the data- and context-parallel ranks)")
    from omniweave.models.components.decoder import decoder_fields, moe_layer_indices

    experts = decoder_fields(foundation)["num_experts"]
    if not moe_layer_indices(foundation):
        raise ValueError(f"parallel.ep={ep}: the foundation has no MoE layers (model.foundation.num_experts="
                         f"{experts}); expert parallelism needs a Mixture-of-Experts model")
    if experts % ep:
        raise ValueError(f"parallel.ep={ep} must divide model.foundation.num_experts={experts} "
                         "(each EP rank holds num_experts / ep experts)")


def check_pp(parallel: Any, pp: int, dp: int, cp: int, tp: int, ep: int, model: Any) -> None:
    """``parallel.pp`` and its keys against the layout and the foundation (errors name the keys);
    ``parallel``: the typed section (config.section)."""
    from omniweave.parallel.pipeline import check_schedule
    from omniweave.parallel.pipeline_split import split_layers

    schedule, virtual = parallel.pp_schedule, parallel.pp_virtual
    check_schedule(schedule, virtual)
    if schedule == "zero_bubble" and dp * cp * tp > 1:  # torch 2.13: KeyError in its split weight backward
        raise ValueError(f"parallel.pp_schedule=zero_bubble runs on pipeline ranks only (parallel.pp = the world "
                         f"size): its split weight-gradient backward does not see FSDP2's sharded parameters, "
                         f"which dp x cp x tp = {dp} x {cp} x {tp} ranks use; choose interleaved_1f1b")
    if model is not None:
        layers = int(model["foundation"]["num_layers"])  # a required field of DecoderConfig
        pp_layers = parallel.pp_layers
        split_layers(layers, pp, virtual, None if pp_layers is None else list(pp_layers))


@dataclass
class Meshes:
    world: Any  # DeviceMesh over every rank (dims above)
    dp_cp: Any  # 1-D mesh of every dp x cp rank (a tp and pp coordinate's): sums of statistics
    fsdp: Any  # the mesh the foundation's FSDP shards over: dp_cp, or 2-D (dp_replicate, dp_shard x cp) under HSDP
    cp: Any  # 1-D mesh of this rank's CP group
    tp: Any  # 1-D mesh of the foundation's tp group (tp_rep x tp_enc)
    tp_encoder: Any  # 1-D mesh of the encoder's tp group
    encoder_fsdp: Any  # the encoder + projector's FSDP mesh: (dp, cp, tp_rep) flattened (2-D under HSDP)
    vision_split: Any  # 1-D mesh whose ranks share the media of a row (None: each rank encodes all)
    dp_rank: int
    cp_rank: int
    ring_group: Any = None  # hybrid only
    ulysses_group: Any = None  # hybrid only
    ep: Any = None  # ep > 1: 1-D mesh of this rank's EP group (ep consecutive dp x cp ranks)
    expert_dp: Any = None  # ep > 1: mesh of the dp x cp / ep ranks holding the same experts (2-D under HSDP)
    pp: Any = None  # 1-D mesh of this rank's pipeline (its ranks hold stages r, r + pp, ...)
