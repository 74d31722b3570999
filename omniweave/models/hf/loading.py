"""Build an omniweave model from a Hugging Face directory (config.json + safetensors).

The model is created on the meta device, then every tensor is read once from the safetensors
files (sharded through ``model.safetensors.index.json`` or a single ``model.safetensors``),
renamed by the family adapter and assigned in place, so weights are never materialised twice.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from omniweave.models.lora import is_adapter_name
from omniweave.models.registry import build_model, lookup

log = logging.getLogger("omniweave.hf")


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{hf_dir}: no config.json (is this a Hugging Face model directory?)")
    return json.loads(path.read_text())


def config_model_type(hf_cfg: dict) -> str:
    """The adapter key of a config.json: HF's ``model_type``, else lerobot's policy ``type`` (pi05.py)."""
    return str(hf_cfg.get("model_type") or hf_cfg.get("type") or "?")


def check_names(adapter, hf_names, model: nn.Module) -> None:
    """An adapter's own strictness over the checkpoint's keys against the model (Pi0.5: every key
    must land somewhere), where it has one."""
    if hasattr(adapter, "check_checkpoint_names"):
        adapter.check_checkpoint_names(list(hf_names), model)


def fresh_action_expert(model: nn.Module, adapter, hf_dir) -> set[str]:
    """The parameters a directory leaves at their initialisation: a VLM directory (PaliGemma,
    Qwen2.5-VL…) initialising a VLA model (models/vla.py) gives the backbone; the action expert
    keeps its fresh weights, as Pi0.5 starts from PaliGemma (said once in the log). A Pi0.5
    directory (``holds_action_expert``) gives everything."""
    if getattr(model, "action_expert", None) is None or getattr(adapter, "holds_action_expert", False):
        return set()
    names = {n for n, _ in model.named_parameters() if n.startswith("action_expert.")}
    log.warning("%s: a vision-language model's directory initialises the backbone; the action expert's %d "
                "tensors keep their fresh initialisation", hf_dir, len(names))
    return names


def adapter_for(model_type: str):
    """The registered ``hf`` adapter instance of a HF ``model_type``."""
    try:
        cls, _ = lookup("hf", model_type)
    except KeyError as e:
        raise KeyError(f"HF model_type {model_type!r} is not supported: {e.args[0]}") from None
    return cls()


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (hf_dir / s).exists()]
        if missing:
            raise FileNotFoundError(f"{hf_dir}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [hf_dir / s for s in shards]
    single = hf_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json")


def iter_safetensors(hf_dir: str | Path, device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in safetensors_files(hf_dir):
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def assign_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor], source: str, dtype=None) -> None:
    """Assign ``tensors`` (our names) into a meta-initialised model; errors name the tensors."""
    expected = model.state_dict(keep_vars=True)
    tied = {n for n in expected if n.endswith("lm_head.weight") and _is_tied(model, n)}
    for n in tied:  # tied heads are stored once, as the embedding
        emb = n.replace("lm_head.weight", "embed_tokens.weight")
        tensors.setdefault(n, tensors.get(emb))
    missing = sorted(n for n in expected if tensors.get(n) is None)
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise KeyError(f"{source}: missing tensors {missing[:8]}{'…' if len(missing) > 8 else ''}; "
                       f"unexpected tensors {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}")  # fmt: skip
    for n, t in tensors.items():
        if tuple(t.shape) != tuple(expected[n].shape):
            raise ValueError(f"{source}: tensor {n!r} has shape {tuple(t.shape)}, model expects {tuple(expected[n].shape)}")
        if dtype is not None and t.is_floating_point():
            tensors[n] = t.to(dtype)
    model.load_state_dict(tensors, strict=True, assign=True)
    for m in model.modules():
        if hasattr(m, "tie_weights"):
            m.tie_weights()


def _is_tied(model: nn.Module, head_name: str) -> bool:
    owner = model if head_name == "lm_head.weight" else model.get_submodule(head_name[: -len(".lm_head.weight")])
    return bool(getattr(getattr(owner, "config", None), "tie_word_embeddings", False))


def load_hf(hf_dir: str | Path, dtype: torch.dtype | None = torch.float32, device="cpu") -> tuple[nn.Module, dict]:
    """(model, model_cfg) from a HF directory; model_cfg is the recipe ``model:`` section."""
    hf_cfg = read_hf_config(hf_dir)
    adapter = adapter_for(config_model_type(hf_cfg))
    model_cfg = adapter.model_config(hf_cfg)
    with torch.device("meta"):
        model = build_model(model_cfg)
    check_names(adapter, _weight_files(Path(hf_dir)), model)
    tensors: dict[str, torch.Tensor] = {}
    unused = []
    for hf_name, t in iter_safetensors(hf_dir, device):
        ours = adapter.model_name_to_ours(hf_name)
        if ours is not None:
            tensors[ours] = t
        else:
            unused.append(hf_name)
    log_unused(adapter, unused)
    if hasattr(adapter, "model_tensors_to_ours"):  # e.g. per-expert MoE tensors stacked into 3-D ones
        tensors = adapter.model_tensors_to_ours(tensors)
    assign_state_dict(model, tensors, str(hf_dir), dtype)
    compute_tables(model, device)
    return model, model_cfg


def log_unused(adapter, hf_names) -> None:
    """One log line for the checkpoint's tensors no model part of ours takes (multi-token
    prediction layers: transformers drops them too); rotary tables are not worth a line."""
    unused = [n for n in hf_names if not n.endswith("inv_freq") and adapter.model_name_to_ours(n) is None]
    if unused:
        heads = sorted({n.split(".")[0] for n in unused})
        log.warning("%s: %d checkpoint tensor(s) not loaded (%s; e.g. %s): omniweave neither trains nor exports them",
                    adapter.model_type, len(unused), ", ".join(f"{h}.*" for h in heads), unused[0])


@torch.no_grad()
def compute_tables(model: nn.Module, device="cpu") -> None:
    """Buffers no checkpoint holds (non-persistent tables computed at init, e.g. the Qwen2.5-Omni
    audio tower's sinusoidal positions) are still on the meta device after ``assign_state_dict``:
    allocate them and let their owner (``init_tables``) recompute them."""
    for owner in model.modules():
        if not hasattr(owner, "init_tables") or not any(b.is_meta for b in owner.buffers()):
            continue
        for m in owner.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty_like(b, device=device)
        owner.init_tables()


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, or the single file)."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in safetensors_files(hf_dir):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: f for k in st.keys()})
    return out


@torch.no_grad()
def load_hf_into(model: nn.Module, hf_dir: str | Path) -> int:
    """Copy a HF checkpoint into an already materialised model, in place; returns tensors read.

    Parameters sharded by FSDP2 (DTensors) read only their own slice of each tensor from the
    safetensors files (``get_slice``), so every rank reads just what it owns and nobody holds
    the full model. Shapes are checked against the model; errors name the tensor. LoRA adapters
    (models/lora.py) are not in a HF model directory: they are left as they are."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    hf_dir = Path(hf_dir)
    hf_cfg = read_hf_config(hf_dir)
    adapter = adapter_for(config_model_type(hf_cfg))
    adapter.model_config(hf_cfg)  # an adapter whose tensor layout depends on the sizes reads them (Qwen3-Next)
    where = _weight_files(hf_dir)
    check_names(adapter, where, model)
    log_unused(adapter, where)
    skip = adapter.skip_on_export(model) if hasattr(adapter, "skip_on_export") else set()
    fresh = fresh_action_expert(model, adapter, hf_dir)
    tensors = {n: p for n, p in model.named_parameters()  # LoRA: a HF dir is the base
               if not is_adapter_name(n) and n not in fresh}
    persistent = model.state_dict(keep_vars=True)  # checkpointed buffers (DeepSeek-V3's e_score_correction_bias)
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    missing = []
    handles: dict[Path, Any] = {}

    def handle(hf_name: str):
        f = where[hf_name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt").__enter__()
        return handles[f]

    assemble = getattr(adapter, "assemble", None)  # a tensor of ours built from several HF ones
    try:
        for name, t in tensors.items():
            hf_name = None if name in skip else adapter.model_name_to_hf(name)
            if hf_name is None:
                continue
            whole = None if assemble is None else assemble(name, where.__contains__, lambda n: handle(n).get_tensor(n))
            if whole is not None:  # read whole (e.g. one layer's experts), then this rank's slice
                sl = whole
            elif hf_name not in where:
                missing.append(hf_name)
                continue
            else:
                sl = handle(hf_name).get_slice(hf_name)
            got = tuple(sl.get_shape() if whole is None else whole.shape)
            if got != tuple(t.shape):
                raise ValueError(f"{hf_dir}: tensor {hf_name!r} has shape {got}, model expects {tuple(t.shape)} ({name})")
            if isinstance(t, DTensor):
                local = t.to_local()
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                if local.numel():
                    local.copy_(sl[index])
            else:
                t.copy_(sl[:])
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    if missing:
        raise KeyError(f"{hf_dir}: missing tensors {missing[:8]}{'…' if len(missing) > 8 else ''}")
    return len(tensors) - len(missing)
