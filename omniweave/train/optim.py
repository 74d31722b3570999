"""AdamW with decoupled weight decay; norms, biases and other 1-D parameters get no decay.

Per-component optimisation (``model.<component>.lr`` / ``lr_scale`` / ``weight_decay``, e.g. a
slower vision tower): once any component sets one, every component's parameters get groups of
their own (decay / no-decay), each with its component's learning rate (``lr``, or ``lr_scale`` ×
``train.lr``, or ``train.lr``) and weight decay; the schedule scales every group's rate by the
same factor. A parameter's component is the model section whose module holds it (the first part
of its name, LoRA adapters included: they live inside the module they adapt).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omniweave.errors import UserError

OPTIM_KEYS = ("lr", "lr_scale", "weight_decay")  # model.<component>.<key>


def component_settings(model_cfg: dict) -> dict[str, dict]:
    """``{component: {key: value}}`` of the per-component optimisation keys the recipe sets
    (``model_cfg``: the recipe's model section as a dict), checked: one-line errors naming keys."""
    out = {}
    for name, sec in model_cfg.items():
        if not isinstance(sec, dict):
            continue
        given = {k: sec[k] for k in OPTIM_KEYS if sec.get(k) is not None}
        for k, v in given.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise UserError(f"model.{name}.{k}={v!r}: a number >= 0")
        if "lr" in given and "lr_scale" in given:
            raise UserError(f"model.{name}.lr and model.{name}.lr_scale both set: give one (lr_scale is relative "
                            "to train.lr)")
        if given:
            out[name] = given
    return out


def _decays(name: str, p: torch.Tensor) -> bool:
    return not ("norm" in name.lower() or name.endswith(".bias") or p.ndim < 2)


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 components: dict[str, dict] | None = None) -> list[dict]:
    """Trainable parameters split into (decay, no-decay); frozen components are left out. With
    ``components`` (:func:`component_settings`, non-empty) one (decay, no-decay) pair per
    component, in the order the model holds them, each group naming its ``component`` and
    carrying its ``lr`` (``train.lr`` = ``lr`` unless the component sets its own) and weight decay."""
    groups: dict[tuple[str, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = _decays(name, p)
        if not components:
            key = ("all", decay)
            group = groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0})
        else:
            part = name.split(".", 1)[0]
            own = components.get(part, {})
            rate = own.get("lr", lr * float(own.get("lr_scale", 1.0)))
            wd = float(own.get("weight_decay", weight_decay)) if decay else 0.0
            group = groups.setdefault((part, decay), {"params": [], "weight_decay": wd, "lr": float(rate),
                                                      "component": part})
        group["params"].append(p)
    if not groups:
        raise ValueError("no trainable parameters: every component is frozen")
    if not components:  # (decay, no-decay), as before per-component groups existed
        return [groups[k] for k in (("all", True), ("all", False)) if k in groups]
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` from the recipe (``train.*``, ``model.<component>.*``)."""
    from omniweave.config import section, to_dict

    tc = section(cfg, "train")
    return torch.optim.AdamW(
        param_groups(model, float(tc.weight_decay), float(tc.lr), component_settings(to_dict(cfg.model))),
        lr=float(tc.lr), betas=tuple(tc.betas), eps=float(tc.eps), foreach=True,
    )


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``{"lr/<component>": rate}`` of per-component groups (empty without them): the log's rates."""
    return {f"lr/{g['component']}": g["lr"] for g in optimizer.param_groups if "component" in g}


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
