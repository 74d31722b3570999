"""LoRA adapters (models/lora.py) as a PEFT adapter directory, and back.

``omniweave hf export CKPT --output DIR --adapter`` writes::

    DIR/adapter/adapter_config.json        peft_type LORA, r / lora_alpha (per-module ranks and alphas
                                           that differ in rank_pattern / alpha_pattern), target_modules
                                           (the adapted modules' full transformers names),
                                           modules_to_save (what trains in full, each part at its outermost
                                           module that holds nothing frozen or adapted: :func:`modules_to_save`)
    DIR/adapter/adapter_model.safetensors  base_model.model.<transformers module>.lora_A.weight / lora_B.weight,
                                           base_model.model.<tensor> of each module to save
    DIR/base/                              the base weights as a HF directory (export.py), unless the
                                           run started from a HF directory (``train.init_from``): that is the base

so ``peft.PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(BASE), DIR/adapter)``
computes what omniweave computed. Names are the transformers model's own module names (its
load-time renaming of the family adapter's checkpoint names: :class:`TransformersNames`), as peft
writes them itself (the PEFT round-trip tests compare). :func:`load_adapter` puts such a directory back onto an
omniweave model of its base (``hf verify --adapter``); an adapter of another base is an error
that names the tensors that do not fit, and one PEFT cannot load (nested ``modules_to_save``, as
omniweave wrote before it chose the outermost module) an error that says so.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from omniweave.errors import UserError, first_few
from omniweave.models.hf.loading import adapter_for
from omniweave.models.lora import LoraConfig, add_adapter, adapted_linears, candidate_linears, is_adapter_name

PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class TransformersNames:
    """Our tensor names -> the names of the tensors in a transformers model of ``hf_cfg`` (PEFT keys
    are those, not the checkpoint's: transformers 5 renames e.g. Qwen2-VL's ``visual.…`` and
    ``model.layers.…`` to ``model.visual.…`` and ``model.language_model.layers.…`` on load). The
    transformers model is built on the meta device and its own load-time renaming applied to the
    family adapter's checkpoint name; a name it does not hold is an error."""

    def __init__(self, hf_adapter, hf_cfg: dict):
        from omniweave.models.hf.torchvision_guard import torchvision_loads

        torchvision_loads()  # a broken torchvision would make transformers' VL classes fail to import
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        cls = getattr(transformers, hf_cfg["architectures"][0])
        config = transformers.AutoConfig.for_model(**hf_cfg)
        with torch.device("meta"):
            model = cls(config)
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        meta = model.state_dict(keep_vars=True)
        self.hf_adapter, self.present = hf_adapter, set(meta)
        self._shapes = {n: tuple(t.shape) for n, t in meta.items()}
        self._rename = lambda n: rename_source_key(n, renamings, converters, model.base_model_prefix, meta)[0]
        shared: dict[int, list[str]] = {}  # tied tensors (lm_head.weight = embed_tokens.weight): one object
        for n, t in meta.items():
            shared.setdefault(id(t), []).append(n)
        self._ties = {n: group for group in shared.values() for n in group}
        # modules PEFT's modules_to_save refuses to wrap (they have no forward of their own)
        containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
        self.containers = {n for n, m in model.named_modules() if isinstance(m, containers)}

    def tensor(self, name: str) -> str | None:
        """The transformers name of our tensor ``name``; None if the model has no such tensor."""
        hf = self.hf_adapter.model_name_to_hf(name)
        if hf is None:
            return None
        renamed = self._rename(hf)
        return renamed if renamed in self.present else None

    def pieces(self, name: str, t: torch.Tensor) -> list[tuple[list[str], torch.Tensor]] | None:
        """Our tensor ``name`` (value ``t``) as tensors of the transformers model: (its names, the
        piece) for each, consecutive row blocks of ``t``; usually one, several where the family
        stores it split (Qwen2.5-Omni's fused vision ``qkv`` as ``q``, ``k``, ``v``; the family
        adapter's ``model_tensors_to_hf``), a tied tensor under each of its names. [] if the model
        has no such tensor (a tied head); None if the pieces are not whole tensors of the model
        (MoE experts the transformers model fuses its own way)."""
        if hasattr(self.hf_adapter, "model_tensors_to_hf"):
            pairs = self.hf_adapter.model_tensors_to_hf(name, t)
        else:
            pairs = [] if (hf := self.hf_adapter.model_name_to_hf(name)) is None else [(hf, t)]
        out = []
        for hf, piece in pairs:
            renamed = self._rename(hf)
            if renamed not in self.present:
                continue
            if self._shapes[renamed] != tuple(piece.shape):
                return None
            out.append((self._ties[renamed], piece))
        return out

    def placed(self, state_dict: dict) -> Iterator[tuple[str, int, list[str], torch.Tensor]]:
        """(our name, piece index, transformers names, piece) for the pieces of every tensor of our
        ``state_dict`` (adapters aside) that the transformers model holds (:meth:`pieces`)."""
        for n, t in state_dict.items():
            if not is_adapter_name(n):
                for i, (hf_names, piece) in enumerate(self.pieces(n, t) or []):
                    yield n, i, hf_names, piece

    def module(self, name: str) -> str:
        """The transformers module name of our Linear ``name``."""
        hf = self.tensor(f"{name}.weight")
        if hf is None or not hf.endswith(".weight"):
            raise UserError(f"{name}: no transformers module holds its weight as one tensor ({hf}); export this "
                            "model merged (without --adapter)")
        return hf[: -len(".weight")]


# What each tensor of the transformers model is in an adapted model, for PEFT's modules_to_save
TRAINED, FROZEN, ADAPTED, BUFFER = "trained in full", "frozen", "LoRA-adapted", "a buffer"


def tensor_status(model: nn.Module, names: TransformersNames) -> dict[str, str]:
    """Transformers tensor name -> TRAINED, ADAPTED (weight or bias of a Linear with an adapter),
    FROZEN or BUFFER, for every tensor of the transformers model (tied names included; one that
    omniweave's model lacks keeps transformers' own value: FROZEN)."""
    adapted = {name for name, _ in adapted_linears(model)}
    status = dict.fromkeys(names.present, FROZEN)
    for n, t in model.state_dict(keep_vars=True).items():
        if is_adapter_name(n):
            continue
        if n.rsplit(".", 1)[0] in adapted:
            s = ADAPTED
        elif isinstance(t, nn.Parameter):
            s = TRAINED if t.requires_grad else FROZEN
        else:
            s = BUFFER
        pieces = names.pieces(n, t.detach())
        if pieces is None and s == TRAINED:
            raise UserError(f"{n} is trained in full, but the transformers model holds it in another layout, which "
                            "PEFT's modules_to_save cannot carry; export this run merged (without --adapter)")
        for hf_names, _ in pieces or []:
            status.update(dict.fromkeys(hf_names, s))
    return status


def _modules_of(tensor: str) -> list[str]:
    """The modules holding ``tensor``, outermost first (``a.b.weight`` -> ``a``, ``a.b``; the model
    itself, which PEFT cannot save, is not one)."""
    parts = tensor.split(".")[:-1]
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def modules_to_save(status: dict[str, str], containers: set[str] = frozenset()) -> list[str]:
    """PEFT's ``modules_to_save`` for tensors of ``status`` (:func:`tensor_status`): for each tensor
    trained in full, the outermost module that holds nothing but such tensors (and buffers) and is
    not one of ``containers`` (ModuleList / ModuleDict, which PEFT refuses to wrap: their children
    are kept instead). PEFT keeps whole modules: an adapted Linear inside a kept one would lose its
    adapter, a frozen tensor would be copied for nothing, and a module inside a kept one cannot be
    listed again (PEFT fails to load that). A trained tensor every module of which also holds
    frozen or adapted tensors is a UserError naming both."""
    held: dict[str, set[str]] = {}
    for name, s in status.items():
        for module in _modules_of(name):
            held.setdefault(module, set()).add(s)
    saved = set()
    for name, s in status.items():
        if s != TRAINED:
            continue
        module = next((m for m in _modules_of(name) if held[m] <= {TRAINED, BUFFER} and m not in containers), None)
        owners = [m for m in _modules_of(name) if m not in containers]
        if module is None and not owners:
            raise UserError(f"{name} is trained in full but in no module PEFT's modules_to_save can keep (it belongs to "
                            "the model itself or to a container); export this run merged (without --adapter)")
        if module is None:
            owner = owners[-1] + "."
            other = next(o for o, so in status.items() if so in (FROZEN, ADAPTED) and o.startswith(owner))
            raise UserError(f"{name} is trained in full, but PEFT's modules_to_save keeps whole modules and every "
                            f"module holding it also holds {other} ({status[other]}); export this run merged (without "
                            "--adapter), or train that module's components alike (all in full, adapters or frozen)")
        saved.add(module)
    return sorted(saved)


def adapter_state(model: nn.Module, names: TransformersNames) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT tensors, adapter_config.json fields that depend on the model) of an adapted plain model."""
    tensors, ranks, alphas, dropouts = {}, {}, {}, []
    for name, m in adapted_linears(model):
        hf = names.module(name)
        for part in ("lora_A", "lora_B"):
            tensors[f"{PREFIX}{hf}.{part}.weight"] = getattr(m, part).weight.detach().cpu().contiguous().clone()
        ranks[hf], alphas[hf] = m.lora_rank, m.lora_scaling * m.lora_rank
        dropouts.append(float(getattr(m.lora_dropout, "p", 0.0)))
    if not ranks:
        raise UserError("the checkpoint's model has no LoRA adapters (model.<component>.lora); export it without --adapter")
    saved = modules_to_save(tensor_status(model, names), names.containers)
    for _, _, hf_names, piece in names.placed(model.state_dict()):  # the saved modules' tensors, all names
        for hf in hf_names:
            if any(m in saved for m in _modules_of(hf)):
                tensors[PREFIX + hf] = piece.detach().cpu().contiguous().clone()
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    fields = {"r": r, "lora_alpha": _number(alpha), "lora_dropout": max(dropouts),
              "target_modules": sorted(ranks), "modules_to_save": sorted(saved) or None,
              "rank_pattern": {k: v for k, v in sorted(ranks.items()) if v != r},
              "alpha_pattern": {k: _number(v) for k, v in sorted(alphas.items()) if v != alpha}}
    return tensors, fields


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def adapter_config(fields: dict, hf_cfg: dict, base: str) -> dict:
    """adapter_config.json as PEFT writes it for a LoRA adapter (the keys PEFT 0.21 reads)."""
    model_type = hf_cfg["model_type"]
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base, "revision": None,
            "auto_mapping": {"base_model_class": hf_cfg["architectures"][0],
                             "parent_library": f"transformers.models.{model_type}.modeling_{model_type}"},
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "lora_bias": False, "layers_to_transform": None,
            "layers_pattern": None, "exclude_modules": None, **fields}


def export_adapter(model: nn.Module, model_cfg: dict, out_dir: str | Path, base_dir: str | None = None,
                   data_cfg: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``out_dir/adapter`` (PEFT) and, unless ``base_dir`` (the HF directory the run started
    from) is given, ``out_dir/base`` (the model without its adapters); returns out_dir. Removes the
    adapters from ``model``."""
    from safetensors.torch import save_file

    from omniweave.models.hf.export import export_hf, hf_model_type
    from omniweave.models.lora import strip_adapters

    out_dir = Path(out_dir)
    hf_adapter = adapter_for(hf_model_type(model))
    hf_cfg = hf_adapter.model_config_to_hf(model)
    tensors, fields = adapter_state(model, TransformersNames(hf_adapter, hf_cfg))
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    if base_dir is None:
        strip_adapters(model)
        base = str(export_hf(model, model_cfg, out_dir / "base", dtype, data_cfg=data_cfg).resolve())
    else:
        base = str(Path(base_dir).resolve())
        check_base(Path(base), hf_cfg)
    (out_dir / "adapter").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter" / WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(fields, hf_cfg, base)
    (out_dir / "adapter" / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def check_base(base_dir: Path, hf_cfg: dict) -> None:
    """The HF directory a run started from has the architecture of its model (else the adapter
    would name another base)."""
    from omniweave.models.hf.loading import read_hf_config

    got = read_hf_config(base_dir)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    ours = {k: hf_cfg.get(k, (hf_cfg.get("text_config") or {}).get(k)) for k in keys}
    theirs = {k: got.get(k, (got.get("text_config") or {}).get(k)) for k in keys}
    if ours != theirs:
        raise UserError(f"train.init_from={base_dir} is not this model's base: {theirs} vs the checkpoint's {ours}")


# ----------------------------------------------------------------------------- back onto our model


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module's name end."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?({key})", module):
            return value
    return default


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> int:
    """Add a PEFT LoRA adapter directory's adapters to ``model`` (a plain omniweave model of its base,
    e.g. from ``load_hf``) and load its weights, in place; returns how many modules it adapted."""
    from safetensors.torch import load_file

    from omniweave.models.hf.export import hf_model_type

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / CONFIG).is_file() or not (adapter_dir / WEIGHTS).is_file():
        raise UserError(f"{adapter_dir}: not a PEFT adapter directory (expected {CONFIG} and {WEIGHTS})")
    try:
        cfg = json.loads((adapter_dir / CONFIG).read_text())
        tensors = load_file(str(adapter_dir / WEIGHTS))
    except (ValueError, OSError) as e:  # JSONDecodeError and SafetensorError are ValueErrors / OSErrors
        raise UserError(f"{adapter_dir}: cannot read the adapter: {e}") from None
    peft_type = cfg.get("peft_type") if isinstance(cfg, dict) else None
    if peft_type != "LORA":
        raise UserError(f"{adapter_dir}: peft_type {peft_type!r}; only LORA adapters are supported")
    hf_adapter = adapter_for(hf_model_type(model))
    names = TransformersNames(hf_adapter, hf_adapter.model_config_to_hf(model))
    ours = {}
    for n in _all_linears(model):
        hf = names.tensor(f"{n}.weight")
        if hf is not None and hf.endswith(".weight"):
            ours[hf[: -len(".weight")]] = n
    base = cfg.get("base_model_name_or_path")
    wrong = []
    plan = []
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        hf = key.removeprefix(PREFIX)[: -len(".lora_A.weight")]
        b = tensors.get(f"{PREFIX}{hf}.lora_B.weight")
        linear = model.get_submodule(ours[hf]) if hf in ours else None
        a = tensors[key]
        if linear is None or b is None or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features or b.shape[1] != a.shape[0]:
            have = "no such Linear" if linear is None else f"Linear {linear.in_features}->{linear.out_features}"
            wrong.append(f"{hf}: A {list(a.shape)}, B {None if b is None else list(b.shape)} ({have})")
            continue
        plan.append((linear, hf, a, b))
    if wrong or not plan:
        raise UserError(f"{adapter_dir}: this adapter does not fit the model (it was exported for another base model: "
                        f"{base}): " + (first_few(wrong, 4, "; ") if wrong else "no lora_A tensors"))
    saved = _saved_tensors(model, names, cfg, tensors, adapter_dir)
    for linear, hf, a, b in plan:
        r = a.shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, hf, cfg.get("lora_alpha", 8))
        add_adapter(linear, LoraConfig(r=r, alpha=float(alpha), dropout=0.0))
        with torch.no_grad():
            linear.lora_A.weight.copy_(a)
            linear.lora_B.weight.copy_(b)
    with torch.no_grad():
        for target, value in saved:
            target.copy_(value)
    return len(plan)


def _all_linears(model: nn.Module) -> list[str]:
    return [f"{section}.{n}" for section, c in model.named_children() for n in candidate_linears(c)]


def _saved_tensors(model: nn.Module, names: TransformersNames, cfg: dict, tensors: dict,
                   adapter_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(our tensor, its value) for each of our tensors the adapter's full tensors (PEFT's
    modules_to_save) hold, checked as PEFT loads them: the modules that ``modules_to_save`` names
    (PEFT keeps each module whose name ends with an entry) are not nested and hold every full
    tensor, and those fit the model (a tensor stored split: every piece there)."""
    entries = cfg.get("modules_to_save") or []
    modules = {m for hf in names.present for m in _modules_of(hf)}
    kept = sorted(m for m in modules if any(m.endswith(e) for e in entries))
    nested = [(outer, inner) for outer in kept for inner in kept if inner.startswith(outer + ".")]
    if nested:
        raise UserError(f"{adapter_dir}: modules_to_save keeps {nested[0][1]} inside {nested[0][0]}, which PEFT cannot "
                        "load; export the checkpoint again (omniweave hf export CKPT --output DIR --adapter)")
    sd = model.state_dict()
    where = {hf: (n, i, tuple(piece.shape))  # transformers name -> (our tensor, piece index, the piece's shape)
             for n, i, hf_names, piece in names.placed(sd) for hf in hf_names}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in sorted(tensors.items()):
        if is_adapter_name(key):
            continue
        hf = key.removeprefix(PREFIX)
        if hf not in where or where[hf][2] != tuple(t.shape):
            raise UserError(f"{adapter_dir}: saved module tensor {hf} {list(t.shape)} does not fit the model "
                            "(an adapter exported for another base model?)")
        if not any(m in kept for m in _modules_of(hf)):
            raise UserError(f"{adapter_dir}: tensor {hf} is in no module of modules_to_save "
                            f"({', '.join(entries) or 'none'}): PEFT would not load it")
        parts.setdefault(where[hf][0], {})[where[hf][1]] = t
    out = []
    for n, got in parts.items():
        pieces = names.pieces(n, sd[n])
        missing = [hf_names[0] for i, (hf_names, _) in enumerate(pieces) if i not in got]
        if missing:
            raise UserError(f"{adapter_dir}: saved module tensors of {n} lack {', '.join(missing)}")
        out.append((sd[n], torch.cat([got[i] for i in range(len(pieces))])))
    return out
