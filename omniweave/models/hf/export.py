"""Write a directory ``transformers`` loads with ``from_pretrained``: config.json + model.safetensors.

CLI: ``omniweave hf export CKPT --output HF_DIR`` where CKPT holds ``model.safetensors`` (our
state-dict names, as written by :func:`save_checkpoint_dir`) and ``config.yaml`` (a recipe with a
``model:`` section, or the model section itself).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from omniweave.models.hf.loading import adapter_for, assign_state_dict
from omniweave.models.registry import build_model


def hf_model_type(model: nn.Module) -> str:
    """HF model_type of a model: its own ``hf_model_type()`` or its foundation's family."""
    if hasattr(model, "hf_model_type"):
        return model.hf_model_type()
    return model.foundation.config.family


def export_hf(model: nn.Module, model_cfg: dict | None, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``out_dir/config.json`` + ``out_dir/model.safetensors``; returns out_dir."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = adapter_for(hf_model_type(model))
    skip = adapter.skip_on_export(model)
    tensors = {}
    for name, t in model.state_dict().items():
        if name in skip:
            continue
        hf_name = adapter.model_name_to_hf(name)
        if hf_name is None:
            continue
        t = t.detach().to("cpu")
        tensors[hf_name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().clone()
    cfg = adapter.model_config_to_hf(model)
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


def save_checkpoint_dir(model: nn.Module, model_cfg: dict, ckpt_dir: str | Path) -> Path:
    """A plain checkpoint dir (our names): model.safetensors + config.yaml (``model:`` section)."""
    import yaml
    from safetensors.torch import save_file

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for n, t in model.state_dict().items():  # tied tensors are stored once
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        tensors[n] = t.detach().cpu().contiguous().clone()
    save_file(tensors, str(ckpt_dir / "model.safetensors"))
    (ckpt_dir / "config.yaml").write_text(yaml.safe_dump({"model": model_cfg}, sort_keys=False))
    return ckpt_dir


def load_checkpoint_dir(ckpt_dir: str | Path) -> tuple[nn.Module, dict]:
    """(model, model_cfg) from a dir holding model.safetensors (our names) + config.yaml."""
    import yaml
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    cfg_path, st_path = ckpt_dir / "config.yaml", ckpt_dir / "model.safetensors"
    for p in (cfg_path, st_path):
        if not p.exists():
            hint = " (a DCP checkpoint? convert it with the trainer first)" if (ckpt_dir / ".metadata").exists() else ""
            raise FileNotFoundError(f"{ckpt_dir}: no {p.name}{hint}")
    cfg = yaml.safe_load(cfg_path.read_text())
    model_cfg = cfg.get("model", cfg)
    with torch.device("meta"):
        model = build_model(model_cfg)
    assign_state_dict(model, load_file(str(st_path)), str(st_path))
    return model, model_cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint dir: model.safetensors + config.yaml")
    parser.add_argument("--output", required=True, help="HF directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast floating tensors (default: keep)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    model, model_cfg = load_checkpoint_dir(args.checkpoint)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_hf(model, model_cfg, args.output, dtype)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    print(f"exported {hf_model_type(model)} model ({n / 1e6:.1f}M parameters) to {out}")
    return 0
