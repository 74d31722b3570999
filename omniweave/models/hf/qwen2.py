"""Qwen2 / Qwen2.5 text models (HF ``model_type: qwen2``): q/k/v projections carry a bias."""

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.registry import register


@register("hf", "qwen2")
class Qwen2Adapter(DecoderAdapter):
    model_type, architecture, family = "qwen2", "Qwen2ForCausalLM", "qwen2"

    def family_config_to_ours(self, hf):
        return {"qkv_bias": True, "qk_norm": False}

    def family_config_to_hf(self, cfg):
        if not cfg.qkv_bias or cfg.qk_norm:
            raise ValueError("a qwen2 export needs qkv_bias=true and qk_norm=false")
        return {"use_sliding_window": False, "sliding_window": None}
