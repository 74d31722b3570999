"""DeepSeek-V3 (HF ``model_type: deepseek_v3``): multi-head latent attention (components/mla.py)
and a sigmoid-routed, group-limited MoE with shared experts (components/moe.py) after
``first_k_dense_replace`` dense layers.

Tensor names are transformers' (``self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj,
kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}``, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``); routed experts are stored one
tensor per expert (``hf/experts.py``). The released checkpoint's multi-token-prediction layer
(``model.layers.61.*``, beyond ``num_hidden_layers``) is not kept, as transformers drops it.
Config keys a field of ours lacks take transformers' ``DeepseekV3Config`` defaults.
"""

from __future__ import annotations

import re

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.hf.experts import PerExpertTensors
from omniweave.models.registry import register

# DeepseekV3Config defaults (transformers 5) of the keys read below: a config.json without a key means these
HF_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
               "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
               "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_interleave": True,
               "attention_bias": False}  # fmt: skip
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@register("hf", "deepseek_v3")
class DeepseekV3Adapter(PerExpertTensors, DecoderAdapter):
    model_type, architecture, family = "deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3"
    num_layers: int | None = None  # set when a config is read: tensors of later layers (MTP) are dropped

    def family_config_to_ours(self, hf):
        if hf.get("quantization_config"):
            raise NotImplementedError(f"deepseek_v3: quantized checkpoint ({hf['quantization_config'].get('quant_method', '?')}); "
                                      "dequantize it to bf16 first (e.g. DeepSeek's fp8_cast_bf16.py)")  # fmt: skip
        if hf.get("moe_layer_freq", 1) != 1:
            raise NotImplementedError(f"deepseek_v3: moe_layer_freq={hf['moe_layer_freq']} (transformers, and we, assume 1)")
        self.num_layers = hf["num_hidden_layers"]
        get = lambda key: hf.get(key, HF_DEFAULTS[key])
        return {
            "head_dim": None,  # HF's head_dim is the rope dim; ours is derived (qk_nope + qk_rope)
            "qkv_bias": bool(get("attention_bias")),
            **{k: get(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
                                   "topk_group", "routed_scaling_factor", "first_k_dense_replace")},
            "rope_interleave": bool(get("rope_interleave")),
            "norm_topk_prob": bool(get("norm_topk_prob")),
            "num_experts": hf.get("n_routed_experts", hf.get("num_local_experts", HF_DEFAULTS["n_routed_experts"])),
            "moe_router": "sigmoid",
        }  # fmt: skip

    def family_config_to_hf(self, cfg):
        if not cfg.num_experts or cfg.moe_router != "sigmoid" or cfg.qk_norm or cfg.mlp_only_layers \
                or cfg.decoder_sparse_step != 1 or cfg.sliding_window:  # fmt: skip
            raise ValueError("a deepseek_v3 export needs num_experts > 0, moe_router sigmoid, no qk_norm, "
                             "no mlp_only_layers, decoder_sparse_step 1 and no sliding_window")  # fmt: skip
        return {
            "head_dim": cfg.qk_rope_head_dim, "attention_bias": cfg.qkv_bias, "rope_interleave": cfg.rope_interleave,
            **{k: getattr(cfg, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim", "num_experts_per_tok", "moe_intermediate_size",
                                            "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                                            "first_k_dense_replace", "norm_topk_prob")},
            "n_routed_experts": cfg.num_experts, "num_nextn_predict_layers": 0,  # no MTP weights of ours
        }  # fmt: skip

    def name_to_ours(self, hf_name: str) -> str | None:
        m = _LAYER.match(hf_name)
        if m is not None and self.num_layers is not None and int(m.group(1)) >= self.num_layers:
            return None  # the multi-token-prediction module (transformers ignores it too)
        return super().name_to_ours(hf_name)
