"""Llama / Llama-3 (HF ``model_type: llama``): no biases, llama3 rope scaling."""

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.registry import register


@register("hf", "llama")
class LlamaAdapter(DecoderAdapter):
    model_type, architecture, family = "llama", "LlamaForCausalLM", "llama"

    def family_config_to_ours(self, hf):
        if hf.get("mlp_bias"):
            raise NotImplementedError("llama: mlp_bias=true is not supported")
        return {"qkv_bias": bool(hf.get("attention_bias", False)), "qk_norm": False}

    def family_config_to_hf(self, cfg):
        if cfg.qk_norm:
            raise ValueError("a llama export cannot carry qk_norm")
        return {"attention_bias": cfg.qkv_bias, "mlp_bias": False}
