"""InternVL (HF ``model_type: internvl``: InternVL3 / 3.5 ``-hf`` checkpoints): config and tensor
names, both directions.

Our model is ``OmniModel(foundation=Decoder, image_encoder=intern_vit, projector=pixel_shuffle_mlp)``
(components/intern_vit.py). The language model is whatever text family the checkpoint's
``text_config.model_type`` names (Qwen2 for InternVL3, Qwen3 for InternVL3.5, Llama…): its own
adapter maps it, with 1-D RoPE positions (``data.rope: 1d``).

    HF (checkpoint = transformers 5 in-memory names)              ours
    model.language_model.*                                        foundation.*
    lm_head.weight                                                foundation.lm_head.weight
    model.vision_tower.embeddings.{cls_token, position_embeddings}  image_encoder.{cls_token, position_embeddings}
    model.vision_tower.embeddings.patch_embeddings.projection     image_encoder.patch_embed
    model.vision_tower.encoder.layer.N.*                          image_encoder.blocks.N.*   (below)
    model.vision_tower.layernorm                                  image_encoder.final_norm   (use_mean_pooling: false)
    model.multi_modal_projector.*                                 projector.*

Inside a block: ``attention.{q,k,v}_proj`` are fused into ``attn.qkv`` (load) and split back
(export); ``attention.projection_layer`` -> ``attn.proj``, ``attention.{q,k}_norm`` ->
``attn.{q,k}_norm``, ``layernorm_before/after`` -> ``norm1/2``, ``mlp.fc1/2`` and ``lambda_1/2``
keep their names. A MoE decoder's experts (InternVL3.5-30B-A3B: Qwen3-MoE) are one tensor per
expert on disk, stacked on load and split on export (hf/experts.py). ``image_token_id`` /
``image_seq_length`` ride in ``foundation.extra_hf["vl"]``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from omniweave.models.hf.adapter import MultimodalAdapter, renamed
from omniweave.models.hf.experts import PerExpertTensors
from omniweave.models.hf.loading import adapter_for
from omniweave.models.registry import register

VISION = "model.vision_tower."
_BLOCK = re.compile(r"^model\.vision_tower\.encoder\.layer\.(\d+)\.(.+)$")
_BLOCK_NAMES = (("attention.projection_layer.", "attn.proj."), ("attention.q_norm.", "attn.q_norm."),
                ("attention.k_norm.", "attn.k_norm."), ("layernorm_before.", "norm1."),
                ("layernorm_after.", "norm2."), ("mlp.", "mlp."), ("lambda_1", "lambda_1"), ("lambda_2", "lambda_2"))  # fmt: skip
_QKV = re.compile(r"^model\.vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$")
_OUR_QKV = re.compile(r"^image_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_TOP = (("model.multi_modal_projector.", "projector."), ("model.language_model.", "foundation."),
        (VISION + "embeddings.patch_embeddings.projection.", "image_encoder.patch_embed."),
        (VISION + "embeddings.cls_token", "image_encoder.cls_token"),
        (VISION + "embeddings.position_embeddings", "image_encoder.position_embeddings"),
        (VISION + "layernorm.", "image_encoder.final_norm."))  # fmt: skip
VL_KEYS = ("image_token_id", "image_seq_length")
# transformers' save_pretrained writes the Llava checkpoint layout (what the released -hf checkpoints
# hold); its in-memory names are the second column. Both load; exports write the first.
_SAVED = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
          ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))  # fmt: skip


def _in_memory(hf_name: str) -> str:
    return renamed(hf_name, _SAVED) or hf_name


def _saved(hf_name: str) -> str:
    return renamed(hf_name, [(b, a) for a, b in _SAVED]) or hf_name


@register("hf", "internvl")
class InternVLAdapter(PerExpertTensors, MultimodalAdapter):
    config_sections = ("image_encoder", "projector")
    model_type = "internvl"
    architecture = "InternVLForConditionalGeneration"
    multimodal = True

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        text = dict(hf.get("text_config") or {})
        text.setdefault("model_type", "qwen2")
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        foundation = adapter_for(text["model_type"]).config_to_ours(text)
        if foundation.get("mrope_section"):
            raise ValueError("internvl: the text config has an M-RoPE mrope_section; InternVL's decoder uses 1-D RoPE")
        if hf.get("vision_feature_layer", -1) != -1 or hf.get("vision_feature_select_strategy", "default") != "default":
            raise ValueError("internvl: only vision_feature_layer -1 with select strategy 'default' is supported, got "
                             f"{hf.get('vision_feature_layer')} / {hf.get('vision_feature_select_strategy')!r}")
        foundation["extra_hf"] = {**foundation.get("extra_hf", {}), "vl": {k: hf[k] for k in VL_KEYS if k in hf}}
        ratio = float(hf.get("downsample_ratio", 0.5))
        merge = round(1 / ratio)
        if abs(merge * ratio - 1) > 1e-9:
            raise ValueError(f"internvl: downsample_ratio {ratio} is not 1/integer")
        v = dict(hf.get("vision_config") or {})
        if not v.get("use_absolute_position_embeddings", True) or v.get("use_mask_token", False):
            raise ValueError("internvl: vision towers without absolute position embeddings or with a mask token are not supported")
        image_size, patch = _side(v.get("image_size", 448)), _side(v.get("patch_size", 14))
        encoder = {
            "name": "intern_vit", "depth": v.get("num_hidden_layers", 24), "hidden_size": v.get("hidden_size", 1024),
            "num_heads": v.get("num_attention_heads", 16), "intermediate_size": v.get("intermediate_size", 4096),
            "in_channels": v.get("num_channels", 3), "patch_size": patch, "image_size": image_size,
            "norm": {"layer_norm": "layernorm", "rms_norm": "rmsnorm"}[v.get("norm_type", "layer_norm")],
            "norm_eps": v.get("layer_norm_eps", 1e-6), "qk_norm": bool(v.get("use_qk_norm", False)),
            "qkv_bias": bool(v.get("attention_bias", False)), "mlp": v.get("hidden_act", "gelu"),
            "layer_scale_init": v.get("layer_scale_init_value", 0.1), "final_norm": not v.get("use_mean_pooling", True),
            "merge_size": merge,
        }  # fmt: skip
        projector = {"name": "pixel_shuffle_mlp", "in_dim": encoder["hidden_size"], "out_dim": foundation["hidden_size"],
                     "merge_size": merge, "act": hf.get("projector_hidden_act", "gelu")}  # fmt: skip
        return {"foundation": foundation, "image_encoder": encoder, "projector": projector}

    def _config_to_hf(self, foundation, enc, proj) -> dict[str, Any]:
        if not hasattr(enc, "layer_scale_init") or not hasattr(proj, "act"):
            raise ValueError("an internvl export needs an intern_vit encoder and a pixel_shuffle_mlp projector")
        extra = dict(foundation.extra_hf)
        vl = extra.pop("vl", {})
        import dataclasses

        text = adapter_for(foundation.family).config_to_hf(dataclasses.replace(foundation, extra_hf=extra))
        text.pop("architectures", None)
        vision = {
            "model_type": "internvl_vision", "hidden_size": enc.hidden_size, "num_hidden_layers": enc.depth,
            "num_attention_heads": enc.num_heads, "intermediate_size": enc.intermediate_size,
            "num_channels": enc.in_channels, "patch_size": [enc.patch_size] * 2, "image_size": [enc.image_size] * 2,
            "norm_type": {"layernorm": "layer_norm", "rmsnorm": "rms_norm"}[enc.norm], "layer_norm_eps": enc.norm_eps,
            "use_qk_norm": enc.qk_norm, "attention_bias": enc.qkv_bias, "hidden_act": enc.mlp,
            "layer_scale_init_value": enc.layer_scale_init, "use_mean_pooling": not enc.final_norm,
            "use_absolute_position_embeddings": True, "use_mask_token": False,
        }  # fmt: skip
        tokens = enc.image_size // enc.patch_size // proj.merge_size
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "text_config": text, "vision_config": vision,
            "image_token_id": vl.get("image_token_id", 151667), "image_seq_length": vl.get("image_seq_length", tokens * tokens),
            "downsample_ratio": 1 / proj.merge_size, "projector_hidden_act": proj.act,
            "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
            "tie_word_embeddings": foundation.tie_word_embeddings,
        }  # fmt: skip

    # ---- tensor names (q / k / v fused by the whole-model hooks below) --------------
    def name_to_ours(self, hf_name: str) -> str | None:
        hf_name = _in_memory(hf_name)
        if hf_name == "lm_head.weight":
            return "foundation.lm_head.weight"
        if _QKV.match(hf_name):
            return None  # fused into attn.qkv by model_tensors_to_ours / assemble
        block = _BLOCK.match(hf_name)
        if block:
            inner = renamed(block[2], _BLOCK_NAMES)
            if inner is not None:
                return f"image_encoder.blocks.{block[1]}.{inner}"
        name = renamed(hf_name, _TOP)
        if name is None:
            raise KeyError(f"{self.model_type}: unexpected tensor {hf_name!r} in the checkpoint")
        return name

    def name_to_hf(self, name: str) -> str:
        """Our name -> the name transformers' ``save_pretrained`` writes (checkpoint layout)."""
        return _saved(self._in_memory_name(name))

    def _in_memory_name(self, name: str) -> str:
        if name == "foundation.lm_head.weight":
            return "lm_head.weight"
        m = re.match(r"^image_encoder\.blocks\.(\d+)\.(.+)$", name)
        if m:
            inner = renamed(m[2], [(b, a) for a, b in _BLOCK_NAMES])
            if inner is not None:
                return f"{VISION}encoder.layer.{m[1]}.{inner}"
        hf_name = renamed(name, [(b, a) for a, b in _TOP])
        if hf_name is None:
            raise KeyError(f"{self.model_type}: no HF name for {name!r}")
        return hf_name

    def model_name_to_ours(self, hf_name: str) -> str | None:
        return _OUR_QKV_NAME(hf_name) or self.name_to_ours(hf_name)

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """q / k / v of each block (loaded under their fused name's parts) concatenated."""
        out, parts = {}, {}
        for name, t in tensors.items():
            m = re.match(r"^(.+\.attn\.qkv\.(?:weight|bias))\.([qkv])$", name)
            if m:
                parts.setdefault(m[1], {})[m[2]] = t
            else:
                out[name] = t
        for name, qkv in parts.items():
            if set(qkv) != {"q", "k", "v"}:
                raise KeyError(f"{self.model_type}: {name} needs q, k and v projections, the checkpoint has {sorted(qkv)}")
            out[name] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
        return super().model_tensors_to_ours(out)  # a MoE decoder's per-expert tensors stacked (InternVL3.5-A3B)

    def model_tensors_to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        m = _OUR_QKV.match(name)
        if m:
            return [(_saved(f"{VISION}encoder.layer.{m[1]}.attention.{p}_proj.{m[2]}"), part.contiguous())
                    for p, part in zip("qkv", t.chunk(3))]  # fmt: skip
        return super().model_tensors_to_hf(name, t)  # experts one tensor each, the rest renamed

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """A fused ``attn.qkv`` read from its three HF tensors (``load_hf_into``); None otherwise."""
        m = _OUR_QKV.match(name)
        if not m:
            return super().assemble(name, has, read)  # a MoE decoder's experts, else None
        names = [f"{VISION}encoder.layer.{m[1]}.attention.{p}_proj.{m[2]}" for p in "qkv"]
        names = [n if has(n) else _saved(n) for n in names]
        missing = [n for n in names if not has(n)]
        if missing:
            raise KeyError(f"{self.model_type}: missing tensor(s) {missing}")
        return torch.cat([read(n) for n in names])

    def skip_on_export(self, model) -> set[str]:
        return {"foundation.lm_head.weight"} if model.foundation.config.tie_word_embeddings else set()


def _OUR_QKV_NAME(hf_name: str) -> str | None:
    """``…attn.qkv.weight.q`` for HF's ``…attention.q_proj.weight`` (a part model_tensors_to_ours fuses)."""
    m = _QKV.match(_in_memory(hf_name))
    return f"image_encoder.blocks.{m[1]}.attn.qkv.{m[3]}.{m[2]}" if m else None


def _side(v) -> int:
    """One side of a square ``image_size`` / ``patch_size`` (an int or [h, w])."""
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ValueError(f"internvl: non-square vision sizes {v} are not supported")
        return int(v[0])
    return int(v)


__all__ = ["InternVLAdapter"]
