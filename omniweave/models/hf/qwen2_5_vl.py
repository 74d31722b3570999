"""Qwen2.5-VL (HF ``model_type: qwen2_5_vl``): like Qwen2-VL (same tensor names, see
``qwen2_vl.py``) with an RMSNorm / SwiGLU / window-attention vision tower and an RMSNorm merger.
``tokens_per_second`` (video M-RoPE time scale, a data setting for us) is carried for export."""

from __future__ import annotations

from typing import Any

from omniweave.models.hf.qwen2_vl import Qwen2VLAdapter
from omniweave.models.registry import register


@register("hf", "qwen2_5_vl")
class Qwen25VLAdapter(Qwen2VLAdapter):
    model_type = "qwen2_5_vl"
    architecture = "Qwen2_5_VLForConditionalGeneration"
    text_model_type = "qwen2_5_vl_text"
    vision_model_type = "qwen2_5_vl_vision"

    def vl_extra_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        tps = (hf.get("vision_config") or {}).get("tokens_per_second")
        return {} if tps is None else {"tokens_per_second": tps}

    def vl_extra_to_hf(self, vl: dict, out: dict) -> dict:
        out["vision_config"]["tokens_per_second"] = vl.get("tokens_per_second", 2)
        return {}

    def vision_config_to_ours(self, v: dict[str, Any]) -> tuple[dict, dict]:
        if v.get("hidden_act", "silu") != "silu":
            raise ValueError(f"qwen2_5_vl vision hidden_act {v['hidden_act']!r}: only silu is supported")
        hidden = v.get("hidden_size", 1280)
        merge = v.get("spatial_merge_size", 2)
        encoder = {
            "name": "qwen2_5_vit",
            "depth": v.get("depth", 32),
            "hidden_size": hidden,
            "num_heads": v.get("num_heads", 16),
            "intermediate_size": v.get("intermediate_size", 3420),
            "patch_size": v.get("patch_size", 14),
            "temporal_patch_size": v.get("temporal_patch_size", 2),
            "spatial_merge_size": merge,
            "in_channels": v.get("in_channels", v.get("in_chans", 3)),
            "window_size": v.get("window_size", 112),
            "fullatt_block_indexes": list(v.get("fullatt_block_indexes", [7, 15, 23, 31])),
            "rope_theta": float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        }
        projector = {"name": "patch_merger", "in_dim": hidden, "out_dim": v.get("out_hidden_size", 3584),
                     "merge_size": merge, "norm": "rmsnorm"}  # fmt: skip
        return encoder, projector

    def vision_config_to_hf(self, enc, proj) -> dict[str, Any]:
        if enc.norm != "rmsnorm" or enc.mlp != "swiglu" or not enc.window_size or proj.norm != "rmsnorm":
            raise ValueError("a qwen2_5_vl export needs a qwen2_5_vit encoder and an rmsnorm patch_merger")
        return {
            "depth": enc.depth, "hidden_size": enc.hidden_size, "out_hidden_size": proj.out_dim,
            "hidden_act": "silu", "intermediate_size": enc.intermediate_size, "num_heads": enc.num_heads,
            "in_channels": enc.in_channels, "patch_size": enc.patch_size,
            "spatial_merge_size": enc.spatial_merge_size, "temporal_patch_size": enc.temporal_patch_size,
            "window_size": enc.window_size, "fullatt_block_indexes": list(enc.fullatt_block_indexes),
            "rope_parameters": {"rope_theta": enc.rope_theta, "rope_type": "axial"},
        }  # fmt: skip
