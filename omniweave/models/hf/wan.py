"""Wan 2.1 T2V and I2V checkpoints in diffusers' layout (``WanTransformer3DModel``, diffusers 0.42.1) <-> our
:class:`~omniweave.models.components.wan_dit.WanDiT`.

Our names are diffusers' except five renames and two reshapes:

    attn{1,2}.to_out.0.*        attn{1,2}.to_out.*
    ffn.net.0.proj.*            ffn.fc1.*
    ffn.net.2.*                 ffn.fc2.*
    condition_embedder.image_embedder.ff.net.0.proj.*   ....image_embedder.ff.fc1.*   (I2V)
    condition_embedder.image_embedder.ff.net.2.*        ....image_embedder.ff.fc2.*   (I2V)
    patch_embedding.weight      Conv3d [D, C, pt, ph, pw]  <->  Linear [D, C·pt·ph·pw] (flatten, same order)
    proj_out.weight / .bias     rows (pt, ph, pw, C) channel-last  <->  rows (C, pt, ph, pw), our patchify order

I2V (``image_dim`` / ``added_kv_proj_dim`` / ``pos_embed_seq_len`` in config.json) adds
``condition_embedder.image_embedder.{norm1,norm2,pos_embed}`` and ``blocks.N.attn2.{add_k_proj,
add_v_proj,norm_added_k}`` under the same names. Strict both ways: a key neither side knows is an
error naming it (I2V keys against a T2V config say so). diffusers' ``norm_added_q`` (ignored by its own
loader, ``_keys_to_ignore_on_load_unexpected``) is dropped. RoPE tables are not in either state dict.

diffusers quirk: its ``qk_norm`` config field is passed to the blocks and never read; every Wan
attention has q/k RMSNorm across heads whatever it says, so :func:`config_from_diffusers` accepts
any value (ours always has the norms, like diffusers).

Directories: :func:`load_wan_dit` reads a diffusers ``transformer/`` folder (``config.json`` with
``_class_name: WanTransformer3DModel`` + ``diffusion_pytorch_model.safetensors``, or the sharded
``diffusion_pytorch_model-0000i-of-0000n.safetensors`` + ``diffusion_pytorch_model.safetensors.index.json``)
into a :class:`WanDiT`, strictly; :func:`save_wan_dit` writes one that diffusers' ``from_pretrained``
loads (checked by tests/test_wan_hf.py, and by ``omniweave hf verify DIR``: hf/verify_wan.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig

DIFFUSERS_CLASS = "WanTransformer3DModel"
DIFFUSERS_VERSION = "0.42.1"  # the layout save_wan_dit writes is the one checked against this diffusers
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

_RENAMES = [  # (diffusers, ours) name fragments, whole dotted components
    (re.compile(r"^(blocks\.\d+\.attn[12]\.to_out)\.0\.(weight|bias)$"), r"\1.\2"),
    (re.compile(r"^(blocks\.\d+\.ffn)\.net\.0\.proj\.(weight|bias)$"), r"\1.fc1.\2"),
    (re.compile(r"^(blocks\.\d+\.ffn)\.net\.2\.(weight|bias)$"), r"\1.fc2.\2"),
    (re.compile(r"^(condition_embedder\.image_embedder\.ff)\.net\.0\.proj\.(weight|bias)$"), r"\1.fc1.\2"),
    (re.compile(r"^(condition_embedder\.image_embedder\.ff)\.net\.2\.(weight|bias)$"), r"\1.fc2.\2"),
]
_BACK = [
    (re.compile(r"^(blocks\.\d+\.attn[12]\.to_out)\.(weight|bias)$"), r"\1.0.\2"),
    (re.compile(r"^(blocks\.\d+\.ffn)\.fc1\.(weight|bias)$"), r"\1.net.0.proj.\2"),
    (re.compile(r"^(blocks\.\d+\.ffn)\.fc2\.(weight|bias)$"), r"\1.net.2.\2"),
    (re.compile(r"^(condition_embedder\.image_embedder\.ff)\.fc1\.(weight|bias)$"), r"\1.net.0.proj.\2"),
    (re.compile(r"^(condition_embedder\.image_embedder\.ff)\.fc2\.(weight|bias)$"), r"\1.net.2.\2"),
]
_SAME = re.compile(
    r"^(scale_shift_table|patch_embedding\.bias|proj_out\.(weight|bias)"
    r"|condition_embedder\.(time_embedder|text_embedder)\.linear_[12]\.(weight|bias)"
    r"|condition_embedder\.time_proj\.(weight|bias)"
    r"|condition_embedder\.image_embedder\.(norm[12]\.(weight|bias)|pos_embed)"
    r"|blocks\.\d+\.(scale_shift_table|norm2\.(weight|bias)"
    r"|attn[12]\.(to_[qkv]\.(weight|bias)|norm_[qk]\.weight)"
    r"|attn2\.(add_[kv]_proj\.(weight|bias)|norm_added_k\.weight)))$"
)
_I2V = re.compile(r"(add_[kv]_proj|norm_added_k|image_embedder)")
_IGNORED = re.compile(r"\.norm_added_q\.")

_I2V_FIELDS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
_CONFIG_FIELDS = ("in_channels", "out_channels", "patch_size", "num_attention_heads", "attention_head_dim",
                  "text_dim", "freq_dim", "ffn_dim", "num_layers", "eps", "rope_max_seq_len", "cross_attn_norm",
                  *_I2V_FIELDS)


def _rename(key: str, rules) -> str | None:
    for pattern, repl in rules:
        if pattern.match(key):
            return pattern.sub(repl, key)
    return None


def _refuse(bad: list[str], side: str) -> None:
    if not bad:
        return
    i2v = [k for k in bad if _I2V.search(k)]
    hint = (" (Wan I2V image-conditioning weights: the config needs image_dim and added_kv_proj_dim, or the "
            "model lacks them)") if i2v else ""
    raise KeyError(f"{len(bad)} {side} key(s) with no counterpart{hint}: {', '.join(sorted(bad)[:8])}"
                   + (" ..." if len(bad) > 8 else ""))


def _proj_out_rows(t: Tensor, volume: int, to_ours: bool) -> Tensor:
    """Reorder proj_out's output rows between (pt·ph·pw, C) (diffusers) and (C, pt·ph·pw) (ours)."""
    rows = t.shape[0]
    if rows % volume:
        raise ValueError(f"proj_out has {rows} rows, not a multiple of the patch volume {volume}")
    c = rows // volume
    split = (volume, c) if to_ours else (c, volume)
    return t.reshape(*split, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def diffusers_to_ours(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A diffusers ``WanTransformer3DModel`` state dict -> :class:`WanDiT`'s (strict; the patch size
    is read from the Conv3d weight's kernel)."""
    conv = state_dict.get("patch_embedding.weight")
    if conv is None or conv.dim() != 5:
        raise KeyError("patch_embedding.weight [D, C, pt, ph, pw] (the Conv3d) is needed to read the patch size")
    volume = math.prod(conv.shape[2:])
    out, bad = {}, []
    for key, t in state_dict.items():
        if _IGNORED.search(key):
            continue
        if key == "patch_embedding.weight":
            out[key] = t.flatten(1)
        elif key.startswith("proj_out."):
            out[key] = _proj_out_rows(t, volume, to_ours=True)
        elif (new := _rename(key, _RENAMES)) is not None:
            out[new] = t
        elif _SAME.match(key):
            out[key] = t
        else:
            bad.append(key)
    _refuse(bad, "diffusers")
    return out


def ours_to_diffusers(state_dict: dict[str, Tensor], patch_size=(1, 2, 2)) -> dict[str, Tensor]:
    """:class:`WanDiT`'s state dict -> diffusers ``WanTransformer3DModel``'s. ``patch_size`` (pt, ph,
    pw) cannot be read off a Linear patch embedding; every Wan transformer uses (1, 2, 2)."""
    pt, ph, pw = patch_size
    volume = pt * ph * pw
    out, bad = {}, []
    for key, t in state_dict.items():
        if key == "patch_embedding.weight":
            d, cols = t.shape
            if cols % volume:
                raise ValueError(f"patch_embedding.weight {tuple(t.shape)} does not match patch_size {patch_size}")
            out[key] = t.reshape(d, cols // volume, pt, ph, pw)
        elif key.startswith("proj_out."):
            out[key] = _proj_out_rows(t, volume, to_ours=False)
        elif (new := _rename(key, _BACK)) is not None:
            out[new] = t
        elif _SAME.match(key):
            out[key] = t
        else:
            bad.append(key)
    _refuse(bad, "omniweave")
    return out


def config_from_diffusers(config: dict[str, Any], **overrides) -> WanDiTConfig:
    """``WanDiTConfig`` from a diffusers ``config.json`` dict (``_``-prefixed bookkeeping ignored);
    ``overrides`` set our own fields (``attn_backend`` …). Unknown fields are refused."""
    known = set(_CONFIG_FIELDS) | {"qk_norm"}
    unknown = sorted(k for k in config if not k.startswith("_") and k not in known)
    if unknown:
        raise ValueError(f"diffusers Wan config has fields WanDiT does not know: {unknown}")
    kwargs = {k: config[k] for k in _CONFIG_FIELDS if k in config}
    if kwargs.get("out_channels") is None and "in_channels" in kwargs:  # diffusers: out_channels or in_channels
        kwargs["out_channels"] = kwargs["in_channels"]
    if kwargs.get("out_channels") is None:
        kwargs.pop("out_channels", None)
    if "patch_size" in kwargs:
        kwargs["patch_size"] = tuple(kwargs["patch_size"])
    return WanDiTConfig(**{**kwargs, **overrides})


def config_to_diffusers(cfg: WanDiTConfig) -> dict[str, Any]:
    """The diffusers ``WanTransformer3DModel`` keyword arguments of our config (T2V or I2V)."""
    if cfg.rope_theta != 10000.0:
        raise ValueError(f"rope_theta {cfg.rope_theta}: diffusers' Wan fixes it at 10000")
    out = {k: getattr(cfg, k) for k in _CONFIG_FIELDS}
    out["qk_norm"] = "rms_norm_across_heads"
    return out


# ----------------------------------------------------------------------------- directories


def diffusers_weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a diffusers model folder: the index's ``weight_map`` when
    ``diffusion_pytorch_model.safetensors.index.json`` exists (sharded), else the single file."""
    from safetensors import safe_open

    path = Path(path)
    index = path / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{path}: shard(s) named by {WEIGHTS_INDEX_NAME} are missing: {missing}")
        return {k: path / f for k, f in weight_map.items()}
    single = path / WEIGHTS_NAME
    if not single.is_file():
        raise FileNotFoundError(f"{path}: neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} (a diffusers model folder)")
    with safe_open(str(single), framework="pt") as st:
        return {k: single for k in st.keys()}


def read_diffusers_weights(path: str | Path, device="cpu") -> dict[str, Tensor]:
    """Every tensor of a diffusers model folder (single file or sharded), diffusers' names."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, f in diffusers_weight_files(path).items():
        by_file.setdefault(f, []).append(name)
    out = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            out.update({n: st.get_tensor(n) for n in names})
    return out


def read_diffusers_config(path: str | Path, class_name: str) -> dict[str, Any]:
    """``config.json`` of a diffusers model folder, checked to be ``class_name``'s."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (a diffusers {class_name} folder)")
    config = json.loads(cfg_path.read_text())
    found = config.get("_class_name", class_name)
    if found != class_name:
        raise ValueError(f"{path}: config.json is a {found}, not a {class_name}")
    return config


def load_wan_dit(path: str | Path, dtype: torch.dtype | None = torch.float32, device="cpu",
                 **overrides) -> WanDiT:
    """Our :class:`WanDiT` from a diffusers ``WanTransformer3DModel`` folder, strictly (every tensor
    used, none missing; shapes checked), in ``dtype`` (default float32, as diffusers' ``from_pretrained``;
    None: as stored) on ``device``, eval mode. ``overrides``: our own config fields (``attn_backend``).
    T2V or I2V (``image_dim`` set), as the folder's config.json says."""
    from omniweave.models.hf.loading import assign_state_dict

    config = read_diffusers_config(path, DIFFUSERS_CLASS)
    cfg = config_from_diffusers(config, **overrides)
    with torch.device("meta"):
        model = WanDiT(cfg)
    raw = read_diffusers_weights(path, device)
    conv = raw.get("patch_embedding.weight")
    if conv is not None and tuple(conv.shape[2:]) != cfg.patch_size:
        raise ValueError(f"{path}: config patch_size {cfg.patch_size} but patch_embedding's kernel is "
                         f"{tuple(conv.shape[2:])}")
    assign_state_dict(model, diffusers_to_ours(raw), str(path), dtype)
    return model.to(device).eval()


def save_wan_dit(model: WanDiT, path: str | Path, max_shard_size: int = 10 * 10**9,
                 dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as a diffusers ``WanTransformer3DModel`` folder (what ``from_pretrained`` and a
    Wan pipeline's ``transformer/`` read): ``config.json`` (``_class_name``, ``_diffusers_version``,
    the I2V fields null for T2V) and the weights in diffusers' names and layouts, in one
    ``diffusion_pytorch_model.safetensors`` or, above ``max_shard_size`` bytes (diffusers' 10 GB), in
    shards + ``diffusion_pytorch_model.safetensors.index.json``. ``dtype`` casts floating tensors (None:
    as they are). Tensors are gathered to the CPU (a DTensor's full tensor: under FSDP every rank must
    call this, as the gather is collective; give each rank its own ``path`` or write from one)."""
    from safetensors.torch import save_file

    cfg = model.config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        t = t.detach().to("cpu")
        state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    tensors = {k: v.contiguous() for k, v in ours_to_diffusers(state, cfg.patch_size).items()}
    config = {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": DIFFUSERS_VERSION, **config_to_diffusers(cfg),
              "patch_size": list(cfg.patch_size)}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for stale in [path / WEIGHTS_NAME, path / WEIGHTS_INDEX_NAME, *path.glob("diffusion_pytorch_model-*.safetensors")]:
        stale.unlink(missing_ok=True)  # a previous export's files would shadow or contradict this one
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return path


def is_diffusers_dit_dir(path: str | Path) -> Path | None:
    """The ``WanTransformer3DModel`` folder of ``path`` (itself, or a pipeline root's ``transformer/``), or None."""
    for folder in (Path(path), Path(path) / "transformer"):
        cfg = folder / "config.json"
        if cfg.is_file() and json.loads(cfg.read_text()).get("_class_name") == DIFFUSERS_CLASS:
            return folder
    return None


def load_wan_dit_into(generator: WanDiT, path: str | Path) -> None:
    """``train.init_from`` a diffusers Wan transformer folder into a built (possibly FSDP-sharded)
    generator: its config must have the recipe generator's sizes (a clear error names the fields
    that differ); every tensor is read on each rank, mapped to our names and placed by
    ``set_model_state_dict`` (each rank keeps its shards). Every rank holds the whole checkpoint in
    CPU memory for a moment: ~5.7 GB for 1.3B in fp32."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    folder = is_diffusers_dit_dir(path)
    if folder is None:
        raise FileNotFoundError(f"{path}: not a diffusers {DIFFUSERS_CLASS} folder (nor a pipeline root)")
    theirs = config_from_diffusers(read_diffusers_config(folder, DIFFUSERS_CLASS))
    ours = generator.config
    differ = [f"{f}: {getattr(theirs, f)} there, {getattr(ours, f)} here" for f in _CONFIG_FIELDS
              if hasattr(ours, f) and getattr(theirs, f) != getattr(ours, f)]
    if differ:
        raise ValueError(f"train.init_from={path}: the checkpoint's transformer differs from model.generator: "
                         + "; ".join(differ))
    state = diffusers_to_ours(read_diffusers_weights(folder))
    set_model_state_dict(generator, state, options=StateDictOptions(full_state_dict=True, strict=True))
