"""Qwen2-VL (HF ``model_type: qwen2_vl``): config and tensor names, both directions.

Our model is ``OmniModel(foundation=Decoder, image_encoder=VisionTransformer,
projector=PatchMerger)``; parameter names only differ from transformers' by prefix:

    HF (saved; transformers 5 in-memory names in brackets)        ours
    model.embed_tokens / layers / norm   [model.language_model.*]   foundation.*
    lm_head.weight                                                   foundation.lm_head.weight
    visual.patch_embed / blocks          [model.visual.*]           image_encoder.*
    visual.merger.{ln_q, mlp.0, mlp.2}   [model.visual.merger.*]    projector.*

The VL special token ids (and Qwen2.5-VL's ``tokens_per_second``) are not model parameters;
they ride in ``foundation.extra_hf["vl"]`` so that an export writes them back.
"""

from __future__ import annotations

from typing import Any

from omniweave.models.hf.adapter import DecoderAdapter, MultimodalAdapter
from omniweave.models.hf.qwen2 import Qwen2Adapter
from omniweave.models.registry import register

VL_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
QWEN_VL_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
                     "vision_start_token_id": 151652, "vision_end_token_id": 151653}  # fmt: skip


def _get(cfg: Any, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


class Qwen2VLAdapter(MultimodalAdapter):
    """HF ⇄ omniweave for Qwen2-VL; Qwen2.5-VL subclasses it (``qwen2_5_vl.py``)."""

    config_sections = ("image_encoder", "projector")
    model_type = "qwen2_vl"
    architecture = "Qwen2VLForConditionalGeneration"
    text_model_type = "qwen2_vl_text"
    vision_model_type = "qwen2_vl_vision"
    multimodal = True
    text = Qwen2Adapter()  # the language model is a Qwen2 decoder with M-RoPE

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The recipe ``model:`` section (foundation, image_encoder, projector) of a HF config."""
        text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        foundation = self.text.config_to_ours(text)
        scaling = foundation.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type")) == "mrope":  # legacy {"type": "mrope", ...}
            foundation["rope_scaling"] = None
        if not foundation.get("mrope_section"):
            raise ValueError(f"{self.model_type}: the text config has no mrope_section (rope_parameters)")
        vl = {k: hf[k] for k in VL_KEYS if k in hf}
        vl.update(self.vl_extra_to_ours(hf))
        foundation["extra_hf"] = {**foundation.get("extra_hf", {}), "vl": vl}
        vision = dict(hf.get("vision_config") or {})
        image_encoder, projector = self.vision_config_to_ours(vision)
        if projector["out_dim"] != foundation["hidden_size"]:
            raise ValueError(f"{self.model_type}: merger output {projector['out_dim']} != text hidden size {foundation['hidden_size']}")
        return {"foundation": foundation, "image_encoder": image_encoder, "projector": projector}

    def vl_extra_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {}

    def vision_config_to_ours(self, v: dict[str, Any]) -> tuple[dict, dict]:
        if v.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise ValueError(f"qwen2_vl vision hidden_act {v['hidden_act']!r}: only quick_gelu is supported")
        embed = v.get("embed_dim", 1280)
        common = {"patch_size": v.get("patch_size", 14), "temporal_patch_size": v.get("temporal_patch_size", 2),
                  "spatial_merge_size": v.get("spatial_merge_size", 2),
                  "in_channels": v.get("in_channels", v.get("in_chans", 3))}  # fmt: skip
        encoder = {
            "name": "qwen2_vit",
            "depth": v.get("depth", 32),
            "hidden_size": embed,
            "num_heads": v.get("num_heads", 16),
            "intermediate_size": int(embed * v.get("mlp_ratio", 4)),
            "rope_theta": float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            **common,
        }
        projector = {"name": "patch_merger", "in_dim": embed, "out_dim": v.get("hidden_size", 3584),
                     "merge_size": common["spatial_merge_size"], "norm": "layernorm"}  # fmt: skip
        return encoder, projector

    def _config_to_hf(self, foundation, image_encoder, projector) -> dict[str, Any]:
        """HF config.json of our three component configs (dataclasses)."""
        extra = dict(foundation.extra_hf)
        vl = {**QWEN_VL_TOKEN_IDS, **extra.pop("vl", {})}
        text = self.text.config_to_hf(_replace_extra(foundation, extra))
        text.pop("architectures", None)
        text.update(model_type=self.text_model_type)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(foundation.mrope_section)}
        text.pop("rope_scaling", None)
        vision = self.vision_config_to_hf(image_encoder, projector)
        vision["model_type"] = self.vision_model_type
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": vision,
            "tie_word_embeddings": foundation.tie_word_embeddings,
            **{k: vl[k] for k in VL_KEYS},
        }
        out.update(self.vl_extra_to_hf(vl, out))
        return out

    def vl_extra_to_hf(self, vl: dict, out: dict) -> dict:
        return {}

    def vision_config_to_hf(self, enc, proj) -> dict[str, Any]:
        if enc.norm != "layernorm" or enc.mlp != "quick_gelu" or enc.window_size or proj.norm != "layernorm":
            raise ValueError("a qwen2_vl export needs a qwen2_vit encoder and a layernorm patch_merger")
        if enc.intermediate_size % enc.hidden_size:
            raise ValueError(f"qwen2_vl: intermediate_size {enc.intermediate_size} is not a multiple of {enc.hidden_size}")
        return {
            "depth": enc.depth, "embed_dim": enc.hidden_size, "hidden_size": proj.out_dim,
            "hidden_act": "quick_gelu", "mlp_ratio": enc.intermediate_size // enc.hidden_size,
            "num_heads": enc.num_heads, "in_channels": enc.in_channels, "patch_size": enc.patch_size,
            "spatial_merge_size": enc.spatial_merge_size, "temporal_patch_size": enc.temporal_patch_size,
            "rope_parameters": {"rope_theta": enc.rope_theta, "rope_type": "axial"},
        }  # fmt: skip

    # ---- tensor names ---------------------------------------------------------------
    def name_to_ours(self, hf_name: str) -> str | None:
        if hf_name.endswith("inv_freq"):
            return None
        for prefix in ("model.visual.merger.", "visual.merger."):
            if hf_name.startswith(prefix):
                return "projector." + hf_name[len(prefix) :]
        for prefix in ("model.visual.", "visual."):
            if hf_name.startswith(prefix):
                return "image_encoder." + hf_name[len(prefix) :]
        if hf_name.startswith("model.language_model."):
            return "foundation." + hf_name[len("model.language_model.") :]
        if hf_name == "lm_head.weight" or hf_name.startswith("model."):
            name = self.text.name_to_ours(hf_name)
            return None if name is None else "foundation." + name
        raise KeyError(f"{self.model_type}: unexpected tensor {hf_name!r} in the checkpoint")

    def name_to_hf(self, name: str) -> str:
        """Our name -> the name transformers' ``save_pretrained`` writes (checkpoint layout)."""
        if name.startswith("projector."):
            return "visual.merger." + name[len("projector.") :]
        if name.startswith("image_encoder."):
            return "visual." + name[len("image_encoder.") :]
        if name.startswith("foundation."):
            return self.text.name_to_hf(name[len("foundation.") :])
        raise KeyError(f"{self.model_type}: no HF name for {name!r}")


    def skip_on_export(self, model) -> set[str]:
        return {"foundation.lm_head.weight"} if model.foundation.config.tie_word_embeddings else set()


def _replace_extra(cfg, extra: dict):
    import dataclasses

    return dataclasses.replace(cfg, extra_hf=extra)


register("hf", "qwen2_vl")(Qwen2VLAdapter)

__all__ = ["Qwen2VLAdapter", "DecoderAdapter", "VL_KEYS"]
