"""LoRA adapters (models/lora.py) as a PEFT adapter directory, and back.

``omniweave hf export CKPT --output DIR --adapter`` writes::

    DIR/adapter/adapter_config.json        peft_type LORA, r / lora_alpha (per-module ranks and alphas
                                           that differ in rank_pattern / alpha_pattern), target_modules
                                           (the adapted modules' full transformers names),
                                           modules_to_save (components trained in full)
    DIR/adapter/adapter_model.safetensors  base_model.model.<transformers module>.lora_A.weight / lora_B.weight,
                                           base_model.model.<tensor> of each module to save
    DIR/base/                              the base weights as a HF directory (export.py), unless the
                                           run started from a HF directory (``train.init_from``): that is the base

so ``peft.PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(BASE), DIR/adapter)``
computes what omniweave computed. Names are the transformers model's own module names (its
load-time renaming of the family adapter's checkpoint names: :class:`TransformersNames`), as peft
writes them itself (the PEFT round-trip tests compare). :func:`load_adapter` puts such a directory back onto an
omniweave model of its base (``hf verify --adapter``); an adapter of another base is an error
that names the tensors that do not fit.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from omniweave.errors import UserError
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
        meta = model.state_dict()
        self.hf_adapter, self.present = hf_adapter, set(meta)
        self._rename = lambda n: rename_source_key(n, renamings, converters, model.base_model_prefix, meta)[0]

    def tensor(self, name: str) -> str | None:
        """The transformers name of our tensor ``name``; None if the model has no such tensor."""
        hf = self.hf_adapter.model_name_to_hf(name)
        if hf is None:
            return None
        renamed = self._rename(hf)
        return renamed if renamed in self.present else None

    def module(self, name: str) -> str:
        """The transformers module name of our Linear ``name``."""
        hf = self.tensor(f"{name}.weight")
        if hf is None or not hf.endswith(".weight"):
            raise UserError(f"{name}: no transformers module holds its weight as one tensor ({hf}); export this "
                            "model merged (without --adapter)")
        return hf[: -len(".weight")]


def _saved_modules(model: nn.Module, names: TransformersNames) -> dict[str, list[str]]:
    """HF module prefix -> our tensor names under it, for each component trained in full next to
    adapters (PEFT's modules_to_save): a component none of whose weights is frozen or an adapter."""
    adapted = {name for name, _ in adapted_linears(model)}
    out = {}
    for section, component in model.named_children():
        params = [(n, p) for n, p in component.named_parameters() if not is_adapter_name(n)]
        if not params or not all(p.requires_grad for _, p in params):
            continue
        hf = [names.tensor(f"{section}.{n}") for n, _ in params]
        prefix = ".".join(_common_prefix([n.split(".") for n in hf if n is not None]))
        inside = [n for n in model.state_dict() if not is_adapter_name(n)
                  and (h := names.tensor(n)) is not None and h.startswith(prefix + ".")]
        if not prefix or any(n.rsplit(".", 1)[0] in adapted for n in inside):
            raise UserError(f"the {section} was trained in full but its transformers module ({prefix or 'the whole model'}) "
                            "also holds adapters or other components; export this model merged (without --adapter)")
        out[prefix] = inside
    return out


def _common_prefix(parts: list[list[str]]) -> list[str]:
    prefix = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return prefix


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
    saved = _saved_modules(model, names)
    sd = model.state_dict()
    for inside in saved.values():
        for n in inside:
            tensors[PREFIX + names.tensor(n)] = sd[n].detach().cpu().contiguous().clone()
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
    cfg = json.loads((adapter_dir / CONFIG).read_text())
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    tensors = load_file(str(adapter_dir / WEIGHTS))
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
        hf = key[len(PREFIX) : -len(".lora_A.weight")]
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
                        f"{base}): " + ("; ".join(wrong[:4]) + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
                                        if wrong else "no lora_A tensors"))
    for linear, hf, a, b in plan:
        r = a.shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, hf, cfg.get("lora_alpha", 8))
        add_adapter(linear, LoraConfig(r=r, alpha=float(alpha), dropout=0.0))
        with torch.no_grad():
            linear.lora_A.weight.copy_(a)
            linear.lora_B.weight.copy_(b)
    _load_saved_modules(model, names, tensors, adapter_dir)
    return len(plan)


def _all_linears(model: nn.Module) -> list[str]:
    return [f"{section}.{n}" for section, c in model.named_children() for n in candidate_linears(c)]


def _load_saved_modules(model: nn.Module, names: TransformersNames, tensors: dict, adapter_dir: Path) -> None:
    """The adapter's full tensors (modules_to_save) into the model; their shapes must fit."""
    full = {k[len(PREFIX) :]: v for k, v in tensors.items() if not is_adapter_name(k)}
    if not full:
        return
    sd = model.state_dict()
    ours = {names.tensor(n): n for n in sd if not is_adapter_name(n)}
    for hf, t in full.items():
        n = ours.get(hf)
        if n is None or tuple(sd[n].shape) != tuple(t.shape):
            raise UserError(f"{adapter_dir}: saved module tensor {hf} {list(t.shape)} does not fit the model "
                            "(an adapter exported for another base model?)")
        with torch.no_grad():
            sd[n].copy_(t)
