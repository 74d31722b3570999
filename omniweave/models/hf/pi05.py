"""Pi0.5 checkpoints in lerobot's layout (lerobot 0.4.4 ``PI05Policy``; openpi's converted
``pi05_base``): a directory with ``config.json`` (lerobot's ``PI05Config``, ``"type": "pi05"``) and
``model.safetensors``, read into our VLAModel (PaliGemma backbone + action expert) and written back.

Names (the file's; lerobot-saved files prefix every key with ``model.``, openpi-converted ones do
not, both load; exports write the prefix, as lerobot does):

    paligemma_with_expert.paligemma.<PaliGemma in memory>    foundation / image_encoder / projector
        (model.vision_tower.vision_model.*, model.multi_modal_projector.linear.*,
         model.language_model.*, lm_head.weight; transformers-4 spellings too: paligemma.py maps them)
    paligemma_with_expert.gemma_expert.model.layers.N.*     action_expert.layers.N.*
    paligemma_with_expert.gemma_expert.model.norm.dense.*   action_expert.norm.dense.*
    action_in_proj / action_out_proj / time_mlp_in / time_mlp_out   action_expert.<same>

Strict both ways, because lerobot#1406 showed what silently unloaded keys do (a policy that trains
to a wrong loss and never succeeds): every file tensor must land in one of ours and every one of
ours must be filled, else an error naming the keys. Three tolerated exceptions, each what lerobot's
own loader does: the backbone's ``lm_head`` is tied to ``embed_tokens`` (either or both may be
stored: ``safetensors.save_model`` keeps only one of a tied pair, usually ``lm_head``); the
expert's ``lm_head`` is unused (lerobot sets its embeddings to None) and is skipped; the expert's
plain norm ``.weight`` (a pre-adaRMS layout) is dropped, as ``_fix_pytorch_state_dict_keys`` does.

Sizes come from the variant names (``get_gemma_config``): :data:`GEMMA_VARIANTS`; the SigLIP tower
and vocabulary are fixed in lerobot (:data:`PALIGEMMA`). Tests register tiny variants there.
Fields our model does not determine (input/output features, normalisation, optimiser settings …)
are carried in ``model.foundation.extra_hf["lerobot"]`` so an export writes them back unchanged.

Reached through the generic HF paths (loading.py reads ``type`` when there is no ``model_type``):
``load_hf(dir)`` / ``train.init_from=DIR`` load one; ``omniweave hf export`` of a VLA checkpoint
(``--format lerobot``) writes one (:func:`export_pi05`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from omniweave.models.components.siglip import siglip_hf_name
from omniweave.models.hf.gemma import GemmaAdapter
from omniweave.models.hf.paligemma import PaliGemmaAdapter
from omniweave.models.registry import register

PALI = "paligemma_with_expert.paligemma."
EXPERT = "paligemma_with_expert.gemma_expert."
HEADS = ("action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.")
TOWER = PALI + "model.vision_tower.vision_model."
_TOP = ("paligemma_with_expert.", *HEADS)
_OUR_QKV = re.compile(r"^image_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_QKV_PART = re.compile(r"^(image_encoder\.blocks\.\d+\.attn\.qkv\.(?:weight|bias))\.[qkv]$")
_EXPERT_PLAIN_NORM = re.compile(r"^model\.(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight$")

# lerobot 0.4.4 get_gemma_config (modeling_pi05.py): width, depth, mlp_dim, heads, kv heads, head_dim
GEMMA_VARIANTS: dict[str, dict[str, int]] = {
    "gemma_2b": {"width": 2048, "depth": 18, "mlp_dim": 16384, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
    "gemma_300m": {"width": 1024, "depth": 18, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
}
# what PaliGemmaWithExpertModel fixes: SigLIP so400m/14 at 224 px (intermediate 4304), vocabulary 257152
PALIGEMMA: dict[str, Any] = {
    "vocab_size": 257152,
    "vision": {"hidden_size": 1152, "intermediate_size": 4304, "depth": 27, "num_heads": 16, "patch_size": 14,
               "image_size": 224},
}  # fmt: skip
# PI05Config defaults for what our model does not determine (written when nothing was carried)
LEROBOT_DEFAULTS: dict[str, Any] = {
    "type": "pi05", "n_obs_steps": 1, "input_features": {}, "output_features": {},
    "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
    "max_state_dim": 32, "tokenizer_max_length": 200, "image_resolution": [224, 224], "empty_cameras": 0,
    "time_sampling_scale": 0.999, "time_sampling_offset": 0.001,
}  # fmt: skip
# the fields an export derives from the model (never carried)
_DERIVED = ("paligemma_variant", "action_expert_variant", "chunk_size", "max_action_dim",
            "num_inference_steps", "time_sampling_beta_alpha", "time_sampling_beta_beta", "min_period",
            "max_period", "dtype")  # fmt: skip


def is_pi05_config(cfg: dict) -> bool:
    return cfg.get("type") == "pi05" and "model_type" not in cfg


def _variant(name: str, what: str) -> dict[str, int]:
    if name not in GEMMA_VARIANTS:
        raise ValueError(f"pi05: {what} {name!r} is not one of lerobot's variants ({', '.join(GEMMA_VARIANTS)})")
    return GEMMA_VARIANTS[name]


def _variant_of(width: int, depth: int, mlp: int, heads: int, kv: int, head_dim: int, what: str) -> str:
    for name, v in GEMMA_VARIANTS.items():
        if (v["width"], v["depth"], v["mlp_dim"], v["num_heads"], v["num_kv_heads"], v["head_dim"]) == \
                (width, depth, mlp, heads, kv, head_dim):
            return name
    raise ValueError(f"a lerobot export needs the {what} to be one of lerobot's Gemma variants "
                     f"({', '.join(GEMMA_VARIANTS)}); this one is width {width}, depth {depth}, mlp {mlp}, "
                     f"{heads} heads over {kv} kv heads of {head_dim}")  # fmt: skip


def model_config(lr: dict[str, Any]) -> dict[str, Any]:
    """The recipe ``model:`` section of a lerobot ``PI05Config`` dict."""
    if lr.get("type") != "pi05":
        raise ValueError(f"not a lerobot Pi0.5 config: type {lr.get('type')!r}")
    for key, want in (("time_sampling_scale", 0.999), ("time_sampling_offset", 0.001)):
        if abs(float(lr.get(key, want)) - want) > 1e-12:  # our flow time is Beta(a, b)·0.999 + 0.001
            raise ValueError(f"pi05: {key} {lr[key]} is not supported (only {want})")
    back = _variant(lr.get("paligemma_variant", "gemma_2b"), "paligemma_variant")
    exp = _variant(lr.get("action_expert_variant", "gemma_300m"), "action_expert_variant")
    v = PALIGEMMA["vision"]
    if list(lr.get("image_resolution", [v["image_size"]] * 2)) != [v["image_size"]] * 2:
        raise ValueError(f"pi05: image_resolution {lr['image_resolution']}: the SigLIP tower's position table "
                         f"is for {v['image_size']} px images")  # fmt: skip
    text = {"vocab_size": PALIGEMMA["vocab_size"], "hidden_size": back["width"], "intermediate_size": back["mlp_dim"],
            "num_hidden_layers": back["depth"], "num_attention_heads": back["num_heads"],
            "num_key_value_heads": back["num_kv_heads"], "head_dim": back["head_dim"], "rms_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "tie_word_embeddings": True}  # fmt: skip
    foundation = GemmaAdapter().config_to_ours(text)
    foundation["extra_hf"] = {"lerobot": {k: val for k, val in lr.items() if k not in _DERIVED}}
    encoder = {"name": "siglip_vit", "depth": v["depth"], "hidden_size": v["hidden_size"], "num_heads": v["num_heads"],
               "intermediate_size": v["intermediate_size"], "in_channels": 3, "patch_size": v["patch_size"],
               "image_size": v["image_size"], "norm_eps": 1e-6, "mlp": "gelu_pytorch_tanh", "feature_layer": -1,
               "post_layernorm": True}  # fmt: skip
    expert = {"name": "flow_expert", "hidden_size": exp["width"], "intermediate_size": exp["mlp_dim"],
              "num_layers": exp["depth"], "num_heads": exp["num_heads"], "num_kv_heads": exp["num_kv_heads"],
              "head_dim": exp["head_dim"], "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
              "action_dim": int(lr.get("max_action_dim", 32)), "horizon": int(lr.get("chunk_size", 50)),
              "num_steps": int(lr.get("num_inference_steps", 10)), "time_min_period": float(lr.get("min_period", 4e-3)),
              "time_max_period": float(lr.get("max_period", 4.0)),
              "time_alpha": float(lr.get("time_sampling_beta_alpha", 1.5)),
              "time_beta": float(lr.get("time_sampling_beta_beta", 1.0))}  # fmt: skip
    return {"foundation": foundation, "image_encoder": encoder,
            "projector": {"name": "linear", "in_dim": v["hidden_size"], "out_dim": back["width"]},
            "action_expert": expert}  # fmt: skip


def config_to_lerobot(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` (a ``PI05Config``) of our VLAModel: sizes as variant names, the expert's
    flow settings, and the carried fields (else lerobot's defaults)."""
    if getattr(model, "action_expert", None) is None or getattr(model, "image_encoder", None) is None:
        raise ValueError("a lerobot Pi0.5 export needs a VLA model with an image encoder and an action expert")
    f, e, enc = model.foundation.config, model.action_expert.config, model.image_encoder.cfg
    v = PALIGEMMA["vision"]
    tower = tuple(getattr(enc, k, None) for k in ("depth", "hidden_size", "num_heads", "intermediate_size",
                                                  "patch_size", "image_size"))  # None: another tower's config
    if tower != tuple(v[k] for k in ("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size",
                                     "image_size")) or not getattr(enc, "post_layernorm", False):  # fmt: skip
        raise ValueError(f"a lerobot Pi0.5 export needs lerobot's SigLIP tower {v} with post_layernorm; this one "
                         f"is depth/width/heads/mlp/patch/size {tower}")  # fmt: skip
    if f.family != "gemma" or f.vocab_size != PALIGEMMA["vocab_size"] or not f.tie_word_embeddings:
        raise ValueError(f"a lerobot Pi0.5 export needs a Gemma backbone with tied embeddings and vocabulary "
                         f"{PALIGEMMA['vocab_size']}; this one is {f.family}, vocabulary {f.vocab_size}")  # fmt: skip
    out = {**LEROBOT_DEFAULTS, **dict(f.extra_hf.get("lerobot", {}))}
    dtype = dtype or next(model.parameters()).dtype
    out.update({
        "paligemma_variant": _variant_of(f.hidden_size, f.num_layers, f.intermediate_size, f.num_heads,
                                         f.num_kv_heads, f.head_dim, "backbone"),
        "action_expert_variant": _variant_of(e.hidden_size, e.num_layers, e.intermediate_size, e.num_heads,
                                             e.num_kv_heads, e.head_dim, "action expert"),
        "chunk_size": e.horizon, "n_action_steps": min(int(out.get("n_action_steps", e.horizon)), e.horizon),
        "max_action_dim": e.action_dim, "num_inference_steps": e.num_steps,
        "time_sampling_beta_alpha": e.time_alpha, "time_sampling_beta_beta": e.time_beta,
        "min_period": e.time_min_period, "max_period": e.time_max_period,
        "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
    })  # fmt: skip
    return out


def _unprefixed(name: str) -> str:
    """A file key without lerobot's ``model.`` prefix (openpi-converted files have none)."""
    return name[len("model."):] if name.startswith("model.") and name[len("model."):].startswith(_TOP) else name


@register("hf", "pi05")
class Pi05Adapter:
    holds_action_expert = True  # its directories carry the expert (a VLM directory leaves it fresh: loading.py)
    """The whole-model adapter interface of loading.py / export.py for lerobot's layout; the
    PaliGemma part goes through :class:`PaliGemmaAdapter` (both of its HF layouts)."""

    model_type = "pi05"

    def __init__(self):
        self.pal = PaliGemmaAdapter()

    def model_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        return model_config(hf)

    def model_config_to_hf(self, model) -> dict[str, Any]:
        return config_to_lerobot(model)

    # ---- names: file -> ours ------------------------------------------------------------
    def model_name_to_ours(self, hf_name: str) -> str | None:
        """Ours of a file key (a SigLIP q / k / v: ``…attn.qkv.<leaf>.<q|k|v>``, fused later);
        None for the tolerated unused tensors; KeyError for anything else."""
        name = _unprefixed(hf_name)
        if name.startswith(PALI):
            return self.pal.model_name_to_ours(name[len(PALI):])  # KeyError names the tensor
        if name.startswith(EXPERT):
            rest = name[len(EXPERT):]
            if rest == "lm_head.weight" or _EXPERT_PLAIN_NORM.match(rest):
                return None
            if rest.startswith("model.") and not rest.startswith("model.embed_tokens"):
                return "action_expert." + rest[len("model."):]
        elif name.startswith(HEADS):
            return "action_expert." + name
        raise KeyError(f"pi05: unexpected tensor {hf_name!r} in the checkpoint")

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """SigLIP q / k / v fused (paligemma.py); the tied embedding taken from ``lm_head`` where
        the file kept only that one of the pair."""
        out = self.pal.model_tensors_to_ours(tensors)
        emb, head = "foundation.embed_tokens.weight", "foundation.lm_head.weight"
        if head in out and emb not in out:
            out[emb] = out.pop(head)
        elif head in out and not torch.equal(out[head], out[emb]):
            raise ValueError("pi05: paligemma lm_head.weight differs from embed_tokens.weight; lerobot ties them")
        return out

    def check_checkpoint_names(self, hf_names, model: nn.Module) -> None:
        """Strictness on the file's side (loading.py calls it before assigning): every key maps to a
        tensor of ``model`` (unknown keys, or layers / blocks the model lacks, are named) and every
        tensor of ours has its key(s) (missing ones named as an export spells them). Also indexes
        the keys for :meth:`assemble`."""
        from omniweave.models.lora import is_adapter_name

        expected = {n for n in model.state_dict() if not is_adapter_name(n)}  # LoRA: a checkpoint is the base
        self._where: dict[Any, str] = {}  # ours, or (fused qkv, "q" | "k" | "v") -> file key
        stray = []
        for n in hf_names:
            try:
                ours = self.model_name_to_ours(n)
            except KeyError:
                stray.append(n)
                continue
            if ours is None:
                continue
            part = _QKV_PART.match(ours)
            if (ours if part is None else part[1]) not in expected:
                stray.append(n)
            else:
                self._where[ours if part is None else (part[1], ours[-1])] = n
        have = set(self._where) | {"foundation.lm_head.weight"}  # tied: either of the pair fills both
        if "foundation.lm_head.weight" in self._where:
            have.add("foundation.embed_tokens.weight")
        missing = []
        for ours in sorted(expected):
            m = _OUR_QKV.match(ours)
            if m is None and ours not in have:
                missing.append(self.model_name_to_hf(ours))
            elif m is not None:
                missing += [n for n, p in zip(self._qkv_names(m[1], m[2]), "qkv") if (ours, p) not in have]
        if stray or missing:
            raise KeyError("pi05 checkpoint does not match the model: "
                           + (f"{len(stray)} tensor(s) the model has no place for: {stray[:8]}" if stray else "")
                           + ("; " if stray and missing else "")
                           + (f"{len(missing)} tensor(s) missing: {missing[:8]}" if missing else ""))  # fmt: skip

    # ---- names: ours -> file ------------------------------------------------------------
    def _qkv_names(self, layer: str, leaf: str) -> list[str]:
        return [f"model.{TOWER}encoder.layers.{layer}.self_attn.{p}_proj.{leaf}" for p in "qkv"]

    def model_name_to_hf(self, name: str) -> str:
        """The key lerobot saves for one of our tensors (a fused SigLIP qkv: its q key; the three are
        :meth:`model_tensors_to_hf`'s and :meth:`assemble`'s)."""
        m = _OUR_QKV.match(name)
        if m:
            return self._qkv_names(m[1], m[2])[0]
        if name == "foundation.lm_head.weight":
            return f"model.{PALI}lm_head.weight"
        if name.startswith("foundation."):
            return f"model.{PALI}model.language_model.{name[len('foundation.'):]}"
        if name.startswith("projector."):
            return f"model.{PALI}model.multi_modal_projector.{name[len('projector.'):]}"
        if name.startswith("image_encoder."):
            (hf,) = siglip_hf_name(name[len("image_encoder."):])
            return f"model.{TOWER}{hf}"
        if name.startswith("action_expert."):
            rest = name[len("action_expert."):]
            return f"model.{rest}" if rest.startswith(HEADS) else f"model.{EXPERT}model.{rest}"
        raise KeyError(f"pi05: no lerobot name for {name!r}")

    def model_tensors_to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor) pairs: a fused SigLIP qkv split into q, k, v; the tied embedding written
        under both names (a tied model's state dict lists both; any lerobot loader, strict or not, finds it)."""
        m = _OUR_QKV.match(name)
        if m:
            return list(zip(self._qkv_names(m[1], m[2]), t.chunk(3)))
        if name == "foundation.embed_tokens.weight":
            return [(self.model_name_to_hf(name), t), (self.model_name_to_hf("foundation.lm_head.weight"), t)]
        return [(self.model_name_to_hf(name), t)]

    def skip_on_export(self, model) -> set[str]:
        return {"foundation.lm_head.weight"}  # written with the embedding (always tied in Pi0.5)

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """``load_hf_into`` (train.init_from), after :meth:`check_checkpoint_names` indexed the file:
        a fused SigLIP qkv, or a tensor whose key the file spells otherwise than an export does (no
        ``model.`` prefix, transformers-4 names, the embedding stored as ``lm_head``), read whole;
        None where the export's key is there (read sliced)."""
        where = getattr(self, "_where", None)
        if where is None:
            raise RuntimeError("pi05: check_checkpoint_names must index the checkpoint before assemble")
        m = _OUR_QKV.match(name)
        if m:
            return torch.cat([read(where[(name, p)]) for p in "qkv"])
        key = where.get(name)
        if key is None and name == "foundation.embed_tokens.weight":
            key = where.get("foundation.lm_head.weight")
        return None if key is None or key == self.model_name_to_hf(name) else read(key)


def is_pi05_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and is_pi05_config(json.loads(cfg.read_text()))


def load_pi05(path: str | Path, dtype: torch.dtype | None = torch.float32, device="cpu") -> tuple[nn.Module, dict]:
    """(VLAModel, recipe ``model:`` section) of a lerobot Pi0.5 directory; = ``loading.load_hf``."""
    from omniweave.models.hf.loading import load_hf

    if not is_pi05_dir(path):
        raise ValueError(f"{path}: no config.json with \"type\": \"pi05\" (a lerobot Pi0.5 policy directory)")
    return load_hf(path, dtype, device)


def export_pi05(model: nn.Module, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``out_dir/config.json`` (PI05Config) + ``out_dir/model.safetensors`` (lerobot's keys)."""
    from safetensors.torch import save_file

    from omniweave.models.hf.export import hf_tensors

    tensors = hf_tensors(model, dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_to_lerobot(model, next(iter(tensors.values())).dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


__all__ = ["GEMMA_VARIANTS", "PALIGEMMA", "Pi05Adapter", "config_to_lerobot", "export_pi05", "is_pi05_dir",
           "load_pi05", "model_config"]
