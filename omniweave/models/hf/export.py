"""Write a directory ``transformers`` loads with ``from_pretrained``: config.json + model.safetensors,
and, from the recipe the checkpoint was trained with, its tokenizer, chat template and (VL models)
image / video processor configs, so ``AutoProcessor`` loads it too (processor_files.py).

CLI: ``omniweave hf export CKPT --output HF_DIR [--adapter]`` where CKPT is a training checkpoint (a DCP
``step_N`` directory, a run's ``checkpoints/latest``, or the run directory itself: its latest
complete checkpoint), or a plain directory holding ``model.safetensors`` (our state-dict names, as
written by :func:`save_checkpoint_dir`) and ``config.yaml`` (a recipe with a ``model:`` section,
or the model section itself). A LoRA run's adapters are merged into the weights, or with
``--adapter`` written as a PEFT adapter next to its base (peft_adapter.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from omniweave.config import section
from omniweave.data.media.vision import VisionConfig
from omniweave.models.hf.loading import adapter_for, assign_state_dict
from omniweave.models.hf.processor_files import media_tokens, write_processor_files
from omniweave.models.registry import build_model


# config.json keys some families spell *_index (Qwen2.5-Omni thinker): written under their own name
_INDEX_KEYS = {"image_token_id": "image_token_index", "video_token_id": "video_token_index"}


def hf_model_type(model: nn.Module) -> str:
    """HF model_type of a model: its own ``hf_model_type()`` or its foundation's family (Qwen3.5:
    ``qwen3_5_text`` / ``qwen3_5_moe_text``, transformers' text-only model types)."""
    if getattr(model, "action_expert", None) is not None:  # a VLA model: lerobot's Pi0.5 layout (pi05.py)
        return "pi05"
    if hasattr(model, "hf_model_type"):
        return model.hf_model_type()
    cfg = model.foundation.config
    if cfg.family == "qwen3_5":
        return "qwen3_5_moe_text" if cfg.num_experts else "qwen3_5_text"
    return cfg.family


def tokenizer_hf_fields(data_cfg: dict | None) -> tuple[dict, Path | None]:
    """(config.json token ids, tokenizer dir) of a recipe's ``data:`` section, so an exported VL
    model's ``image_token_id`` … are the ids of the media tokens its ``data.template`` wrote in
    training (chatml: ``<|image_pad|>``, qwen2_5_omni: ``<|IMAGE|>`` …); ({}, None) without one."""
    if not data_cfg or not data_cfg.get("tokenizer"):
        return {}, None
    from omniweave.data.text.template import load_template
    from omniweave.data.text.tokenizer import load_tokenizer

    tok = load_tokenizer(data_cfg["tokenizer"])
    template = section({"data": data_cfg}, "data").template  # the schema's default where the recipe has none
    media = media_tokens(load_template(template, tokenizer=data_cfg["tokenizer"]))  # what training wrote
    ids = {}
    for key, token in (("image_token_id", media["image_token"]), ("video_token_id", media["video_token"]),
                       ("vision_start_token_id", media["vision_bos_token"]), ("vision_end_token_id", media["vision_eos_token"]),
                       ("audio_token_index", media["audio_token"]),  # Qwen2-Audio's config key (set only where cfg has it)
                       ("audio_start_token_id", media["audio_bos_token"]),  # Omni thinker
                       ("audio_end_token_id", media["audio_eos_token"]),
                       ("eos_token_id", tok.eos_token), ("bos_token_id", tok.bos_token), ("pad_token_id", tok.pad_token)):
        if token and tok.has_token(token):
            ids[key] = tok.token_id(token)
        elif key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            ids[key] = None  # this tokenizer has none: do not keep the family default's id
    return ids, tok.path


def hf_config(model: nn.Module, dtype: torch.dtype | None = None) -> dict:
    """The config.json of ``model`` (weights of ``dtype``, default its parameters')."""
    cfg = adapter_for(hf_model_type(model)).model_config_to_hf(model)
    cfg["dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    return cfg


def hf_tensors(model: nn.Module, dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None,
               copy: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s tensors under their HF names, its weights taken from ``state`` (default: its own
    state dict; e.g. the full tensors gathered from FSDP / TP shards). What :func:`export_hf`
    writes, and what the vLLM rollout engine loads in memory (rl/vllm_engine.py); ``copy=False``
    returns views where no conversion is needed (not for safetensors, which refuses shared storage).
    A ``state`` given is taken as it is (e.g. LoRA adapters merged into it: rl/vllm_engine.py)."""
    from omniweave.models.lora import adapted_linears

    if state is None and any(True for _ in adapted_linears(model)):  # callers merge (lora.merge_adapters) or export them (peft_adapter.py)
        raise ValueError("export_hf: the model still has LoRA adapters; merge them or export them with --adapter")
    adapter = adapter_for(hf_model_type(model))
    skip = adapter.skip_on_export(model)
    tensors = {}
    for name, t in (model.state_dict() if state is None else state).items():
        if name in skip:
            continue
        t = t.detach().to("cpu")
        if hasattr(adapter, "model_tensors_to_hf"):  # e.g. 3-D MoE experts written one tensor per expert
            pairs = adapter.model_tensors_to_hf(name, t)
        else:
            pairs = [] if (hf_name := adapter.model_name_to_hf(name)) is None else [(hf_name, t)]
        for hf_name, ht in pairs:
            ht = (ht.to(dtype) if dtype is not None and ht.is_floating_point() else ht).contiguous()
            tensors[hf_name] = ht.clone() if copy else ht
    if hasattr(adapter, "tensors_to_hf"):  # tensors HF stores fused (after a config: it may need its sizes)
        adapter.model_config_to_hf(model)
        tensors = adapter.tensors_to_hf(tensors)
    return tensors


def check_exportable(model: nn.Module) -> None:
    """ValueError now, naming why, for a model ``export_hf`` would refuse only at the end of a run
    (``train.save_hf``): a VLA model whose sizes are not one of lerobot's Pi0.5 layouts."""
    if hasattr(model, "generator"):  # video diffusion: a diffusers folder (models/hf/wan.py), T2V only
        return
    if hf_model_type(model) == "pi05":
        from omniweave.models.hf.pi05 import config_to_lerobot

        config_to_lerobot(model)


def export_hf(model: nn.Module, model_cfg: dict | None, out_dir: str | Path, dtype: torch.dtype | None = None,
              data_cfg: dict | None = None, weights: bool = True) -> Path:
    """Write ``out_dir/config.json`` + ``out_dir/model.safetensors``; returns out_dir. With the
    recipe's ``data_cfg`` the directory is whole: token ids from its tokenizer, whose files are
    copied, its chat template, and for VL models the image / video processor configs of its
    ``data.vision`` (see processor_files.py). Without, only config + weights are written.
    ``weights=False``: everything but the weights (an engine that gets them in memory: vLLM's)."""
    from safetensors.torch import save_file

    if hf_model_type(model) == "pi05":  # no transformers class: lerobot's policy directory (no processor files)
        from omniweave.models.hf.pi05 import export_pi05

        return export_pi05(model, out_dir, dtype)
    tensors = hf_tensors(model, dtype) if weights else None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(model, next(iter(tensors.values())).dtype if tensors else dtype)
    token_ids, tok_dir = tokenizer_hf_fields(data_cfg)
    for key, value in token_ids.items():
        key = _INDEX_KEYS[key] if _INDEX_KEYS.get(key) in cfg else key
        if key in cfg or key.startswith(("image", "video", "vision")):
            cfg[key] = value
        if isinstance(cfg.get("text_config"), dict) and key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            cfg["text_config"][key] = value
    if data_cfg:
        if cfg.get("model_type") == "qwen2_5_vl":  # training built video positions with the recipe's scale
            tps = VisionConfig.from_mapping(data_cfg.get("vision")).tokens_per_second
            cfg["vision_config"]["tokens_per_second"] = int(tps) if float(tps).is_integer() else tps
        write_processor_files(out_dir, data_cfg, cfg, tok_dir)
    if tensors is not None:
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
    """(model, model_cfg) from a training checkpoint or a dir holding model.safetensors + config.yaml."""
    import yaml
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    cfg_path, st_path = ckpt_dir / "config.yaml", ckpt_dir / "model.safetensors"
    if not st_path.exists():  # a training checkpoint (DCP), a checkpoints dir or a run dir
        from omniweave.train.checkpoint import load_model

        try:
            return load_model(ckpt_dir)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{ckpt_dir}: neither model.safetensors + config.yaml nor a training checkpoint ({e})") from e
    if not cfg_path.exists():
        raise FileNotFoundError(f"{ckpt_dir}: no config.yaml next to model.safetensors")
    cfg = yaml.safe_load(cfg_path.read_text())
    model_cfg = cfg.get("model", cfg)
    with torch.device("meta"):
        model = build_model(model_cfg)
    assign_state_dict(model, load_file(str(st_path)), str(st_path))
    return model, model_cfg


def recipe_data_cfg(ckpt_dir: str | Path, section: str = "data") -> dict | None:
    """The ``data:`` (or another) section of the recipe saved with a checkpoint (None for a plain dir)."""
    import yaml

    for cand in (Path(ckpt_dir), Path(ckpt_dir).resolve()):
        if (cand / "config.yaml").exists():
            return yaml.safe_load((cand / "config.yaml").read_text()).get(section)
    try:
        from omniweave.train.checkpoint import resolve_checkpoint

        return yaml.safe_load((resolve_checkpoint(ckpt_dir) / "config.yaml").read_text()).get(section)
    except (FileNotFoundError, OSError):
        return None


def hf_init_dir(ckpt_dir: str | Path) -> str | None:
    """The HF directory the checkpoint's run started from (``train.init_from``), if it was one."""
    init = (recipe_data_cfg(ckpt_dir, "train") or {}).get("init_from")
    return str(init) if init and (Path(str(init)) / "config.json").is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="training checkpoint (step dir, checkpoints/latest or run dir) "
                        "or a dir with model.safetensors + config.yaml")
    parser.add_argument("--output", required=True, help="HF directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast floating tensors (default: keep)")  # fmt: skip
    parser.add_argument("--adapter", action="store_true",
                        help="LoRA runs: write OUTPUT/adapter (a PEFT adapter) and OUTPUT/base (the base model; "
                             "skipped when the run started from a HF directory, train.init_from), instead of "
                             "merging the adapters into the weights")  # fmt: skip
    parser.add_argument("--format", choices=["auto", "hf", "lerobot"], default="auto",
                        help="hf: a transformers directory; lerobot: a lerobot Pi0.5 policy directory (config.json + "
                             "model.safetensors, VLA models only); auto (default): lerobot for a VLA model, else hf")
    parser.add_argument("--force", action="store_true",
                        help="write into an --output directory that is not empty (files of the same name are replaced)")


def check_output_dir(output: str, force: bool) -> set[str]:
    """The names already in ``output`` (a UserError when there are any and not ``force``): an export
    never mixes its files with a user's silently."""
    from omniweave.errors import UserError, first_few

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {output} is a file, not a directory")
    there = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if there and not force:
        shown = first_few(sorted(there), 5)
        raise UserError(f"--output {output} is not empty ({shown}); choose a new or empty directory, or pass --force "
                        "to write into it (files of the same name are replaced)")
    return there


def run(args: argparse.Namespace) -> int:
    import time

    from omniweave.models.lora import merge_adapters

    before, started = check_output_dir(args.output, args.force), time.time_ns()
    model, model_cfg = load_checkpoint_dir(args.checkpoint)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    data_cfg = recipe_data_cfg(args.checkpoint)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if args.adapter:
        from omniweave.models.hf.peft_adapter import export_adapter

        base = hf_init_dir(args.checkpoint)
        out = export_adapter(model, model_cfg, args.output, base_dir=base, data_cfg=data_cfg, dtype=dtype)
        print(f"exported the LoRA adapter of a {hf_model_type(model)} model to {out / 'adapter'} (PEFT), base: "
              + (f"{base} (train.init_from)" if base else str(out / "base")))
        return 0
    is_vla = hf_model_type(model) == "pi05"
    if args.format != "auto" and (args.format == "lerobot") != is_vla:
        from omniweave.errors import UserError

        raise UserError(f"--format {args.format}: this checkpoint is " + ("a VLA model; only --format lerobot "
                        "writes it" if is_vla else "not a VLA model (no action expert); use --format hf"))
    merged = merge_adapters(model)
    out = export_hf(model, model_cfg, args.output, dtype, data_cfg=data_cfg)
    if merged:
        print(f"merged {merged} LoRA adapters into the weights (--adapter exports them as a PEFT adapter instead)")
    written = sorted(p.name for p in out.iterdir() if p.name not in before or p.stat().st_mtime_ns >= started)
    print(f"exported {hf_model_type(model)} model ({n / 1e6:.1f}M parameters) to {out}: " + ", ".join(written)
          + (f"; left as they were: {len(set(before) - set(written))} other file(s) already there"
             if set(before) - set(written) else ""))  # fmt: skip
    if is_vla:
        print("note: a lerobot policy directory holds the weights and config.json only; lerobot's pre/post-processor "
              "files (normalisation statistics, tokenizer) come from its own dataset tooling")
    elif not data_cfg:
        print("note: no recipe data section next to the checkpoint, so no tokenizer, chat template or processor "
              "configs: AutoProcessor cannot load this directory")  # fmt: skip
    return 0
