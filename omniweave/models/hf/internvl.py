"""InternVL (HF ``model_type: internvl``: InternVL3 / 3.5 ``-hf`` checkpoints): config and tensor
names, both directions.

Our model is ``OmniModel(foundation=Decoder, image_encoder=intern_vit, projector=pixel_shuffle_mlp)``
(components/intern_vit.py). The language model is whatever text family the checkpoint's
``text_config.model_type`` names (Qwen2 for InternVL3, Qwen3 for InternVL3.5, Llama…): its own
adapter maps it, with 1-D RoPE positions (``data.rope: 1d``).

    HF (in-memory names; the checkpoint layout: llava_layout.py)   ours
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
from typing import Any

from omniweave.models.hf.adapter import renamed
from omniweave.models.hf.llava_layout import LlavaLayoutAdapter, side
from omniweave.models.registry import register

VISION = "model.vision_tower."
_BLOCK = re.compile(r"^model\.vision_tower\.encoder\.layer\.(\d+)\.(.+)$")
_BLOCK_NAMES = (("attention.projection_layer.", "attn.proj."), ("attention.q_norm.", "attn.q_norm."),
                ("attention.k_norm.", "attn.k_norm."), ("layernorm_before.", "norm1."),
                ("layernorm_after.", "norm2."), ("mlp.", "mlp."), ("lambda_1", "lambda_1"), ("lambda_2", "lambda_2"))  # fmt: skip
_TOP = (("model.multi_modal_projector.", "projector."),
        (VISION + "embeddings.patch_embeddings.projection.", "image_encoder.patch_embed."),
        (VISION + "embeddings.cls_token", "image_encoder.cls_token"),
        (VISION + "embeddings.position_embeddings", "image_encoder.position_embeddings"),
        (VISION + "layernorm.", "image_encoder.final_norm."))  # fmt: skip
VL_KEYS = ("image_token_id", "image_seq_length")


@register("hf", "internvl")
class InternVLAdapter(LlavaLayoutAdapter):
    model_type = "internvl"
    architecture = "InternVLForConditionalGeneration"

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        foundation = self.text_foundation(hf, VL_KEYS)
        if hf.get("vision_feature_layer", -1) != -1 or hf.get("vision_feature_select_strategy", "default") != "default":
            raise ValueError("internvl: only vision_feature_layer -1 with select strategy 'default' is supported, got "
                             f"{hf.get('vision_feature_layer')} / {hf.get('vision_feature_select_strategy')!r}")
        ratio = float(hf.get("downsample_ratio", 0.5))
        merge = round(1 / ratio)
        if abs(merge * ratio - 1) > 1e-9:
            raise ValueError(f"internvl: downsample_ratio {ratio} is not 1/integer")
        v = dict(hf.get("vision_config") or {})
        if not v.get("use_absolute_position_embeddings", True) or v.get("use_mask_token", False):
            raise ValueError("internvl: vision towers without absolute position embeddings or with a mask token are not supported")
        encoder = {
            "name": "intern_vit", "depth": v.get("num_hidden_layers", 24), "hidden_size": v.get("hidden_size", 1024),
            "num_heads": v.get("num_attention_heads", 16), "intermediate_size": v.get("intermediate_size", 4096),
            "in_channels": v.get("num_channels", 3), "patch_size": side(v.get("patch_size", 14)),
            "image_size": side(v.get("image_size", 448)),
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
        if not hasattr(enc, "layer_scale_init") or not hasattr(proj, "act") or not hasattr(proj, "merge_size"):
            raise ValueError("an internvl export needs an intern_vit encoder and a pixel_shuffle_mlp projector")
        text, vl = self.text_config_to_hf(foundation)
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

    # ---- the tower's names ------------------------------------------------------------
    def qkv_names(self, layer: str, leaf: str) -> list[str]:
        return [f"{VISION}encoder.layer.{layer}.attention.{p}_proj.{leaf}" for p in "qkv"]

    def vision_to_ours(self, name: str) -> str | None:
        block = _BLOCK.match(name)
        if block:
            inner = renamed(block[2], _BLOCK_NAMES)
            if inner is not None:
                return f"image_encoder.blocks.{block[1]}.{inner}"
        ours = renamed(name, _TOP)
        if ours is None:
            raise KeyError(f"{self.model_type}: unexpected tensor {name!r} in the checkpoint")
        return ours

    def vision_to_hf(self, name: str) -> str:
        m = re.match(r"^image_encoder\.blocks\.(\d+)\.(.+)$", name)
        if m:
            inner = renamed(m[2], [(b, a) for a, b in _BLOCK_NAMES])
            if inner is not None:
                return f"{VISION}encoder.layer.{m[1]}.{inner}"
        hf_name = renamed(name, [(b, a) for a, b in _TOP])
        if hf_name is None:
            raise KeyError(f"{self.model_type}: no HF name for {name!r}")
        return hf_name


__all__ = ["InternVLAdapter"]
