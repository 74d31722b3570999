"""Tensor parallelism of a Gated DeltaNet layer (components/linear_attention.py): each tp rank runs
its share of the key and value heads, like attention's heads, and its share of the convolution's
channels.

    x [L/tp, H] (sequence shard) -> all-gather -> x [L, H]                        (linear_attn's input)
    in_proj_qkv  column-wise: contiguous channels [r·C/tp, (r+1)·C/tp) of [q | k | v]
    conv1d       its weight Shard(0): the same channels, so the depthwise convolution is local
    heads        the channels all-gathered and this rank's q, k and v heads kept (``tp_heads``)
    in_proj_z / b / a, A_log, dt_bias   column-wise / Shard(0): this rank's value heads
    norm.weight  replicated (every head uses it); its gradient summed over the tp ranks
    out_proj     row-wise, reduce-scattered back to the sequence shard

A column-wise split of ``in_proj_qkv`` gives rank r a contiguous run of [q | k | v] — not its
heads, which sit in three sections — but the convolution is per channel, so it runs on that run
with the matching rows of its weight; only then are the channels regrouped into heads (an
all-gather of [L, C] per layer, its backward a reduce-scatter). Every weight keeps its full name
and shape (``state_dict``, DCP, HF export). The module uses ``conv1d.weight``, ``A_log``,
``dt_bias`` and ``norm.weight`` in its own arithmetic, so :class:`LocalParams` hands it the local
tensors for the duration of its forward (a pre-hook swaps them in, a hook swaps the DTensors
back); a replicated one's local tensor passes its gradient back as ``Partial``, summed over the
ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from omniweave.parallel.tp_styles import _distribute_params


class LocalParams(ParallelStyle):
    """Distribute ``placements`` (parameter path under the module -> Shard(0) or Replicate) and let
    the module's forward see their local tensors (see the module docstring)."""

    def __init__(self, placements: dict[str, object]):
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        owners = {}
        for path, placement in self.placements.items():
            owner_path, _, name = path.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            owners.setdefault(id(owner), (owner, {}))[1][name] = placement
        for owner, names in owners.values():
            _distribute_params(owner, device_mesh, lambda n, names=names: names.get(n, Replicate()), self.src_data_rank)
        swapped: list = []

        def to_local(mod, args):
            for owner, names in owners.values():
                for name, placement in names.items():
                    p = owner._parameters[name]
                    grad = [Partial()] if isinstance(placement, Replicate) else None
                    swapped.append((owner, name, p))
                    owner._parameters[name] = p.to_local(grad_placements=grad) if isinstance(p, DTensor) else p

        def back(mod, args, out):
            while swapped:
                owner, name, p = swapped.pop()
                owner._parameters[name] = p

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(back)
        return module


class HeadsFromChannels:
    """``GatedDeltaNet.tp_heads``: this rank's contiguous channels of [q | k | v] after the
    convolution [L, C/tp] -> its own q, k and v heads [L, (2·key_dim + value_dim) / tp]."""

    def __init__(self, mesh, key_dim: int, value_dim: int):
        self.mesh, self.key_dim, self.value_dim = mesh, key_dim, value_dim

    def __call__(self, mixed: torch.Tensor) -> torch.Tensor:
        tp, r = self.mesh.size(), self.mesh.get_local_rank()
        full = DTensor.from_local(mixed, self.mesh, [Shard(1)], run_check=False)
        full = full.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        kd, vd = self.key_dim // tp, self.value_dim // tp
        q, k, v = full.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return torch.cat([q[:, r * kd:(r + 1) * kd], k[:, r * kd:(r + 1) * kd], v[:, r * vd:(r + 1) * vd]], -1)


def linear_layer_plan() -> dict:
    """A linear-attention decoder layer's ``parallelize_module`` plan (under ``layers.N.``)."""
    return {
        # GatedDeltaNet.forward(x, cu_seqlens): gather x over the sequence
        "linear_attn": PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)),
        "linear_attn.in_proj_qkv": ColwiseParallel(),
        "linear_attn.in_proj_z": ColwiseParallel(),
        "linear_attn.in_proj_b": ColwiseParallel(),
        "linear_attn.in_proj_a": ColwiseParallel(),
        "linear_attn.out_proj": RowwiseParallel(output_layouts=Shard(0)),
    }


def apply_linear_tp(decoder: nn.Module, mesh) -> None:
    """The parts of the linear layers the plan cannot express: their own parameters, and the
    channel -> head regrouping after the convolution (after ``parallelize_module``)."""
    for layer in decoder.layers:
        if not layer.linear:
            continue
        mixer = layer.linear_attn
        LocalParams({"conv1d.weight": Shard(0), "A_log": Shard(0), "dt_bias": Shard(0),
                     "norm.weight": Replicate()})._apply(mixer, mesh)  # fmt: skip
        mixer.tp_heads = HeadsFromChannels(mesh, mixer.cfg.key_dim, mixer.cfg.value_dim)


__all__ = ["HeadsFromChannels", "LocalParams", "apply_linear_tp", "linear_layer_plan"]
