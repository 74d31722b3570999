"""Load a Qwen2-VL / Qwen2.5-VL Hugging Face directory into an ``OmniModel`` and export back.

    model, model_cfg = load_hf_vl("path/to/Qwen2.5-VL-7B-Instruct")     # OmniModel, model: section
    export_hf_vl(model, "out_dir")        # config.json + model.safetensors that transformers loads

Reads ``model.safetensors`` or the sharded ``model.safetensors.index.json``; accepts both the
checkpoint layout (``visual.*``, ``model.layers.*``) and transformers 5's in-memory layout
(``model.visual.*``, ``model.language_model.*``). Every parameter of ours must be filled (a tied
``lm_head`` may be absent); a checkpoint tensor we do not know is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from omniweave.models.registry import build_component, lookup


def read_hf_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(path / f)))
        return state
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return load_file(str(single))


def vl_adapter(hf_config: dict):
    model_type = hf_config.get("model_type")
    cls, _ = lookup("hf", model_type)
    adapter = cls()
    if not getattr(adapter, "multimodal", False):
        raise ValueError(f"model_type {model_type!r} is not a vision-language family")
    return adapter


def build_omni(model_cfg: dict, run_encoder_always: bool = True) -> nn.Module:
    from omniweave.models.omni import OmniModel

    return OmniModel(
        foundation=build_component("foundation", model_cfg["foundation"]),
        image_encoder=build_component("image_encoder", model_cfg["image_encoder"]),
        projector=build_component("projector", model_cfg["projector"]),
        run_encoder_always=run_encoder_always,
    )


def load_hf_vl(path: str | Path, dtype: torch.dtype = torch.float32, run_encoder_always: bool = True):
    """(OmniModel with the directory's weights, the ``model:`` config dict)."""
    hf = read_hf_config(path)
    adapter = vl_adapter(hf)
    model_cfg = adapter.model_config_to_ours(hf)
    model = build_omni(model_cfg, run_encoder_always)
    ours: dict[str, torch.Tensor] = {}
    for hf_name, tensor in read_safetensors(path).items():
        name = adapter.name_to_ours(hf_name)
        if name is not None:
            ours[name] = tensor
    expected = dict(model.named_parameters())
    unknown = sorted(set(ours) - set(model.state_dict()))
    if unknown:
        raise KeyError(f"{path}: tensors with no place in the model: {unknown[:5]}{' …' if len(unknown) > 5 else ''}")
    tied = model.foundation.config.tie_word_embeddings
    missing = sorted(n for n in expected if n not in ours and not (tied and n == "foundation.lm_head.weight"))
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {missing[:5]}{' …' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, param in expected.items():
            if name in ours:
                if tuple(ours[name].shape) != tuple(param.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(ours[name].shape)} != model {tuple(param.shape)}")
                param.copy_(ours[name])
    model.foundation.tie_weights()
    return model.to(dtype), model_cfg


def export_hf_vl(model: nn.Module, out_dir: str | Path, model_type: str | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for transformers' VL class of the family."""
    from safetensors.torch import save_file

    enc_cfg, proj_cfg, found_cfg = model.image_encoder.cfg, model.projector.cfg, model.foundation.config
    if model_type is None:
        model_type = "qwen2_5_vl" if enc_cfg.window_size else "qwen2_vl"
    adapter = vl_adapter({"model_type": model_type})
    config = adapter.model_config_to_hf(found_cfg, enc_cfg, proj_cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if found_cfg.tie_word_embeddings and name == "foundation.lm_head.weight":
            continue
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        state[adapter.name_to_hf(name)] = full.detach().cpu().contiguous()
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


__all__ = ["load_hf_vl", "export_hf_vl", "read_hf_config", "read_safetensors", "vl_adapter"]
