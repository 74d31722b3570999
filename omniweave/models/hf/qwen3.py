"""Qwen3 (HF ``model_type: qwen3``): RMSNorm on q and k per head, head_dim set independently."""

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.registry import register


@register("hf", "qwen3")
class Qwen3Adapter(DecoderAdapter):
    model_type, architecture, family = "qwen3", "Qwen3ForCausalLM", "qwen3"

    def family_config_to_ours(self, hf):
        return {"qkv_bias": bool(hf.get("attention_bias", False)), "qk_norm": True}

    def family_config_to_hf(self, cfg):
        if not cfg.qk_norm:
            raise ValueError("a qwen3 export needs qk_norm=true")
        return {"attention_bias": cfg.qkv_bias, "use_sliding_window": False, "sliding_window": None}
