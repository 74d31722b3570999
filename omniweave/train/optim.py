"""AdamW with decoupled weight decay; norms, biases and other 1-D parameters get no decay."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into (decay, no-decay); frozen components are left out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_norm = "norm" in name.lower() or name.endswith(".bias") or p.ndim < 2
        (no_decay if is_norm else decay).append(p)
    if not decay and not no_decay:
        raise ValueError("no trainable parameters: every component is frozen")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, train_cfg) -> torch.optim.Optimizer:
    betas = tuple(train_cfg.get("betas", (0.9, 0.95)))
    return torch.optim.AdamW(
        param_groups(model, float(train_cfg.get("weight_decay", 0.0))),
        lr=float(train_cfg.lr), betas=betas, eps=float(train_cfg.get("eps", 1e-8)),
        foreach=True,
    )


def _full(norm) -> torch.Tensor:
    """A DTensor norm reduced over its mesh. Offloaded gradients (``train.offload``) are host
    tensors on an accelerator's mesh, whose collectives want device tensors: reduce a copy there."""
    from torch.distributed.tensor import DTensor

    local, mesh = norm.to_local(), norm.device_mesh
    if local.device.type != mesh.device_type:
        norm = DTensor.from_local(local.to(mesh.device_type), mesh, norm.placements, run_check=False)
    return norm.full_tensor()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, group=None) -> float:
    """Global L2 norm of the gradients (clipped to ``max_norm`` when > 0), for parameters that may
    live on different device meshes (per-component tensor / data parallelism): the norm of each
    mesh's gradients is computed by DTensor, the squares are summed, then every group is scaled.
    ``group``: ranks holding different parameters (pipeline stages), whose squares are summed too."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = getattr(p.grad, "device_mesh", None)
            groups.setdefault(id(mesh) if mesh is not None else None, []).append(p)
    squares = []
    for ps in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=True)
        squares.append((_full(norm) if hasattr(norm, "full_tensor") else norm).double() ** 2)
    total = torch.stack([sq.to(squares[0].device) for sq in squares]).sum() if squares else torch.zeros(
        (), dtype=torch.float64)
    if group is not None:
        dist.all_reduce(total, group=group)
    total = total.sqrt()
    if max_norm > 0:
        for ps in groups.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total.to(ps[0].grad.device, ps[0].grad.dtype),
                                                 foreach=True)  # fmt: skip
    return float(total)
