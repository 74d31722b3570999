"""ParallelDims: the recipe's ``parallel:`` section resolved against the world size, and its meshes.

    dims = ParallelDims.from_config(cfg.parallel, world_size=8)   # dp=-1 -> 8 // cp
    meshes = dims.build_meshes("cuda")                            # DeviceMesh(["dp", "cp"]) + groups

Ranks are laid out dp-major: rank = dp_index * cp + cp_index, so the ranks of one context-parallel
group are consecutive (on GPUs: the same node, where the sequence exchange is fastest). With
``cp_attention: hybrid`` the CP dimension is itself (ring, ulysses): Ulysses inside each group of
``cp_ulysses`` consecutive ranks, ring across those groups.

FSDP shards over the flattened (dp, cp) mesh: the CP ranks of a DP group hold the same packs but
different tokens, so for the gradients they are just more data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

    @classmethod
    def from_config(cls, parallel: Any, world_size: int) -> "ParallelDims":
        get = (lambda k, d: parallel.get(k, d)) if parallel is not None else (lambda k, d: d)
        dp, cp, tp = int(get("dp", -1)), int(get("cp", 1)), int(get("tp", 1))
        if cp < 1 or tp < 1:
            raise ValueError(f"parallel.cp={cp} and parallel.tp={tp} must be >= 1")
        if dp == -1:
            if world_size % (cp * tp):
                raise ValueError(f"world size {world_size} is not divisible by cp*tp = {cp * tp}")
            dp = world_size // (cp * tp)
        if dp < 1 or dp * cp * tp != world_size:
            raise ValueError(f"parallel dp={dp} x cp={cp} x tp={tp} = {dp * cp * tp} != world size {world_size} "
                             "(set parallel.dp=-1 to use all remaining ranks)")
        if tp != 1:
            raise NotImplementedError(f"parallel.tp={tp}: set tensor parallelism per component "
                                      "(model.foundation.tp, model.image_encoder.tp)")
        mode = str(get("cp_attention", "ring"))
        if mode not in CP_ATTENTION:
            raise ValueError(f"parallel.cp_attention={mode!r}; choose one of {', '.join(CP_ATTENTION)}")
        uly = int(get("cp_ulysses", 1) or 1)
        if mode == "hybrid" and cp > 1 and not (1 < uly < cp and cp % uly == 0):
            raise ValueError(f"parallel.cp_attention=hybrid needs parallel.cp_ulysses (the Ulysses group size) "
                             f"strictly between 1 and cp={cp} and dividing it; got {uly}")
        return cls(dp=dp, cp=cp, tp=tp, world_size=world_size, cp_attention=mode,
                   cp_ulysses=uly if mode == "hybrid" else 1, vision_split=bool(get("vision_split", True)))

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards over (and gradients are averaged over): dp x cp."""
        return self.dp * self.cp

    def build_meshes(self, device_type: str) -> "Meshes":
        """All meshes and groups of the run (the process group must be initialised)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.cp_attention == "hybrid" and self.cp > 1:
            u = self.cp_ulysses
            mesh = init_device_mesh(device_type, (self.dp, self.cp // u, u), mesh_dim_names=("dp", "cp_ring", "cp_ulysses"))
            cp_mesh = mesh["cp_ring", "cp_ulysses"]._flatten("cp")
            fsdp = mesh["dp", "cp_ring", "cp_ulysses"]._flatten("dp_cp")
            ring, uly = mesh["cp_ring"].get_group(), mesh["cp_ulysses"].get_group()
        else:
            mesh = init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            cp_mesh = mesh["cp"]
            fsdp = mesh["dp", "cp"]._flatten("dp_cp") if self.cp > 1 else mesh["dp"]
            ring = uly = None
        return Meshes(world=mesh, fsdp=fsdp, cp=cp_mesh, dp_rank=mesh["dp"].get_local_rank(),
                      cp_rank=cp_mesh.get_local_rank(), ring_group=ring, ulysses_group=uly)


@dataclass
class Meshes:
    world: Any  # DeviceMesh over every rank
    fsdp: Any  # the 1-D mesh FSDP shards over (dp, or flattened dp x cp)
    cp: Any  # 1-D mesh of this rank's CP group
    dp_rank: int
    cp_rank: int
    ring_group: Any = None  # hybrid only
    ulysses_group: Any = None  # hybrid only
