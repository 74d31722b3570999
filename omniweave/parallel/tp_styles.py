"""Three ParallelStyles that torch's Colwise / Rowwise / SequenceParallel do not cover.

``FusedHeadsParallel(parts, head_dim)`` — a Linear whose output is ``parts`` blocks of heads
side by side, e.g. the ViT's fused ``qkv`` (weight ``[3·D, D]``, output viewed as
``(P, 3, H, Dh)``). ``ColwiseParallel`` would give rank r the contiguous rows
``[r·3D/tp, (r+1)·3D/tp)``, a mix of q, k and v; a strided placement
(``_StridedShard(0, split_factor=3)``) computes right, but its rank pieces are three boxes of
the weight and DCP (torch 2.13) refuses them ("overlapping chunks"), for the weights and for the
optimizer states alike. So the weight is sharded over its *input* dim (``Shard(1)``, one box per
rank; bias ``Replicate``), as in a row-wise Linear, and the heads are split on the output::

    x [P, D] (replicated) -> local columns x[:, r·D/tp : (r+1)·D/tp]           (no comm)
    partial [P, 3D] = x_local @ weight_local.T (+ bias once)                 (Partial)
    view (P, 3, H, Dh) -> reduce-scatter over the head axis -> [P, 3, H/tp, Dh]  (Shard(2))
    local output [P, 3·H/tp·Dh]: this rank's heads' q, k and v

Parameter names and full tensors stay exactly the unsharded ones (``state_dict``, DCP, HF
export). Cost against an ideal column-wise split: the matmul is still 1/tp per rank, but the
forward reduce-scatters [P, 3D] and the backward all-gathers it and the input gradient [P, D].

``ReplicatedKVHeads(num_kv_heads, head_dim)`` — ``k_proj`` / ``v_proj`` when tp exceeds the
number of KV heads (``tp % num_kv_heads == 0``): the projection stays replicated (``Replicate``
weight), its output ``[L, Hkv·Dh]`` is expanded to one KV head per rank ``[L, tp, Dh]`` (KV head
``j`` copied ``tp / Hkv`` times, so rank r gets head ``r // (tp / Hkv)``, the one its query
heads ``[r·H/tp, (r+1)·H/tp)`` belong to) and sharded over that axis: each rank keeps
``[L, Dh]``. The backward all-gathers the per-rank gradients and sums the copies, so the
replicated weight's gradient is complete and equal on every rank.

``ShardedRMSNorm()`` — an RMSNorm over a dim that tp shards: Wan's q / k norms run over all
heads together (``inner_dim``), after the column-wise projections left each rank its heads. The
weight is ``Shard(0)``; each rank squares and sums its slice, one all-reduce gives the row's sum
(its backward all-reduces the gradient, every rank's heads using it), and each rank scales its
slice by its part of the weight::

    x [L, D/tp] (local) -> Σ x² over the slice -> all-reduce -> x · rsqrt(Σ / D + eps) · w[r·D/tp : …]
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def _distribute_params(module: nn.Module, mesh, placement_of, src_data_rank) -> None:
    """Replace each direct parameter by a DTensor with placement ``placement_of(name)``."""
    for pname, param in module.named_parameters(recurse=False):
        placed = distribute_tensor(param, mesh, [placement_of(pname)], src_data_rank=src_data_rank)
        module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))


def _as_dtensor(x, mesh) -> DTensor:
    """A module input as a DTensor (a plain tensor is taken as replicated on ``mesh``)."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)


class FusedHeadsParallel(ParallelStyle):
    """A Linear of ``parts`` fused head blocks; the module returns its local output
    ``[..., parts·(H/tp)·Dh]`` (this rank's heads of each part, in part order)."""

    def __init__(self, parts: int, head_dim: int):
        super().__init__()
        self.parts, self.head_dim = parts, head_dim

    def _partition(self, name, module, mesh):
        _distribute_params(module, mesh, lambda pname: Shard(1) if pname == "weight" else Replicate(),
                           self.src_data_rank)

    @staticmethod
    def _input_columns(mod, inputs, mesh):
        return _as_dtensor(inputs[0], mesh).redistribute(mesh, [Shard(inputs[0].ndim - 1)])

    def _own_heads(self, mod, out, mesh):  # out: Partial [..., parts·H·Dh]
        lead = tuple(out.shape[:-1])
        heads = out.view(*lead, self.parts, -1, self.head_dim)
        return heads.redistribute(mesh, [Shard(len(lead) + 1)]).to_local().flatten(len(lead))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedHeadsParallel shards an nn.Linear, got {type(module).__name__}")
        heads, tp = module.out_features // (self.parts * self.head_dim), device_mesh.size()
        if heads * self.parts * self.head_dim != module.out_features or heads % tp or module.in_features % tp:
            raise ValueError(f"Linear {module.in_features}->{module.out_features} is not {self.parts} parts of "
                             f"heads of {self.head_dim} with heads and inputs divisible by tp={tp}")  # fmt: skip
        return distribute_module(module, device_mesh, self._partition, self._input_columns, self._own_heads)


class ReplicatedKVHeads(ParallelStyle):
    """A replicated k/v projection whose local output is the one KV head this rank's queries use."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def _replicate(self, name, module, mesh):
        _distribute_params(module, mesh, lambda pname: Replicate(), self.src_data_rank)

    @staticmethod
    def _replicated_input(mod, inputs, mesh):
        return _as_dtensor(inputs[0], mesh).redistribute(mesh, [Replicate()])

    def _own_head(self, mod, out, mesh):  # out: Replicate [L, Hkv·Dh] -> local [L, Dh]
        hkv, hd, copies = self.num_kv_heads, self.head_dim, mesh.size() // self.num_kv_heads
        lead = tuple(out.shape[:-1])
        heads = out.view(*lead, hkv, 1, hd).expand(*lead, hkv, copies, hd).reshape(*lead, hkv * copies, hd)
        return heads.redistribute(mesh, [Shard(len(lead))]).to_local().flatten(-2)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()
        if tp % self.num_kv_heads:
            raise ValueError(f"ReplicatedKVHeads needs tp={tp} to be a multiple of num_kv_heads={self.num_kv_heads}")
        return distribute_module(module, device_mesh, self._replicate, self._replicated_input, self._own_head)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: every rank's output feeds only its
    own shard of what follows, so the input's gradient is the sum of all ranks' contributions."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sharded_rms_norm(module: nn.Module, group, x: torch.Tensor) -> torch.Tensor:
    """``RMSNorm.forward`` on this rank's slice of the normalised dim (the same float32 math)."""
    weight = module.weight.to_local()
    xf = x.float()
    total = _SumOverRanks.apply(xf.pow(2).sum(-1, keepdim=True), group)
    xf = xf * torch.rsqrt(total / module.weight.shape[0] + module.eps)
    return weight * xf.to(x.dtype)


class ShardedRMSNorm(ParallelStyle):
    """An RMSNorm (components/norm.py) whose input is this rank's slice of the normalised dim."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if set(dict(module.named_parameters(recurse=False))) != {"weight"} or not hasattr(module, "eps"):
            raise ValueError(f"ShardedRMSNorm shards an RMSNorm (weight, eps), got {type(module).__name__}")
        if module.weight.shape[0] % device_mesh.size():
            raise ValueError(f"RMSNorm of {module.weight.shape[0]} is not divisible by tp={device_mesh.size()}")
        _distribute_params(module, device_mesh, lambda pname: Shard(0), self.src_data_rank)
        module.forward = partial(_sharded_rms_norm, module, device_mesh.get_group())
        return module
