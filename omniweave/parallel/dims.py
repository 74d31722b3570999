"""ParallelDims: the recipe's ``parallel:`` section resolved against the world size, and its mesh.

    dims = ParallelDims.from_config(cfg.parallel, world_size=8)   # dp=-1 -> 8
    mesh = dims.build_mesh("cuda")                                # DeviceMesh(["dp"])

Only data parallelism is laid out in this version; ``cp`` and ``tp`` must be 1 (context and
tensor parallelism arrive with their own issues) and a recipe asking for more fails here with
that message rather than silently training something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    cp: int
    tp: int
    world_size: int

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
        if cp != 1 or tp != 1:
            raise NotImplementedError(
                f"parallel.cp={cp}, parallel.tp={tp}: this version trains data-parallel only (cp=1, tp=1)")
        return cls(dp=dp, cp=cp, tp=tp, world_size=world_size)

    def build_mesh(self, device_type: str):
        """A 1-D ``dp`` DeviceMesh over all ranks (the process group must be initialised)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp,), mesh_dim_names=("dp",))
