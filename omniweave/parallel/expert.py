"""Expert parallelism (``parallel.ep``), applied from outside the model like TP and FSDP.

    apply_ep(model, meshes.ep)                 every MoE layer keeps E/ep experts (contiguous)
    apply_fsdp(..., experts=expert_modules(model), experts_mesh=meshes.expert_dp)
                                               then FSDP shards those over the remaining ranks

The EP group is ``ep`` consecutive ranks of the data x context-parallel mesh (``dims.ParallelDims``):
each holds different tokens, which are sent to the ranks that own their experts and back.
``gate_up_proj`` / ``down_proj`` become DTensors ``Shard(0)`` over the EP mesh: the global shape
stays ``[E, ...]``, so a DCP checkpoint is layout independent (saved at ep=2, loaded at ep=1),
and the gradient norm is taken over the EP group by DTensor.

One MoE layer's expert step (``Experts.dispatch``), rows already sorted by global expert id:

1. the ``[E]`` token counts are exchanged (``all_to_all_single``): rank r receives, from every
   rank of the group, its counts for r's experts; the splits are read on the host;
2. the rows travel with ``all_to_all_single_autograd`` (uneven splits, empty ones included;
   the backward is the reverse exchange), arriving source-rank-major;
3. a stable sort makes them expert-major; the local experts run (``Experts.run``: one
   grouped GEMM or a loop);
4. the rows are put back in source-rank-major order and return by the reverse exchange, in the
   order they were sent; the router weights and the per-token sum stay in ``MoE.forward``.

Gradients: an expert's weight gradient is the sum over the tokens that every rank of the EP
group routed to it (the backward exchange brings them to its owner). The experts are not
sharded with the rest of the model (they differ across the EP group): FSDP shards each layer's
``Experts`` over ``expert_dp``, the ``dp x cp / ep`` ranks holding the same experts (a 2-D
DTensor: FSDP's dim over the EP shard), gathers them around the expert step and SUMs their
gradients over those ranks like every other gradient, so the trainer's division by the global
loss-token count gives the single-rank gradients. With ``ep = dp x cp`` (no replicas) FSDP
leaves them alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omniweave.models.components.moe import MoE
from omniweave.models.components.router_loss import recomputing

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The routed experts (``MoE.experts``) of every MoE layer, in module order."""
    return [m.experts for m in moe_layers(model)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def ep_dispatch(moe: MoE, xs: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """``Experts.dispatch`` under expert parallelism over ``group`` (see the module docstring)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    counts = counts.to(torch.int64)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [ep sources x local experts]
    recv_counts = recv_counts.view(ep, n_local)
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    if not recomputing():  # rows leaving this rank: dispatched now, combined back below
        me = dist.get_rank(group)
        moved = sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me]
        moe.stats.a2a_bytes += moved * xs.shape[1] * xs.element_size()
    recv = all_to_all_single_autograd(xs, recv_splits, send_splits, group)
    # source-rank-major -> expert-major (stable: sources in rank order within an expert)
    expert_of_row = torch.arange(n_local, device=xs.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    perm = expert_of_row.argsort(stable=True)
    ys = moe.experts.run(recv[perm], recv_counts.sum(0), _local(moe.experts.gate_up_proj),
                         _local(moe.experts.down_proj))
    back = ys[perm.argsort()]  # expert-major -> source-rank-major
    return all_to_all_single_autograd(back, send_splits, recv_splits, group)


def apply_ep(model: nn.Module, ep_mesh) -> int:
    """Shard the experts of every MoE layer over ``ep_mesh`` (1-D) and route their computation
    through ``ep_dispatch``. The weights must be identical on every rank (same seed) or on the
    meta device. Returns the number of MoE layers."""
    from torch.distributed.tensor import Shard, distribute_tensor

    layers = moe_layers(model)
    ep = ep_mesh.size()
    group = ep_mesh.get_group()
    for moe in layers:
        if moe.cfg.num_experts % ep:
            raise ValueError(f"parallel.ep={ep} must divide the number of experts ({moe.cfg.num_experts})")
        for name in EXPERT_WEIGHTS:
            p = getattr(moe.experts, name)
            dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(moe.experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        moe.experts.dispatch = _EPDispatch(moe, group)
    return len(layers)


class _EPDispatch:
    """``Experts.dispatch`` of one MoE layer: ``ep_dispatch`` over ``group``. An object rather than a
    closure, so that a copy of the model (a pipeline stage's part, parallel/pipeline_split.slice_model)
    dispatches through its own layer and experts, not the original's."""

    def __init__(self, moe: MoE, group):
        self.moe, self.group = moe, group

    def __call__(self, _experts, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return ep_dispatch(self.moe, xs, counts, self.group)


def sum_over(group=None):
    """A reduce function: a tensor's SUM over ``group`` (None: every rank), as a new tensor."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    return reduce


def set_router_groups(model: nn.Module, fsdp_mesh, cp_mesh) -> None:
    """Where the router losses sum their statistics (components/router_loss.py): a ``global``
    loss over the data x context-parallel ranks of a micro-step (``fsdp_mesh``), a ``sequence``
    loss over the context-parallel shards of a row (``cp_mesh``)."""
    for moe in moe_layers(model):
        for mesh, kind in ((fsdp_mesh, "global"), (cp_mesh, "sequence")):
            if mesh is not None and mesh.size() > 1:
                setattr(moe, f"reduce_{kind}", sum_over(mesh.get_group()))
                setattr(moe, f"{kind}_size", mesh.size())
