"""LoRA adapters, applied to a built model from outside (like the parallel plans): the model files stay plain.

A recipe turns them on per component (``foundation``, ``image_encoder``, ``projector``, …)::

    model:
      foundation:
        lora: {r: 16, alpha: 32, dropout: 0.05, targets: [q_proj, v_proj]}   # or targets: all-linear

A targeted ``nn.Linear`` (e.g. ``foundation.layers.0.self_attn.q_proj``) stays the same module with
the same ``weight`` / ``bias`` (checkpoint and HF names unchanged) and gains two children, as PEFT
names them::

    q_proj.lora_A.weight [r, in]    kaiming-uniform (PEFT's default)
    q_proj.lora_B.weight [out, r]   zeros: a fresh adapter leaves the model's output unchanged
    y = x @ W.T + b  +  (alpha / r) · lora_B(lora_A(dropout(x)))

The low-rank term is added by a forward hook that runs before any other forward hook of the
Linear, so under tensor parallelism (LoRA applied after TP) it is added to the base layer's DTensor
output before the TP style turns that into its local output: the reduce-scatter / reduce of a
row-wise layer covers the sum. The adapter's matrices are placed after the base weight
(:func:`adapter_placements`): column-wise (weight ``Shard(0)``) -> lora_B ``Shard(0)``, lora_A
replicated; row-wise (``Shard(1)``) -> lora_A ``Shard(1)``, lora_B replicated; replicated -> both.

A component with ``lora`` trains only its adapters (its base weights are frozen); a component
without one trains fully unless ``freeze: true``; the optimizer holds only what requires grad
(train/optim.py). :func:`adapters_disabled` computes the base model (DPO's reference);
:func:`merge_adapters` folds the adapters into the weights (merged HF export).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator

import torch
from torch import nn

from omniweave.errors import UserError
from omniweave.models.registry import component_modules

ALL_LINEAR = "all-linear"
LORA_KEYS = ("r", "alpha", "dropout", "targets")
# Linear layers no adapter goes into: the LM head (the loss reads its weight directly, and PEFT's
# all-linear leaves the output layer out too).
EXCLUDED = ("lm_head",)
ADAPTER_CHILDREN = ("lora_A", "lora_B", "lora_dropout")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """One component's adapters: rank, alpha (scaling = alpha / r), dropout on the adapter's input,
    and the targeted module names (``"all-linear"`` or names relative to the component)."""

    r: int
    alpha: float | None = None  # None: r (scaling 1)
    dropout: float = 0.0
    targets: tuple[str, ...] | str = ALL_LINEAR

    def __post_init__(self):
        if self.alpha is None:
            object.__setattr__(self, "alpha", self.r)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def parse_lora(section: str, raw: Any) -> LoraConfig | None:
    """``model.<section>.lora`` -> a LoraConfig (None when absent); errors name the key."""
    if raw is None or raw is False:
        return None
    key = f"model.{section}.lora"
    if not isinstance(raw, dict):
        raise UserError(f"{key} must be a mapping with {', '.join(LORA_KEYS)}; got {raw!r}")
    unknown = sorted(set(raw) - set(LORA_KEYS))
    if unknown:
        raise UserError(f"{key}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(LORA_KEYS)}")
    if "r" not in raw:
        raise UserError(f"{key}.r is required (the adapter rank, e.g. 16)")
    given = LoraConfig(**raw)  # LoraConfig holds the defaults of the keys the recipe leaves out
    r, alpha, dropout, targets = given.r, given.alpha, given.dropout, given.targets
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise UserError(f"{key}.r={r!r}: the rank must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise UserError(f"{key}.alpha={alpha!r}: must be a number > 0 (scaling = alpha / r)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise UserError(f"{key}.dropout={dropout!r}: must be in [0, 1)")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        targets = [targets]
    if not isinstance(targets, str):
        targets = list(targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise UserError(f"{key}.targets={targets!r}: a list of module names or '{ALL_LINEAR}'")
        targets = tuple(dict.fromkeys(targets))
    return LoraConfig(r=int(r), alpha=float(alpha), dropout=float(dropout), targets=targets)


def lora_configs(model_cfg: dict) -> dict[str, LoraConfig]:
    """Section -> LoraConfig for every component of the recipe's ``model:`` that has ``lora``."""
    out = {}
    for section, comp in model_cfg.items():
        cfg = parse_lora(section, comp.get("lora")) if isinstance(comp, dict) else None
        if cfg is not None:
            out[section] = cfg
    return out


# ----------------------------------------------------------------------------- targets


def _short(name: str) -> str:
    """How a module is named in ``targets``: its last name, with the parent's for a numbered
    child of a Sequential (``mlp.0``)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def candidate_linears(component: nn.Module) -> dict[str, nn.Linear]:
    """Name (relative to the component) -> Linear, for every Linear an adapter may go into."""
    return {name: m for name, m in component.named_modules() if isinstance(m, nn.Linear)
            and name.split(".")[-1] not in EXCLUDED and name.split(".")[-1] not in ADAPTER_CHILDREN}


def valid_targets(component: nn.Module) -> list[str]:
    return sorted({_short(n) for n in candidate_linears(component)})


def target_names(component: nn.Module, cfg: LoraConfig, section: str) -> list[str]:
    """The component's module names the adapters go into (PEFT's matching: a target matches a
    module named exactly so or ending in ``.target``); unknown targets are an error listing the valid."""
    linears = candidate_linears(component)
    if cfg.targets == ALL_LINEAR:
        if not linears:
            raise UserError(f"model.{section}.lora: the {section} has no Linear layer for an adapter")
        return list(linears)
    unknown = [t for t in cfg.targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if unknown:
        raise UserError(f"model.{section}.lora.targets: unknown {', '.join(map(repr, unknown))}; valid: "
                        f"{', '.join(valid_targets(component))} (or '{ALL_LINEAR}')")
    return [n for n in linears if any(n == t or n.endswith("." + t) for t in cfg.targets)]


# ----------------------------------------------------------------------------- the adapter


def _lora_forward_hook(module: nn.Linear, args, output):
    """Adds the low-rank update to a Linear's output (first of its forward hooks: see the module docstring)."""
    if not module.lora_enabled:
        return output
    return output + module.lora_B(module.lora_A(module.lora_dropout(args[0]))) * module.lora_scaling


def adapter_placements(weight: torch.Tensor) -> tuple[list, list] | None:
    """(lora_A placements, lora_B placements) for a base weight that is a DTensor (None for a plain one)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return None
    a, b = [], []
    for p in weight.placements:
        if p == Shard(0):
            a.append(Replicate()), b.append(Shard(0))
        elif p == Shard(1):
            a.append(Shard(1)), b.append(Replicate())
        elif p.is_replicate():
            a.append(Replicate()), b.append(Replicate())
        else:
            raise ValueError(f"LoRA: no adapter layout for a base weight placed as {weight.placements}")
    return a, b


def _adapter_linear(in_features: int, out_features: int, like: torch.Tensor, placements, init) -> nn.Linear:
    """A bias-free Linear on ``like``'s device and dtype, initialised whole by ``init`` (the same
    draws as on one rank), then distributed as ``placements`` when the base weight is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = like.to_local() if isinstance(like, DTensor) else like
    lin = nn.Linear(in_features, out_features, bias=False, device="meta")
    weight = torch.empty(out_features, in_features, device=local.device, dtype=local.dtype)
    if not weight.is_meta:
        with torch.no_grad():
            init(weight)
    if placements is not None:
        weight = distribute_tensor(weight, like.device_mesh, placements)
    lin.weight = nn.Parameter(weight)
    return lin


def _kaiming(w: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))


def add_adapter(linear: nn.Linear, cfg: LoraConfig) -> None:
    """Give ``linear`` a LoRA adapter (children lora_A, lora_B, lora_dropout; the hook), in place."""
    if hasattr(linear, "lora_A"):
        raise ValueError("this Linear already has a LoRA adapter")
    placements = adapter_placements(linear.weight)
    a_place, b_place = placements if placements is not None else (None, None)
    linear.lora_A = _adapter_linear(linear.in_features, cfg.r, linear.weight, a_place, _kaiming)
    linear.lora_B = _adapter_linear(cfg.r, linear.out_features, linear.weight, b_place, nn.init.zeros_)
    linear.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    linear.lora_scaling, linear.lora_enabled, linear.lora_rank = cfg.scaling, True, cfg.r
    linear.register_forward_hook(_lora_forward_hook, prepend=True)


@torch.no_grad()
def reset_adapter(linear: nn.Linear) -> None:
    """PEFT's initialisation: lora_A kaiming-uniform (a = sqrt 5, as nn.Linear), lora_B zeros (in place:
    after a meta-device model is materialised, each rank draws its own shards as ``parallel_model.seed_sharded_init`` says)."""
    _kaiming(linear.lora_A.weight)
    nn.init.zeros_(linear.lora_B.weight)


def adapted_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(name, Linear) of every Linear that has an adapter."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and hasattr(m, "lora_A") and isinstance(getattr(m, "lora_A"), nn.Module):
            yield name, m


def reset_adapters(model: nn.Module) -> None:
    """Re-initialise every adapter (after a component's ``init_weights`` reset its Linears)."""
    for _, m in adapted_linears(model):
        reset_adapter(m)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name belongs to an adapter (``…q_proj.lora_A.weight``)."""
    return ".lora_A." in f".{name}" or ".lora_B." in f".{name}"


def apply_lora(model: nn.Module, model_cfg: dict) -> dict[str, list[str]]:
    """Add the recipe's adapters to ``model`` (built, and tensor-parallelised if it is going to be),
    freeze each adapted component's base weights; returns section -> adapted module names."""
    configs, modules = lora_configs(model_cfg), component_modules(model)
    plan = {}
    for section, cfg in configs.items():  # validate every component before changing any
        component = modules.get(section)
        if component is None:
            raise UserError(f"model.{section}.lora: the model has no {section}")
        plan[section] = (component, cfg, target_names(component, cfg, section))
    for section, (component, cfg, names) in plan.items():
        component.requires_grad_(False)
        for name in names:
            add_adapter(component.get_submodule(name), cfg)
    return {section: names for section, (_, _, names) in plan.items()}


def check_lora(model_cfg: dict) -> None:
    """The recipe's adapters fit its model (keys, targets), checked on a meta-device build."""
    if not lora_configs(model_cfg):
        return
    from omniweave.models.registry import build_model

    with torch.device("meta"):
        build_model(model_cfg)  # applies (and so validates) the adapters


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block the model computes its base (no adapter adds anything); DPO's reference model."""
    adapted = [m for _, m in adapted_linears(model)]
    previous = [m.lora_enabled for m in adapted]
    for m in adapted:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, was in zip(adapted, previous):
            m.lora_enabled = was


def remove_adapter(linear: nn.Linear) -> None:
    """Drop ``linear``'s adapter (children, hook, attributes); its base weights stay as they are."""
    for key, fn in list(linear._forward_hooks.items()):
        if fn is _lora_forward_hook:
            del linear._forward_hooks[key]
    for child in ADAPTER_CHILDREN:
        delattr(linear, child)
    for attr in ("lora_scaling", "lora_enabled", "lora_rank"):
        delattr(linear, attr)


@torch.no_grad()
def merged_weight(linear: nn.Linear) -> torch.Tensor:
    """An adapted linear's weight with its adapter folded in: W + scaling · B @ A (W's dtype)."""
    delta = (linear.lora_B.weight.float() @ linear.lora_A.weight.float()) * linear.lora_scaling
    return (linear.weight.float() + delta).to(linear.weight.dtype)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W += scaling · B @ A) and remove it, in place (plain,
    unsharded models: export); returns how many were merged."""
    n = 0
    for _, m in list(adapted_linears(model)):
        m.weight.copy_(merged_weight(m))
        remove_adapter(m)
        n += 1
    return n


def strip_adapters(model: nn.Module) -> int:
    """Remove every adapter without merging (the base model, for a PEFT export's base dir)."""
    adapted = [m for _, m in adapted_linears(model)]
    for m in adapted:
        remove_adapter(m)
    return len(adapted)
