"""AdamW with decoupled weight decay; norms, biases and other 1-D parameters get no decay.

Per-component optimisation (``model.<component>.lr`` / ``lr_scale`` / ``weight_decay``, e.g. a
slower vision tower): once any component sets one, every component's parameters get groups of
their own (decay / no-decay), each with its component's learning rate (``lr``, or ``lr_scale`` ×
``train.lr``, or ``train.lr``) and weight decay; the schedule scales every group's rate by the
same factor. A parameter's component is the model section whose module holds it
(registry.component_modules, the mapping LoRA adds adapters by: adapters are their component's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omniweave.errors import UserError

OPTIM_KEYS = ("lr", "lr_scale", "weight_decay")  # model.<component>.<key>
GROUP_NAME = "component"  # the key naming a per-component group's section (checkpoint.py, the log)


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


def _owners(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> section`` of the component module holding each parameter."""
    from omniweave.models.registry import component_modules

    return {id(p): section for section, module in component_modules(model).items() for p in module.parameters()}


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 components: dict[str, dict] | None = None) -> list[dict]:
    """Trainable parameters split into (decay, no-decay); frozen components are left out. With
    ``components`` (:func:`component_settings`, non-empty) one (decay, no-decay) pair per
    component, in the order the model holds them, each group naming its ``component`` and
    carrying its ``lr`` (``train.lr`` = ``lr`` unless the component sets its own) and weight decay."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: every component is frozen")
    if not components:  # (decay, no-decay), as before per-component groups existed
        pair = {True: {"params": [], "weight_decay": weight_decay}, False: {"params": [], "weight_decay": 0.0}}
        for name, p in trainable:
            pair[_decays(name, p)]["params"].append(p)
        return [g for g in pair.values() if g["params"]]
    from omniweave.models.registry import common_config

    owners, groups = _owners(model), {}
    for name, p in trainable:
        part = owners.get(id(p))
        if part is None:
            raise ValueError(f"parameter {name}: no model component holds it, so no model.<component>.lr applies")
        own, decay = common_config(components.get(part)), _decays(name, p)  # registry.CommonConfig's defaults
        rate = own.lr if own.lr is not None else lr * float(own.lr_scale)
        wd = float(own.weight_decay if own.weight_decay is not None else weight_decay) if decay else 0.0
        group = groups.setdefault((part, decay), {"params": [], "weight_decay": wd, "lr": float(rate), GROUP_NAME: part})
        group["params"].append(p)
    return list(groups.values())


def _groups_of(model: nn.Module, tc, model_cfg: dict) -> list[dict]:
    """:func:`param_groups` of the recipe's train section ``tc`` (typed: config.section) and model
    section ``model_cfg`` (a dict)."""
    return param_groups(model, float(tc.weight_decay), float(tc.lr), component_settings(model_cfg))


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` from the recipe (``train.*``, ``model.<component>.*``)."""
    from omniweave.config import section, to_dict

    tc = section(cfg, "train")
    return torch.optim.AdamW(_groups_of(model, tc, to_dict(cfg.model)), lr=float(tc.lr), betas=tuple(tc.betas),
                             eps=float(tc.eps), foreach=True)


def apply_recipe(optimizer: torch.optim.Optimizer, scheduler, model: nn.Module, train_cfg, model_cfg: dict) -> None:
    """The recipe's rates, decays and AdamW hyperparameters on a restored optimizer and its LambdaLR
    (a resume may change them: resume_keys.py); ``train_cfg``: the typed train section
    (config.section), ``model_cfg``: the model section as a dict. Each group's rate at the current
    step is its own base rate (``train.lr``, or its component's) × the schedule's factor there,
    which is what the scheduler computes when it steps (``base_lrs`` × factor), so an unchanged
    recipe resumes bit-identically; a group's ``component`` is the recipe's too (a checkpoint may
    predate it)."""
    tc = train_cfg
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)  # the factor of the restored step
    for group, want in zip(optimizer.param_groups, _groups_of(model, tc, model_cfg), strict=True):
        if [id(p) for p in group["params"]] != [id(p) for p in want["params"]]:
            raise RuntimeError("the optimizer's groups are not the recipe's: build it with build_optimizer")
        base = float(want.get("lr", tc.lr))
        group.update(initial_lr=base, lr=base * factor, weight_decay=want["weight_decay"], betas=tuple(tc.betas),
                     eps=float(tc.eps))
        if GROUP_NAME in want:
            group[GROUP_NAME] = want[GROUP_NAME]
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``{"lr/<component>": rate}`` of per-component groups (empty without them): the log's rates."""
    return {f"lr/{g[GROUP_NAME]}": g["lr"] for g in optimizer.param_groups if GROUP_NAME in g}


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
